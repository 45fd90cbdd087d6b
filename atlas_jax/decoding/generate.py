"""Static-batch generation: one jitted prefill, then a jitted `lax.while_loop` of decode steps.

The KV cache is donated to both, so decoding updates it in place. Prompts of different lengths are
right-padded; each row then decodes from its own length.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.decoding.sampling import sample
from atlas_jax.model.transformer import Transformer

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be > 0")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def _bucket(n: int, minimum: int = 16) -> int:
  """Rounds up to a power of two so a few compiled shapes serve every prompt length."""
  return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _prefill(graphdef, params, tokens_BT, cache, lengths_B):
  model = nnx.merge(graphdef, params)
  logits_BTV, cache = model(tokens_BT, cache=cache)
  # Right padding: the next-token logits of row b sit at its last real token.
  last_BV = jnp.take_along_axis(logits_BTV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  return last_BV, cache.replace(lengths=lengths_B)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=2)
def _decode_loop(graphdef, params, cache, logits_BV, keys_B, sampling, max_new_tokens, eos_id):
  temperature_B, top_k_B, top_p_B = sampling
  B = logits_BV.shape[0]
  out_BN = jnp.zeros((B, max_new_tokens), jnp.int32)

  def cond(carry):
    i, _, _, _, done_B = carry
    return (i < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    i, cache, logits_BV, out_BN, done_B = carry
    step_keys_B = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys_B)
    token_B = sample(
      logits_BV, step_keys_B, temperature_B=temperature_B, top_k_B=top_k_B, top_p_B=top_p_B
    )
    token_B = jnp.where(done_B, 0, token_B)
    out_BN = out_BN.at[:, i].set(token_B)
    done_B = done_B | (token_B == eos_id)
    model = nnx.merge(graphdef, params)
    logits_B1V, cache = model(token_B[:, None], cache=cache)
    return i + 1, cache, logits_B1V[:, 0], out_BN, done_B

  carry = (jnp.int32(0), cache, logits_BV, out_BN, jnp.zeros((B,), bool))
  steps, cache, _, out_BN, _ = jax.lax.while_loop(cond, body, carry)
  return out_BN, steps, cache


def generate(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
  *,
  eos_id: int | None = None,
) -> list[list[int]]:
  """Completes each prompt; returns the new tokens per prompt (ending at eos when it is drawn).

  Args:
    model: a Transformer.
    prompts: token id lists, each non-empty.
    params: one SamplingParams for all rows, or one per row (max_new_tokens is the batch maximum).
    eos_id: stop a row once it draws this token (kept in the output).
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate: every prompt needs at least one token")
  B = len(prompts)
  per_row = [params] * B if isinstance(params, SamplingParams) else list(params)
  if len(per_row) != B:
    raise ValueError(f"generate: {len(per_row)} SamplingParams for {B} prompts")
  max_new = max(p.max_new_tokens for p in per_row)
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  T = _bucket(int(lengths.max()))
  capacity = T + _bucket(max_new)
  if capacity > model.cfg.max_seq_len and int(lengths.max()) + max_new > model.cfg.max_seq_len:
    raise ValueError(
      f"generate: prompt length {int(lengths.max())} + max_new_tokens {max_new} exceeds the "
      f"model's max_seq_len={model.cfg.max_seq_len}"
    )
  vocab = model.cfg.vocab_size
  tokens = np.zeros((B, T), np.int32)
  for b, p in enumerate(prompts):
    if min(p) < 0 or max(p) >= vocab:
      raise ValueError(f"generate: prompt {b} has token ids outside [0, {vocab})")
    tokens[b, : len(p)] = p

  graphdef, state = nnx.split(model)
  cache = model.init_cache(B, capacity)
  logits_BV, cache = _prefill(graphdef, state, jnp.asarray(tokens), cache, jnp.asarray(lengths))
  keys_B = jnp.stack([jax.random.key(p.seed) for p in per_row])
  sampling = (
    jnp.asarray([p.temperature for p in per_row], jnp.float32),
    jnp.asarray([p.top_k for p in per_row], jnp.int32),
    jnp.asarray([p.top_p for p in per_row], jnp.float32),
  )
  out_BN, _, _ = _decode_loop(
    graphdef,
    state,
    cache,
    logits_BV,
    keys_B,
    sampling,
    max_new,
    jnp.int32(-1 if eos_id is None else eos_id),
  )
  out = np.asarray(out_BN)
  results = []
  for b, p in enumerate(per_row):
    row = out[b, : p.max_new_tokens].tolist()
    if eos_id is not None and eos_id in row:
      row = row[: row.index(eos_id) + 1]
    results.append(row)
  return results
