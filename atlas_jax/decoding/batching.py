"""What the static-batch decoders share: `generate`'s plain loop and its speculative loop.

Prompts of different lengths are right-padded into one batch whose length is rounded up to a
power of two (a few compiled shapes serve every prompt), run through one jitted prefill that
donates the cache, and each row stops on its own stop ids or limit; outputs are cut there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from atlas_jax.decoding.sampling import SamplingParams

Array = jax.Array


def bucket(n: int, minimum: int = 16) -> int:
  """Rounds up to a power of two so a few compiled shapes serve every prompt length."""
  return max(minimum, 1 << (n - 1).bit_length())


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


def pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  """(i32[B, T] the prompts right-padded to a bucketed T, i32[B] their lengths)."""
  lengths_B = np.asarray([len(p) for p in prompts], np.int32)
  tokens_BT = np.zeros((len(prompts), bucket(int(lengths_B.max()))), np.int32)
  for b, p in enumerate(prompts):
    tokens_BT[b, : len(p)] = p
  return tokens_BT, lengths_B


def stop_ids(params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
  """A row's stop tokens: its own, and the model's eos ids unless it ignores them."""
  ids = list(params.stop_token_ids)
  if not params.ignore_eos:
    ids += eos
  return ids


def stop_table(stops: Sequence[Sequence[int]]) -> np.ndarray:
  """i32[B, s] each row's stop ids, padded with -1 (no token)."""
  stop_Bs = np.full((len(stops), max(1, max(len(s) for s in stops))), -1, np.int32)
  for b, s in enumerate(stops):
    stop_Bs[b, : len(s)] = s
  return stop_Bs


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=3)
def prefill(graphdef, params, tokens_BT, cache, lengths_B, hidden: bool = False):
  """The prompts through the model into the (donated) cache.

  Returns:
    (f32[B, V] the next-token logits at each row's last real token, the cache holding each row's
    prompt, and with `hidden` the model's hidden states at every position (`Transformer`)).
  """
  model = nnx.merge(graphdef, params)
  # Right padding: the next-token logits of row b sit at its last real token.
  logits_B1V, cache, *rest = model(
    tokens_BT, cache=cache, logits_at_B=lengths_B - 1, return_hidden=hidden
  )
  return (logits_B1V[:, 0], cache.replace(lengths=lengths_B), *rest)


def cut_at_stops(out_BO, logp_BO, per_row, stops, return_logprobs):
  """Per-row token (and logprob) lists, each cut at its first stop token or its limit."""
  results, logprobs = [], []
  for b, p in enumerate(per_row):
    row = out_BO[b, : p.max_new_tokens].tolist()
    hits = [i for i, t in enumerate(row) if t in stops[b]]
    n = hits[0] + 1 if hits else len(row)
    results.append(row[:n])
    logprobs.append(logp_BO[b, :n].tolist())
  return (results, logprobs) if return_logprobs else results
