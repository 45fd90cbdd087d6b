"""Prompt-lookup (n-gram) drafting and chained MTP drafting in `generate`: the search against a
pure-Python reference, greedy outputs equal to plain decoding, acceptance counts equal to a host
simulation of the rounds, the sampled law exact, and the chain equal to the training heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig, MTPConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.decoding.drafters import (
  DraftCache,
  NGramDrafter,
  Window,
  hidden_store,
  make_drafter,
  ngram_drafts,
)
from atlas_jax.decoding.speculative import speculative_generate
from atlas_jax.model import build

from .test_speculative import exact_joint

BASE = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128)


def tiny(seed, vocab=40, std=0.3, **kw):
  return build(ModelConfig(vocab_size=vocab, init_std=std, **BASE, **kw), rngs=nnx.Rngs(seed))


def lookup(seq, min_n, max_n, k):
  """The reference: for n from max_n down to min_n, the first earlier occurrence of the last n
  tokens; the (up to) k tokens after it."""
  for n in range(max_n, min_n - 1, -1):
    if len(seq) < n + 1:
      continue
    for i in range(len(seq) - n):
      if seq[i : i + n] == seq[-n:]:
        return seq[i + n : i + n + k]
  return []


@pytest.mark.parametrize("min_n, max_n, k", [(1, 3, 4), (2, 4, 3), (3, 3, 2)])
def test_the_ngram_search_finds_what_the_reference_finds(min_n, max_n, k):
  rng = np.random.default_rng(min_n * 10 + max_n)
  B, S = 64, 40
  buf = rng.integers(0, 3, (B, S)).astype(np.int32)  # three symbols: many matches, some none
  buf[:8] = np.arange(S)  # no n-gram recurs
  end = rng.integers(-1, S, B).astype(np.int32)
  end[:4] = S - 1
  search = jax.jit(lambda b, e: ngram_drafts(b, e, min_n=min_n, max_n=max_n, k=k))
  drafts, count = map(np.asarray, search(buf, end))
  for b in range(B):
    want = lookup(buf[b, : end[b] + 1].tolist(), min_n, max_n, k)
    assert count[b] == len(want), b
    assert drafts[b, : count[b]].tolist() == want and not drafts[b, count[b] :].any()
  assert (count == 0).sum() >= 8 and (count == k).sum() > 0 and (0 < count).sum() > B // 4


@pytest.fixture(scope="module")
def target():
  return tiny(0)


REPETITIVE = [[5, 6, 7, 8, 9] * 3, [1, 2, 3, 4, 5, 6], [11, 12, 11, 12, 13, 11, 12]]


def simulate(prompts, want, drafter, k, limits):
  """What greedy speculation with a prompt-lookup drafter must count: each round proposes the
  reference lookup over the row's tokens and accepts the drafts that equal the plain greedy
  tokens. Returns (rows' rounds, accepted drafts)."""
  row_rounds = accepted = 0
  for prompt, out, limit in zip(prompts, want, limits):
    i = 1  # the first token comes from the prefill
    while i < limit:
      drafts = lookup(prompt + out[:i], drafter.prompt_lookup_min, drafter.prompt_lookup_max, k)
      a = 0
      while a < len(drafts) and i + a < len(out) and drafts[a] == out[i + a]:
        a += 1
      row_rounds += 1
      accepted += a
      i += a + 1
  return row_rounds, accepted


# Two drafts under -m slow: four take the same rounds and counts with longer drafts.
@pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_greedy_prompt_lookup_emits_the_plain_tokens_and_counts_exactly(target, k):
  drafter = NGramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
  limits = [24, 9, 17]
  params = [SamplingParams(max_new_tokens=n) for n in limits]
  want = generate(target, REPETITIVE, params)
  assert generate(target, REPETITIVE, params, draft=drafter, num_speculative_tokens=k) == want
  got, _, st = speculative_generate(target, drafter, REPETITIVE, params, stops=[[]] * 3, k=k)
  assert [r[:n].tolist() for r, n in zip(got, limits)] == want
  row_rounds, accepted = simulate(REPETITIVE, want, drafter, k, limits)
  assert (st.row_rounds, st.accepted) == (row_rounds, accepted)
  assert st.accepted > 0 and st.drafted == k * st.row_rounds


def test_rows_without_a_match_decode_plainly(target):
  """No n-gram of 4 recurs in these rows' prompts or greedy outputs: every round proposes
  nothing and emits the plain token, one per target pass."""
  prompts, params = [[1, 2, 3, 4, 5, 6, 7], [9]], [SamplingParams(max_new_tokens=6)] * 2
  want = generate(target, prompts, params)
  for prompt, out in zip(prompts, want):
    seq = prompt + out
    assert not any(lookup(seq[:i], 4, 4, 3) for i in range(1, len(seq) + 1))
  drafter = NGramDrafter(prompt_lookup_min=4, prompt_lookup_max=4)
  got, _, st = speculative_generate(target, drafter, prompts, params, stops=[[]] * 2, k=3)
  assert got.tolist() == want
  assert st.accepted == 0 and st.row_rounds == st.emitted == 2 * 5


def test_sampled_prompt_lookup_keeps_the_targets_joint_law():
  """The chi-square check of `test_speculative` with the prompt-lookup drafter: one-hot
  proposals and zero (padding) rows keep the law of the first three tokens the target's."""
  from scipy import stats

  V, N, k = 4, 3000, 3
  target = tiny(11, vocab=V, std=0.3)
  prompt = [1, 2, 0, 1, 2]  # repeats: rows find matches, or not, as their draws go
  params = SamplingParams(max_new_tokens=3, temperature=1.0)
  law = exact_joint(target, prompt, params, 3)
  rows = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s) for s in range(N)]
  drafter = NGramDrafter(prompt_lookup_min=1, prompt_lookup_max=2)
  out, _, st = speculative_generate(target, drafter, [prompt] * N, rows, stops=[[]] * N, k=k)
  assert 0 < st.accepted < st.drafted
  seen = {}
  for row in out[:, :3].tolist():
    seen[tuple(row)] = seen.get(tuple(row), 0) + 1
  cells = sorted(law)
  expected = np.asarray([N * law[c] for c in cells])
  observed = np.asarray([seen.get(c, 0) for c in cells], float)
  small = expected < 5
  expected = np.append(expected[~small], expected[small].sum())
  observed = np.append(observed[~small], observed[small].sum())
  keep = expected > 0
  expected = expected[keep] * observed[keep].sum() / expected[keep].sum()
  assert stats.chisquare(observed[keep], expected).pvalue > 1e-3


# -- chained MTP drafting ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "n_predict, k",
  # Two heads chained then the first run again past them stays in the default run: it takes
  # both paths the other cases take alone.
  [
    pytest.param(2, 2, marks=pytest.mark.slow),
    (2, 3),
    pytest.param(1, 3, marks=pytest.mark.slow),
  ],
)
def test_chained_mtp_drafting_emits_the_plain_greedy_tokens(n_predict, k):
  """Sequential heads chained (2 heads, 2 drafts), then the first run again past them (3), and
  one module run again on its own drafts (DeepSeek-V3's one module, 3 drafts)."""
  model = tiny(3, mtp=MTPConfig("sequential", n_predict))
  prompts = [[1, 2, 3, 4, 5], [9], [3] * 11]
  params = SamplingParams(max_new_tokens=14)
  want = generate(model, prompts, params)
  assert generate(model, prompts, params, draft="mtp", num_speculative_tokens=k) == want
  assert make_drafter(model, "mtp", k).n_heads == min(k, n_predict)


@pytest.mark.parametrize("fixed", [pytest.param(True, marks=pytest.mark.slow), False])
def test_the_chain_of_sequential_heads_is_the_training_depths(fixed):
  """Followed window by window, then fed the true next tokens as its drafts, the chain's links at
  a row's last position give the logits `forward_mtp` gives there: head i reads head i - 1's
  output and token t + 1 + i. Head 1's entry at each window's last position is rewritten from
  the next window (`first_S`); without that rewrite the chain drifts from the training heads."""
  model = tiny(4, mtp=MTPConfig("sequential", 2))
  cfg, drafter = model.cfg, make_drafter(model, "mtp", 2)
  seq = jnp.asarray(np.random.default_rng(2).integers(0, 40, (2, 14)), jnp.int32)
  _, mtp_JBTV = model.forward_mtp(seq)
  cache = model.init_cache(2, 32)
  store = hidden_store(cfg, 2, 32, jnp.float32)
  heads = model.mtp.init_cache(cfg, 2, 32, jnp.float32, n_heads=2)
  dcache = DraftCache(heads, jnp.zeros(store.shape, store.dtype))
  start = 0
  for width in (5, 3, 4):  # windows of verified positions, as steps and rounds produce them
    tokens = seq[:, start : start + width]
    _, cache, hidden = model(tokens, cache=cache, return_hidden=True)
    window = Window(
      tokens_BT=tokens,
      positions_BT=start + jnp.broadcast_to(jnp.arange(width), (2, width)),
      lengths_B=jnp.full((2,), start, jnp.int32),
      next_BT=seq[:, start + 1 : start + width + 1],
      at_B=jnp.full((2,), width - 1, jnp.int32),
      hidden=hidden,
      first_S=jnp.arange(2) * width if fixed and start > 0 else None,
    )
    dcache = drafter.follow(None, model, dcache, window)
    start += width
  last = start - 1  # the pending token is seq[:, start]
  h, trunk = dcache.hidden[:, :, last]
  m_cache, close = dcache.cache, []
  for i in range(2):
    logits, h, m_cache = model.mtp.draft_step(
      m_cache,
      head=jnp.int32(i),
      token_B=seq[:, start + i],  # the token after position last + i: the pending one, then d_1
      h_BD=h,
      trunk_BD=trunk,
      position_B=jnp.full((2,), last, jnp.int32),
      embed_VD=model.embed[...],
      head_DV=model._head_DV(),
    )
    close.append(np.allclose(logits, mtp_JBTV[i, :, last], rtol=2e-4, atol=2e-4))
  assert close == [True, fixed]


def test_bad_drafters_are_named(target):
  with pytest.raises(ValueError, match="prompt_lookup_min=3 is not allowed: must be <= "):
    NGramDrafter(prompt_lookup_min=3, prompt_lookup_max=2)
  with pytest.raises(ValueError, match="prompt_lookup_max=0 is not allowed"):
    NGramDrafter(prompt_lookup_min=1, prompt_lookup_max=0)
  with pytest.raises(ValueError, match="expected a model, 'mtp' or 'ngram'"):
    generate(target, [[1]], SamplingParams(max_new_tokens=2), draft="eagle")
  parallel, two = tiny(3, mtp=MTPConfig("parallel", 2)), SamplingParams(max_new_tokens=2)
  with pytest.raises(ValueError, match="num_speculative_tokens=3 with draft='mtp' must be <= 2"):
    generate(parallel, [[1]], two, draft="mtp", num_speculative_tokens=3)
