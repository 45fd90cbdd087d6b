"""Static-batch generation: one jitted prefill, then a jitted `lax.while_loop` of decode steps.

The KV cache is donated to both, so decoding updates it in place. Prompts of different lengths are
right-padded; each row then decodes from its own length. The loop ends when every row has stopped
(eos, a stop token, or its own max_new_tokens) or at the batch's largest max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.decoding import batching, speculative
from atlas_jax.decoding.drafters import NGramDrafter
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCarry:
  """The decode loop's state between steps."""

  i: Array  # i32[] steps run: the index of the token each row draws next
  cache: object  # every row's prompt and tokens so far
  logits_BV: Array  # f32[B, V] the next-token logits
  out_BO: Array  # i32[B, O] tokens drawn (O: max_new_tokens)
  logp_BO: Array  # f32[B, O] their logprobs
  counts_BV: Array  # i32[B, V] output token counts (penalties)
  done_B: Array  # bool[B] rows that stopped


@functools.partial(jax.jit, static_argnums=(0, 8, 9), donate_argnums=2)
def _decode_loop(
  graphdef,
  params,
  cache,
  logits_BV,
  seed_B,
  arrays: SamplingArrays,
  limits_B,
  stop_Bs,
  max_new_tokens,
  penalties,
  prompt_mask_BV,
):
  """Samples up to max_new_tokens per row; a row stops on a token of its stop_Bs row or its limit.

  Returns:
    (i32[B, O] tokens, f32[B, O] their logprobs, steps run, cache), O = max_new_tokens.
  """
  B, V = logits_BV.shape

  def cond(c: DecodeCarry):
    return (c.i < max_new_tokens) & ~jnp.all(c.done_B)

  def body(c: DecodeCarry):
    token_B, token_logp_B, _, _ = sample_rows(
      c.logits_BV,
      step_keys(seed_B, jnp.full((B,), c.i, jnp.int32)),
      arrays,
      counts_BV=c.counts_BV if penalties else None,
      prompt_mask_BV=prompt_mask_BV if penalties else None,
    )
    token_B = jnp.where(c.done_B, 0, token_B)
    counts_BV = c.counts_BV
    if penalties:
      counts_BV = counts_BV.at[jnp.arange(B), token_B].add(jnp.where(c.done_B, 0, 1))
    done_B = c.done_B | jnp.any(token_B[:, None] == stop_Bs, axis=1) | (c.i + 1 >= limits_B)
    model = nnx.merge(graphdef, params)
    logits_B1V, cache = model(token_B[:, None], cache=c.cache)
    return DecodeCarry(
      i=c.i + 1,
      cache=cache,
      logits_BV=logits_B1V[:, 0],
      out_BO=c.out_BO.at[:, c.i].set(token_B),
      logp_BO=c.logp_BO.at[:, c.i].set(token_logp_B),
      counts_BV=counts_BV,
      done_B=done_B,
    )

  carry = DecodeCarry(
    i=jnp.int32(0),
    cache=cache,
    logits_BV=logits_BV,
    out_BO=jnp.zeros((B, max_new_tokens), jnp.int32),
    logp_BO=jnp.zeros((B, max_new_tokens), jnp.float32),
    counts_BV=jnp.zeros((B, V), jnp.int32),
    done_B=jnp.zeros((B,), bool),
  )
  c = jax.lax.while_loop(cond, body, carry)
  return c.out_BO, c.logp_BO, c.i, c.cache


def generate(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  params: SamplingParams | Sequence[SamplingParams] | None = None,
  *,
  eos_id: int | Sequence[int] | None = None,
  return_logprobs: bool = False,
  draft: Transformer | str | NGramDrafter | None = None,
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
      vocabulary that proposes `num_speculative_tokens` tokens per target pass, "mtp" for the
      model's own multi-token-prediction heads, or "ngram" / `drafters.NGramDrafter(min, max)`
      for prompt lookup (drafts copied from the row's own prompt and output). The output has
      the same law as without it (and the same tokens when greedy). Rows with
      repetition/presence/frequency penalties decode without it.
    num_speculative_tokens: k, draft tokens per round.

  Returns:
    list of i32 token lists; with return_logprobs, (tokens, logprobs).
  """
  prompts = batching.token_lists(prompts)
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
  T = batching.bucket(int(lengths.max()))
  capacity = T + batching.bucket(max_new)
  if capacity > model.cfg.max_seq_len and int(lengths.max()) + max_new > model.cfg.max_seq_len:
    raise ValueError(
      f"generate: prompt length {int(lengths.max())} + max_new_tokens {max_new} exceeds the "
      f"model's max_seq_len={model.cfg.max_seq_len}"
    )
  vocab = model.cfg.vocab_size
  for b, p in enumerate(prompts):
    if min(p) < 0 or max(p) >= vocab:
      raise ValueError(f"generate: prompt {b} has token ids outside [0, {vocab})")
  tokens, _ = batching.pad_prompts(prompts)

  eos = eos_ids(eos_id)
  stops = [batching.stop_ids(p, eos) for p in per_row]
  penalties = any(p.uses_penalties for p in per_row)
  if draft is not None and not penalties:
    out, logp, _ = speculative.speculative_generate(
      model, draft, prompts, per_row, stops=stops, k=num_speculative_tokens
    )
    return batching.cut_at_stops(out, logp, per_row, stops, return_logprobs)
  prompt_mask_BV = np.zeros((B, vocab), bool)
  if penalties:
    for b, p in enumerate(prompts):
      prompt_mask_BV[b, list(p)] = True

  graphdef, state = nnx.split(model)
  cache = model.init_cache(B, capacity)
  logits_BV, cache = batching.prefill(
    graphdef, state, jnp.asarray(tokens), cache, jnp.asarray(lengths)
  )
  out_BO, logp_BO, _, _ = _decode_loop(
    graphdef,
    state,
    cache,
    logits_BV,
    jnp.asarray([p.seed for p in per_row], jnp.int32),
    SamplingArrays.from_params(per_row),
    jnp.asarray([p.max_new_tokens for p in per_row], jnp.int32),
    jnp.asarray(batching.stop_table(stops)),
    max_new,
    penalties,
    jnp.asarray(prompt_mask_BV) if penalties else None,
  )
  return batching.cut_at_stops(
    np.asarray(out_BO), np.asarray(logp_BO), per_row, stops, return_logprobs
  )
