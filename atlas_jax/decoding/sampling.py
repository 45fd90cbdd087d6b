"""Token sampling, vectorised over the batch with per-row parameters.

Every row has its own temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 = off)
and penalties, so requests with different settings share one jitted decode step. A row's draw
depends only on its logits and its own key: the generation loop and the serving engine both derive
the key of a request's i-th token as `fold_in(key(seed), i)`, so the same seed gives the same
output whatever the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from atlas_jax.decoding.guided import Grammar, ReasoningGate

Array = jax.Array

# Top alternatives returned per token when logprobs are asked for (as OpenAI's chat API and
# vLLM's default --max-logprobs: 0..20).
MAX_LOGPROBS = 20
# The largest values the jitted steps' per-row arrays (i32, f32) hold.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _iterable(value) -> bool:
  try:
    iter(value)
  except TypeError:
    return False
  return True


def _int_in(name: str, value, lo: int, hi: int) -> int:
  """`value` as an int in [lo, hi], or a ValueError naming the field, the value and the range."""
  if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name}={value!r} is not allowed: must be an integer in [{lo}, {hi}]")
  if not lo <= value <= hi:
    raise ValueError(f"{name}={value} is not allowed: must be in [{lo}, {hi}]")
  return int(value)


def _float_in(name: str, value, lo: float, hi: float, allowed: str) -> float:
  """`value` as a finite float in [lo, hi] (so a finite float32), or a ValueError."""
  if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name}={value!r} is not allowed: {allowed}")
  value = float(value)
  if not (math.isfinite(value) and lo <= value <= hi):
    raise ValueError(f"{name}={value} is not allowed: {allowed}")
  return value


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
  """`logit_bias` as sorted (token id, bias) pairs, from pairs or a {token id: bias} dict."""
  allowed = "must map token ids (integers >= 0) to biases in [-100, 100]"
  if isinstance(value, dict):
    value = value.items()
  if isinstance(value, str | bytes) or not _iterable(value):
    raise ValueError(f"logit_bias={value!r} is not allowed: {allowed}")
  pairs = {}
  for pair in value:
    if isinstance(pair, str | bytes) or not _iterable(pair) or len(tuple(pair)) != 2:
      raise ValueError(f"logit_bias entry {pair!r} is not allowed: {allowed}")
    token, bias = pair
    pairs[_int_in("logit_bias token id", token, 0, INT32_MAX)] = _float_in(
      f"logit_bias[{token}]", bias, -100.0, 100.0, "must be a number in [-100, 100]"
    )
  return tuple(sorted(pairs.items()))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is decoded and when it stops.

  `max_new_tokens` is the OpenAI `max_tokens`; `stop_token_ids` and `stop` (strings, checked on
  the detokenised text by the serving engine) end a request in addition to the model's eos ids.
  The fields after `guided` are vLLM's and are honoured by the serving engine only.
  """

  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
  presence_penalty: float = 0.0  # subtracted once from every token already generated
  frequency_penalty: float = 0.0  # subtracted per occurrence in the output
  seed: int = 0
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  logprobs: int | None = None  # None: none; n: the sampled token's plus the top n (n <= 5)
  # A compiled constraint (`atlas_jax.decoding.guided.Grammar`, from a GrammarCompiler): the
  # output must match it; a `ReasoningGate` around one: the output after the end-of-reasoning
  # token must. Served by the Engine, which masks each draw with it.
  guided: Grammar | ReasoningGate | None = None
  # Added to the logits before anything else but the guided mask, as (token id, bias) pairs
  # (a {token id: bias} dict is accepted), each bias in [-100, 100].
  logit_bias: tuple[tuple[int, float], ...] = ()
  min_tokens: int = 0  # eos and stop tokens are masked, and stop strings unchecked, until then
  skip_special_tokens: bool = True  # the output text leaves special tokens out
  include_stop_str_in_output: bool = False  # the text ends after the stop string, not before it
  prompt_logprobs: int | None = None  # each prompt token's logprob (the first: None) and top n

  def __post_init__(self):
    # Every field must fit what the jitted step holds (i32 and f32 per row), so a request that
    # passes here cannot overflow inside a batched step and take its neighbours down with it.
    ints = {
      "max_new_tokens": (1, INT32_MAX),
      "top_k": (0, INT32_MAX),
      "seed": (0, INT32_MAX),
      "min_tokens": (0, INT32_MAX),
    }
    for name, (lo, hi) in ints.items():
      object.__setattr__(self, name, _int_in(name, getattr(self, name), lo, hi))
    floats = {
      "temperature": (0.0, FLOAT32_MAX, "must be a finite number >= 0 (0 is greedy)"),
      "top_p": (0.0, 1.0, "must be in (0, 1] (1 disables top-p)"),
      "min_p": (0.0, 1.0, "must be in [0, 1] (0 disables min-p)"),
      "repetition_penalty": (0.0, FLOAT32_MAX, "must be a finite number > 0 (1 is off)"),
      "presence_penalty": (-2.0, 2.0, "must be in [-2, 2]"),
      "frequency_penalty": (-2.0, 2.0, "must be in [-2, 2]"),
    }
    for name, (lo, hi, allowed) in floats.items():
      value = _float_in(name, getattr(self, name), lo, hi, allowed)
      if value == 0 and name in ("top_p", "repetition_penalty"):
        raise ValueError(f"{name}=0.0 is not allowed: {allowed}")
      object.__setattr__(self, name, value)
    if self.min_tokens > self.max_new_tokens:
      raise ValueError(
        f"min_tokens={self.min_tokens} is not allowed: must be <= max_new_tokens="
        f"{self.max_new_tokens}"
      )
    for name in ("logprobs", "prompt_logprobs"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, _int_in(name, getattr(self, name), 0, MAX_LOGPROBS))
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
      if not isinstance(getattr(self, name), bool | np.bool_):
        raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: must be true or false")
      object.__setattr__(self, name, bool(getattr(self, name)))
    object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
    if isinstance(self.stop_token_ids, str | bytes) or not _iterable(self.stop_token_ids):
      raise ValueError(
        f"stop_token_ids={self.stop_token_ids!r} is not allowed: must be a list of token ids"
      )
    object.__setattr__(
      self,
      "stop_token_ids",
      tuple(_int_in("stop_token_ids", t, 0, INT32_MAX) for t in self.stop_token_ids),
    )
    stop = (self.stop,) if isinstance(self.stop, str) else self.stop
    if not _iterable(stop) or not all(isinstance(s, str) and s for s in stop):
      raise ValueError(f"stop={self.stop!r} is not allowed: must be a list of non-empty strings")
    object.__setattr__(self, "stop", tuple(stop))

  @property
  def uses_penalties(self) -> bool:
    return (
      self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0
    )


def eos_ids(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
  """The end-of-sequence ids as a tuple: one id, several (Llama-3-Instruct stops on two), or
  none."""
  if eos_id is None:
    return ()
  ids = (eos_id,) if isinstance(eos_id, numbers.Integral) else tuple(eos_id)
  if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
    raise ValueError(f"eos_id={eos_id!r} is not allowed: must be a token id or a list of them")
  return tuple(int(i) for i in ids)


# A padding row's controls (greedy), made once: every step pads its batch with them.
PADDING = SamplingParams()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
  """Per-row sampling parameters as device arrays (one row per sequence of the batch)."""

  temperature: Array  # f32[B]
  top_k: Array  # i32[B]
  top_p: Array  # f32[B]
  min_p: Array  # f32[B]
  repetition: Array  # f32[B]
  presence: Array  # f32[B]
  frequency: Array  # f32[B]
  # i32[B, W] packed allowed tokens (bit v % 32 of word v // 32) for guided rows, all bits set
  # for the others; None when no row is guided.
  allowed_bits: Array | None = None
  # logit_bias: i32[B, NB] token ids and f32[B, NB] biases (padding: token 0, bias 0); None when
  # no row has one.
  bias_ids: Array | None = None
  bias_values: Array | None = None

  @classmethod
  def from_params(
    cls,
    params: Sequence[SamplingParams],
    pad_to: int | None = None,
    allowed_bits: np.ndarray | None = None,
  ):
    """Rows for `params`, padded (greedy) to `pad_to` rows; `allowed_bits` i32[pad_to, W]."""
    rows = list(params) + [PADDING] * ((pad_to or len(params)) - len(params))
    col = lambda name, dt: np.asarray([getattr(p, name) for p in rows], dt)
    bias_ids = bias_values = None
    n_bias = max((len(p.logit_bias) for p in rows), default=0)
    if n_bias:
      NB = 1 << (n_bias - 1).bit_length()  # a power of two: few compiled shapes
      bias_ids = np.zeros((len(rows), NB), np.int32)
      bias_values = np.zeros((len(rows), NB), np.float32)
      for b, p in enumerate(rows):
        for j, (token, bias) in enumerate(p.logit_bias):
          bias_ids[b, j], bias_values[b, j] = token, bias
    return cls(
      temperature=col("temperature", np.float32),
      top_k=col("top_k", np.int32),
      top_p=col("top_p", np.float32),
      min_p=col("min_p", np.float32),
      repetition=col("repetition_penalty", np.float32),
      presence=col("presence_penalty", np.float32),
      frequency=col("frequency_penalty", np.float32),
      allowed_bits=allowed_bits,
      bias_ids=bias_ids,
      bias_values=bias_values,
    )


def apply_bias(logits_BV: Array, arrays: SamplingArrays) -> Array:
  """The logits plus each row's logit_bias (f32[B, V]); unchanged when no row has one."""
  if arrays.bias_ids is None:
    return logits_BV
  rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
  return logits_BV.at[rows_B1, arrays.bias_ids].add(arrays.bias_values)


def unpack_allowed(bits_BW: Array, vocab_size: int) -> Array:
  """bool[B, V] from packed allowed-token bits i32[B, W] (bit v % 32 of word v // 32)."""
  v_V = jnp.arange(vocab_size)
  words_BV = bits_BW[:, v_V >> 5]
  return ((words_BV >> (v_V & 31)) & 1).astype(bool)


def mask_logits(logits_BV: Array, bits_BW: Array) -> Array:
  """The logits with every token the packed mask i32[B, W] leaves out at -inf."""
  return jnp.where(unpack_allowed(bits_BW, logits_BV.shape[-1]), logits_BV, -jnp.inf)


def apply_penalties(
  logits_BV: Array,
  counts_BV: Array,
  prompt_mask_BV: Array,
  *,
  repetition_B: Array,
  presence_B: Array,
  frequency_B: Array,
) -> Array:
  """Repetition (CTRL-style, on prompt and output tokens), presence and frequency penalties.

  Args:
    logits_BV: f32[B, V].
    counts_BV: i32[B, V] occurrences of each token in the output so far.
    prompt_mask_BV: bool[B, V] tokens present in the prompt.
    repetition_B: f32[B]; seen tokens' positive logits are divided by it, negative multiplied.
    presence_B: f32[B]; subtracted from tokens generated at least once.
    frequency_B: f32[B]; subtracted once per occurrence in the output.
  """
  seen_BV = (counts_BV > 0) | prompt_mask_BV
  rep_B1 = repetition_B[:, None]
  penalised_BV = jnp.where(logits_BV > 0, logits_BV / rep_B1, logits_BV * rep_B1)
  logits_BV = jnp.where(seen_BV, penalised_BV, logits_BV)
  counts_BV = counts_BV.astype(jnp.float32)
  return logits_BV - presence_B[:, None] * (counts_BV > 0) - frequency_B[:, None] * counts_BV


def sample(
  logits_BV: Array,
  key_B: Array,
  *,
  temperature_B: Array,
  top_k_B: Array,
  top_p_B: Array,
  min_p_B: Array | None = None,
) -> Array:
  """Draws one token per row.

  Args:
    logits_BV: f32[B, V].
    key_B: [B] per-row PRNG keys (so a row's draw does not depend on its batch neighbours).
    temperature_B: f32[B]; 0 picks the argmax.
    top_k_B: i32[B]; keep the k most likely tokens, 0 keeps all.
    top_p_B: f32[B]; keep the smallest set whose probability reaches p (nucleus), 1 keeps all.
    min_p_B: f32[B]; keep tokens at least min_p times as likely as the most likely one, 0 keeps
      all.

  Returns:
    i32[B] tokens.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def draw():
    kept_BV = _filtered(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B)
    sampled_B = jax.vmap(jax.random.categorical)(key_B, kept_BV).astype(jnp.int32)
    return jnp.where(temperature_B > 0, sampled_B, greedy_B)

  # A batch of greedy rows skips the filters and the [B, V] random draw altogether.
  return jax.lax.cond(jnp.any(temperature_B > 0), draw, lambda: greedy_B)


# Top-k alone, with every k at most this, finds the k-th logit with `lax.top_k` instead of a sort.
TOP_K_WITHOUT_SORT = 256


def _filtered(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B):
  """f32[B, V]: the logits over the temperature, -inf for tokens the filters drop, in vocabulary
  order (so a row's draw does not depend on how its neighbours' filters made the batch filter).

  top-k keeps every token at least as likely as the k-th (ties with it are kept, as in Hugging
  Face's top-k); top-p keeps tokens, most likely first, while the probability before them is
  below p (the most likely always survives); min-p keeps tokens at least min_p times as likely
  as the most likely. Sorting the vocabulary costs far more than the softmax on a CPU (tens of
  microseconds a row), so a batch with no filter skips it, and one with top-k alone (k <=
  TOP_K_WITHOUT_SORT) takes the k-th logit from `lax.top_k`.
  """
  B, V = logits_BV.shape
  scaled_BV = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]

  def kth(desc_BX):
    """The k-th largest logit per row from its X largest in decreasing order (-inf: no top-k)."""
    X = desc_BX.shape[1]
    at_B1 = jnp.clip(top_k_B, 1, X)[:, None] - 1
    return jnp.where(top_k_B > 0, jnp.take_along_axis(desc_BX, at_B1, axis=1)[:, 0], -jnp.inf)

  def top_k_only(scaled_BV):
    desc_BX, _ = jax.lax.top_k(scaled_BV, min(TOP_K_WITHOUT_SORT, V))
    return jnp.where(scaled_BV >= kth(desc_BX)[:, None], scaled_BV, -jnp.inf)

  def sorted_filters(scaled_BV):
    order_BV = jnp.argsort(-scaled_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    cum_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (sorted_BV >= kth(sorted_BV)[:, None]) & (cum_before_BV < top_p_B[:, None])
    if min_p_B is not None:
      keep_BV &= probs_BV >= min_p_B[:, None] * probs_BV[:, :1]
    rows_B1 = jnp.arange(B)[:, None]
    keep_BV = jnp.zeros((B, V), bool).at[rows_B1, order_BV].set(keep_BV)
    return jnp.where(keep_BV, scaled_BV, -jnp.inf)

  needs_sort = jnp.any(top_p_B < 1) | jnp.any(top_k_B > TOP_K_WITHOUT_SORT)
  if min_p_B is not None:
    needs_sort |= jnp.any(min_p_B > 0)
  mode = jnp.where(needs_sort, 2, jnp.where(jnp.any(top_k_B > 0), 1, 0))
  return jax.lax.switch(mode, [lambda x: x, top_k_only, sorted_filters], scaled_BV)


def probabilities(logits_BV: Array, arrays: SamplingArrays) -> Array:
  """f32[B, V]: the distribution `sample` draws each row's token from.

  Temperature, top-k, top-p and min-p applied exactly as `sample` applies them; a greedy row is
  one-hot at its argmax. Speculative decoding compares the target's and the draft's under the
  same controls. The logit bias is included; penalties are not.
  """
  logits_BV = apply_bias(logits_BV.astype(jnp.float32), arrays)
  V = logits_BV.shape[-1]
  kept_BV = _filtered(logits_BV, arrays.temperature, arrays.top_k, arrays.top_p, arrays.min_p)
  probs_BV = jax.nn.softmax(kept_BV, axis=-1)
  greedy_BV = jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), V, dtype=jnp.float32)
  return jnp.where(arrays.temperature[:, None] > 0, probs_BV, greedy_BV)


@jax.named_scope("sampling")  # named for step profiles (bench/step_profile.py)
def sample_rows(
  logits_BV: Array,
  key_B: Array,
  arrays: SamplingArrays,
  *,
  counts_BV: Array | None = None,
  prompt_mask_BV: Array | None = None,
) -> tuple[Array, Array, Array, Array]:
  """The guided mask (when `arrays.allowed_bits` is set), the logit bias, penalties (when counts
  are given), then `sample`, then the logprobs of the draw.

  Disallowed tokens get -inf before anything else, so top-k / top-p / min-p choose among allowed
  tokens only. Logprobs are those of the model's distribution (before the mask, penalties and
  filters), as the OpenAI API reports them.

  Returns:
    (i32[B] tokens, f32[B] their logprobs, i32[B, 5] top tokens, f32[B, 5] their logprobs).
  """
  logits_BV = logits_BV.astype(jnp.float32)
  logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
  if arrays.allowed_bits is not None:
    logits_BV = mask_logits(logits_BV, arrays.allowed_bits)
  logits_BV = apply_bias(logits_BV, arrays)
  if counts_BV is not None:
    logits_BV = apply_penalties(
      logits_BV,
      counts_BV,
      prompt_mask_BV,
      repetition_B=arrays.repetition,
      presence_B=arrays.presence,
      frequency_B=arrays.frequency,
    )
  token_B = sample(
    logits_BV,
    key_B,
    temperature_B=arrays.temperature,
    top_k_B=arrays.top_k,
    top_p_B=arrays.top_p,
    min_p_B=arrays.min_p,
  )
  token_logp_B = jnp.take_along_axis(logp_BV, token_B[:, None], axis=-1)[:, 0]
  top_logp_Bk, top_ids_Bk = jax.lax.top_k(logp_BV, min(MAX_LOGPROBS, logp_BV.shape[-1]))
  return token_B, token_logp_B, top_ids_Bk.astype(jnp.int32), top_logp_Bk


def step_keys(seed_B: Array, step_B: Array) -> Array:
  """[B] keys: the key of each row's `step_B`-th generated token under its `seed_B`."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_B, step_B)
