"""Static-batch generation: one jitted prefill, then a jitted `lax.while_loop` of decode steps.

The KV cache is donated to both, so decoding updates it in place. Prompts of different lengths are
right-padded; each row then decodes from its own length. The loop ends when every row has stopped
(eos, a stop token, or its own max_new_tokens) or at the batch's largest max_new_tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.decoding.sampling import (
  SamplingArrays,
  SamplingParams,
  eos_ids,
  sample_rows,
  step_keys,
)
from atlas_jax.model.transformer import Transformer

Array = jax.Array

__all__ = ["SamplingParams", "generate"]


def _bucket(n: int, minimum: int = 16) -> int:
  """Rounds up to a power of two so a few compiled shapes serve every prompt length."""
  return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _prefill(graphdef, params, tokens_BT, cache, lengths_B):
  model = nnx.merge(graphdef, params)
  # Right padding: the next-token logits of row b sit at its last real token.
  logits_B1V, cache = model(tokens_BT, cache=cache, logits_at_B=lengths_B - 1)
  return logits_B1V[:, 0], cache.replace(lengths=lengths_B)


@functools.partial(jax.jit, static_argnums=(0, 8, 9), donate_argnums=2)
def _decode_loop(
  graphdef,
  params,
  cache,
  logits_BV,
  seed_B,
  arrays: SamplingArrays,
  limits_B,
  stop_BS,
  max_new_tokens,
  penalties,
  prompt_mask_BV,
):
  """Samples up to max_new_tokens per row; a row stops on a token of its stop_BS row or its limit.

  Returns:
    (i32[B, max_new_tokens] tokens, f32[B, max_new_tokens] their logprobs, steps run, cache).
  """
  B, V = logits_BV.shape
  out_BN = jnp.zeros((B, max_new_tokens), jnp.int32)
  logp_BN = jnp.zeros((B, max_new_tokens), jnp.float32)
  counts_BV = jnp.zeros((B, V), jnp.int32)

  def cond(carry):
    i, done_B = carry[0], carry[-1]
    return (i < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    i, cache, logits_BV, out_BN, logp_BN, counts_BV, done_B = carry
    token_B, token_logp_B, _, _ = sample_rows(
      logits_BV,
      step_keys(seed_B, jnp.full((B,), i, jnp.int32)),
      arrays,
      counts_BV=counts_BV if penalties else None,
      prompt_mask_BV=prompt_mask_BV if penalties else None,
    )
    token_B = jnp.where(done_B, 0, token_B)
    out_BN = out_BN.at[:, i].set(token_B)
    logp_BN = logp_BN.at[:, i].set(token_logp_B)
    if penalties:
      counts_BV = counts_BV.at[jnp.arange(B), token_B].add(jnp.where(done_B, 0, 1))
    done_B = done_B | jnp.any(token_B[:, None] == stop_BS, axis=1) | (i + 1 >= limits_B)
    model = nnx.merge(graphdef, params)
    logits_B1V, cache = model(token_B[:, None], cache=cache)
    return i + 1, cache, logits_B1V[:, 0], out_BN, logp_BN, counts_BV, done_B

  carry = (jnp.int32(0), cache, logits_BV, out_BN, logp_BN, counts_BV, jnp.zeros((B,), bool))
  steps, cache, _, out_BN, logp_BN, _, _ = jax.lax.while_loop(cond, body, carry)
  return out_BN, logp_BN, steps, cache


def _stop_ids(params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
  ids = list(params.stop_token_ids)
  if not params.ignore_eos:
    ids += eos
  return ids


def token_lists(prompts) -> list[list[int]]:
  """Prompts as lists of ints: from lists, or numpy / jax arrays (a 2-D array is one prompt per
  row)."""
  if isinstance(prompts, str | bytes):
    raise ValueError("generate: prompts must be token id lists, not text (encode it first)")
  if hasattr(prompts, "ndim") and prompts.ndim != 2:
    raise ValueError(
      f"generate: a prompts array must be 2-D [B, T], got shape {tuple(prompts.shape)} "
      "(one prompt: pass [prompt])"
    )
  out = []
  for b, p in enumerate(prompts):
    row = np.asarray(p)
    if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
      raise ValueError(f"generate: prompt {b} is not a list of integer token ids")
    out.append(row.astype(np.int64).tolist())
  return out


def generate(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  params: SamplingParams | Sequence[SamplingParams] | None = None,
  *,
  eos_id: int | Sequence[int] | None = None,
  return_logprobs: bool = False,
  draft: Transformer | str | None = None,
  num_speculative_tokens: int = 4,
):
  """Completes each prompt; returns the new tokens per prompt (ending at the stop token drawn).

  Args:
    model: a Transformer.
    prompts: token id lists, each non-empty (or a 2-D numpy / jax array, one prompt per row).
    params: one SamplingParams for all rows, or one per row. Stop strings (`params.stop`) need a
      tokenizer and are honoured by the serving engine, not here.
    eos_id: stop a row once it draws this token, or any of these tokens (kept in the output),
      unless its ignore_eos.
    return_logprobs: also return each generated token's logprob (f32 lists).
    draft: speculative decoding (`atlas_jax.decoding.speculative`): a model with the same
      vocabulary that proposes `num_speculative_tokens` tokens per target pass, or "mtp" for the
      model's own multi-token-prediction heads. The output has the same law as without it (and
      the same tokens when greedy). Rows with repetition/presence/frequency penalties decode
      without it.
    num_speculative_tokens: k, draft tokens per round.

  Returns:
    list of i32 token lists; with return_logprobs, (tokens, logprobs).
  """
  prompts = token_lists(prompts)
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate: every prompt needs at least one token")
  B = len(prompts)
  params = SamplingParams() if params is None else params
  per_row = [params] * B if isinstance(params, SamplingParams) else list(params)
  if len(per_row) != B:
    raise ValueError(f"generate: {len(per_row)} SamplingParams for {B} prompts")
  if any(p.guided is not None for p in per_row):
    raise ValueError("generate: guided decoding (SamplingParams.guided) is served by the Engine")
  for name, unset in (("min_tokens", 0), ("prompt_logprobs", None)):
    if any(getattr(p, name) != unset for p in per_row):
      raise ValueError(f"generate: SamplingParams.{name} is served by the Engine")
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

  eos = eos_ids(eos_id)
  stops = [_stop_ids(p, eos) for p in per_row]
  stop_BS = np.full((B, max(1, max(len(s) for s in stops))), -1, np.int32)
  for b, s in enumerate(stops):
    stop_BS[b, : len(s)] = s
  penalties = any(p.uses_penalties for p in per_row)
  if draft is not None and not penalties:
    from atlas_jax.decoding import speculative

    speculative.check_draft(model, draft, num_speculative_tokens)
    out, logp, _ = speculative.speculative_generate(
      model, draft, prompts, per_row, stops=stops, k=num_speculative_tokens
    )
    return _finish(out, logp, per_row, stops, return_logprobs)
  prompt_mask_BV = np.zeros((B, vocab), bool)
  if penalties:
    for b, p in enumerate(prompts):
      prompt_mask_BV[b, list(p)] = True

  graphdef, state = nnx.split(model)
  cache = model.init_cache(B, capacity)
  logits_BV, cache = _prefill(graphdef, state, jnp.asarray(tokens), cache, jnp.asarray(lengths))
  out_BN, logp_BN, _, _ = _decode_loop(
    graphdef,
    state,
    cache,
    logits_BV,
    jnp.asarray([p.seed for p in per_row], jnp.int32),
    SamplingArrays.from_params(per_row),
    jnp.asarray([p.max_new_tokens for p in per_row], jnp.int32),
    jnp.asarray(stop_BS),
    max_new,
    penalties,
    jnp.asarray(prompt_mask_BV) if penalties else None,
  )
  return _finish(np.asarray(out_BN), np.asarray(logp_BN), per_row, stops, return_logprobs)


def _finish(out, logp, per_row, stops, return_logprobs):
  """Per-row token (and logprob) lists, each cut at its first stop token or its limit."""
  results, logprobs = [], []
  for b, p in enumerate(per_row):
    row = out[b, : p.max_new_tokens].tolist()
    hits = [i for i, t in enumerate(row) if t in stops[b]]
    n = hits[0] + 1 if hits else len(row)
    results.append(row[:n])
    logprobs.append(logp[b, :n].tolist())
  return (results, logprobs) if return_logprobs else results
