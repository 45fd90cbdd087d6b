"""Speculative decoding: lossless by construction, checked exactly, statistically and token by
token."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.decoding.sampling import SamplingArrays, probabilities
from atlas_jax.decoding.speculative import (
  acceptance_probability,
  residual,
  speculative_generate,
  verify,
)
from atlas_jax.model import build

BASE = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128)


def tiny(seed, vocab=40, std=0.3, **kw):
  return build(ModelConfig(vocab_size=vocab, init_std=std, **BASE, **kw), rngs=nnx.Rngs(seed))


def test_accept_or_resample_yields_p_exactly():
  """For any P and Q: P(emit x) = q(x) accept(x) + P(reject) residual(x) = p(x)."""
  rng = np.random.default_rng(0)
  cases = [(rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))) for _ in range(20)]
  sparse_p, sparse_q = rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))
  sparse_p[:3], sparse_q[3:5] = 0, 0  # disjoint zeros: q proposes tokens p forbids and back
  cases += [(sparse_p / sparse_p.sum(), sparse_q / sparse_q.sum())]
  cases += [(np.eye(7)[2], np.eye(7)[5]), (np.eye(7)[2], np.eye(7)[2]), cases[0][:1] * 2]
  for p, q in cases:
    p, q = jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)
    keep_V = q * acceptance_probability(p, q)
    emitted = keep_V + (1.0 - keep_V.sum()) * residual(p, q)
    np.testing.assert_allclose(emitted, p, atol=1e-6)


def test_the_vectorised_sampler_draws_from_p():
  """`verify` over many rows with a bad draft: the first emitted token is distributed as p, the
  second (after an acceptance, or the bonus) as p given it."""
  V, J, N = 5, 2, 40000
  rng = np.random.default_rng(1)
  p = jnp.asarray(rng.dirichlet(np.ones(V), size=J + 1), jnp.float32)  # [J + 1, V]
  q = jnp.asarray(rng.dirichlet(np.ones(V) * 0.3, size=J), jnp.float32)  # [J, V], far from p
  keys = jax.random.split(jax.random.key(0), N + 1)
  draft_NJ = jnp.stack(
    [jax.vmap(lambda k, j=j: jax.random.categorical(k, jnp.log(q[j])))(keys[:N]) for j in range(J)],
    axis=1,
  ).astype(jnp.int32)
  draft_NJ = jnp.asarray(np.asarray(jax.random.permutation(keys[N], draft_NJ, axis=0)))
  bcast = lambda x: jnp.broadcast_to(x, (N, *x.shape))
  a_N, next_N = verify(bcast(p), bcast(q), draft_NJ, jax.random.split(jax.random.key(1), N))
  first = np.where(np.asarray(a_N) >= 1, np.asarray(draft_NJ[:, 0]), np.asarray(next_N))
  counts = np.bincount(first, minlength=V)
  assert stats.chisquare(counts, N * np.asarray(p[0])).pvalue > 1e-3


@pytest.fixture(scope="module")
def target():
  return tiny(0)


def greedy(n=16):
  return SamplingParams(max_new_tokens=n)


PROMPTS = [[1, 2, 3, 4, 5], [9], [3] * 11]


# One draft token under -m slow: 4 takes the same rounds with longer drafts.
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_greedy_speculation_emits_the_plain_greedy_tokens(target, k):
  want = generate(target, PROMPTS, greedy())
  bad_draft = tiny(7)
  assert generate(target, PROMPTS, greedy(), draft=bad_draft, num_speculative_tokens=k) == want
  # The target as its own draft accepts every draft token.
  got, _, st = speculative_generate(target, target, PROMPTS, [greedy()] * 3, stops=[[]] * 3, k=k)
  assert [r[:16].tolist() for r in got] == want
  assert st.accepted == st.drafted > 0
  # Stops and per-row limits cut the emitted rounds exactly as plain decoding does.
  params = [greedy(5), greedy(16), SamplingParams(max_new_tokens=12, stop_token_ids=(want[2][3],))]
  assert generate(target, PROMPTS, params, draft=bad_draft, num_speculative_tokens=k) == generate(
    target, PROMPTS, params
  )


@pytest.mark.parametrize(
  "kind, n_predict, k, mla",
  [("parallel", 3, 3, False), ("sequential", 2, 1, True)],
)
def test_mtp_self_speculation_emits_the_plain_greedy_tokens(kind, n_predict, k, mla):
  mla_cfg = MLAConfig(16, 8, 8, 8, 12) if mla else None
  model = tiny(3, mtp=MTPConfig(kind, n_predict), mla=mla_cfg)
  want = generate(model, PROMPTS, greedy())
  assert generate(model, PROMPTS, greedy(), draft="mtp", num_speculative_tokens=k) == want


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_mtp_drafts_window_by_window_equal_the_training_heads(kind):
  """The heads' cached drafting, fed a sequence window by window, predicts what `forward_mtp`
  predicts over the whole sequence at once (every parallel head; the first sequential one, as
  deeper ones read tokens past a window: `test_drafting` checks the chain)."""
  model = tiny(4, mtp=MTPConfig(kind, 2))
  J = model.mtp.n_draft_heads if kind == "parallel" else 1
  seq = jnp.asarray(np.random.default_rng(2).integers(0, 40, (2, 13)), jnp.int32)
  _, mtp_JBTV = model.forward_mtp(seq)
  cache = model.init_cache(2, 32)
  m_cache = model.mtp.init_cache(model.cfg, 2, 32, jnp.float32, n_heads=J)
  start = 0
  for width in (5, 3, 4):  # windows of verified positions, as rounds produce them
    tokens = seq[:, start : start + width]
    _, cache, (final, trunk) = model(tokens, cache=cache, return_hidden=True)
    positions = start + jnp.broadcast_to(jnp.arange(width), (2, width))
    at = jnp.full((2,), width - 1, jnp.int32)
    logits_JBV, m_cache = model.mtp.draft(
      m_cache,
      next_tokens_BT=seq[:, start + 1 : start + width + 1],
      trunk_BTD=trunk,
      final_BTD=final,
      positions_BT=positions,
      at_B=at,
      embed_VD=model.embed[...],
      head_DV=model._head_DV(),
      n_heads=J,
    )
    t = start + width - 1
    np.testing.assert_allclose(logits_JBV, mtp_JBTV[:J, :, t], rtol=2e-4, atol=2e-4)
    start += width


def exact_joint(model, prompt, params, n):
  """The target's exact law of its next n tokens under `params` (plain decoding), by enumeration."""
  V = model.cfg.vocab_size
  arrays = SamplingArrays.from_params([params])
  next_law = jax.jit(lambda t: probabilities(model(t)[:, -1], arrays)[0])
  law = {}
  for seq in itertools.product(range(V), repeat=n):
    prob = 1.0
    for i in range(n):
      prob *= float(next_law(jnp.asarray([prompt + list(seq[:i])], jnp.int32))[seq[i]])
    law[seq] = prob
  return law


@pytest.mark.parametrize(
  "k, params",
  # The default run keeps the nucleus-filtered case (3 drafts); one draft and top-k's five run
  # with -m slow (the same rejection sampling, other filters).
  [
    pytest.param(1, SamplingParams(max_new_tokens=3, temperature=1.0), marks=pytest.mark.slow),
    (3, SamplingParams(max_new_tokens=3, temperature=1.3, top_p=0.95)),
    pytest.param(
      5, SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3), marks=pytest.mark.slow
    ),
  ],
)
def test_joint_law_of_emitted_tokens_is_the_targets(k, params):
  """Chi-square (significance 1e-3, fixed seeds) of the first three emitted tokens' joint law
  against the target's exact probabilities, with a deliberately bad draft."""
  V, N = 4, 3000
  # a spread-out target (no cell dominates) and a peaked draft that disagrees with it
  target, bad = tiny(11, vocab=V, std=0.3), tiny(12, vocab=V, std=1.0)
  prompt = [1, 2, 0]
  law = exact_joint(target, prompt, params, 3)
  assert sum(N * p >= 5 for p in law.values()) >= 20  # the test has many cells to fail on
  rows = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(N)]
  out, _, st = speculative_generate(target, bad, [prompt] * N, rows, stops=[[]] * N, k=k)
  assert st.accepted < 0.9 * st.drafted  # a bad draft: most of its tokens are rejected
  seen = {}
  for row in out[:, :3].tolist():
    seen[tuple(row)] = seen.get(tuple(row), 0) + 1
  cells = sorted(law)
  expected = np.asarray([N * law[c] for c in cells])
  observed = np.asarray([seen.get(c, 0) for c in cells], float)
  assert observed[expected == 0].sum() == 0  # never a token the filters forbid
  small = expected < 5  # pool sparse cells so the chi-square approximation holds
  expected = np.append(expected[~small], expected[small].sum())
  observed = np.append(observed[~small], observed[small].sum())
  keep = expected > 0
  expected = expected[keep] * observed[keep].sum() / expected[keep].sum()  # float32 rounding
  assert stats.chisquare(observed[keep], expected).pvalue > 1e-3


def test_bad_speculation_arguments_are_named(target):
  with pytest.raises(ValueError, match="num_speculative_tokens=0"):
    generate(target, [[1]], greedy(), draft=target, num_speculative_tokens=0)
  with pytest.raises(ValueError, match="draft vocab_size=41"):
    generate(target, [[1]], greedy(), draft=tiny(1, vocab=41))
  with pytest.raises(ValueError, match="no MTP heads"):
    generate(target, [[1]], greedy(), draft="mtp")
  with pytest.raises(ValueError, match="expected a model, 'mtp' or 'ngram'"):
    generate(target, [[1]], greedy(), draft="eagle")
