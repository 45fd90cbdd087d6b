"""generate(): the jitted loop equals step-by-step decoding, and stops on eos."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.decoding.generate import SamplingParams, generate
from atlas_jax.model.transformer import Transformer


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig(
    vocab_size=40,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=128,
    init_std=0.3,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))


def greedy_by_recompute(model, prompt, n):
  """No cache: each step runs the whole prefix (padded to one jitted shape; causal, so the padding
  after the prefix cannot change its logits)."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))
  toks = list(prompt)
  for _ in range(n):
    padded = np.zeros((1, 32), np.int32)
    padded[0, : len(toks)] = toks
    toks.append(int(np.argmax(forward(state, jnp.asarray(padded))[0, len(toks) - 1])))
  return toks[len(prompt) :]


def test_greedy_equals_full_recompute(model):
  prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [3, 3, 3]]
  got = generate(model, prompts, SamplingParams(max_new_tokens=12))
  for p, g in zip(prompts, got):
    assert g == greedy_by_recompute(model, p, 12)


def test_eos_stops_a_row(model):
  free = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=10))[0]
  eos = free[4]
  stopped = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=10), eos_id=eos)[0]
  assert stopped == free[: free.index(eos) + 1]


def test_seeded_sampling_reproduces_and_ignores_batch_mates(model):
  p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
  alone = generate(model, [[5, 6]], p)[0]
  assert generate(model, [[5, 6]], p)[0] == alone
  together = generate(model, [[1, 2, 3, 4], [5, 6]], [SamplingParams(max_new_tokens=8), p])
  assert together[1] == alone


def test_bad_requests(model):
  with pytest.raises(ValueError, match="at least one token"):
    generate(model, [[]])
  with pytest.raises(ValueError, match=r"outside \[0, 40\)"):
    generate(model, [[1, 99]])
  with pytest.raises(ValueError, match="max_seq_len=128"):
    generate(model, [[1] * 100], SamplingParams(max_new_tokens=100))
  with pytest.raises(ValueError, match="top_p=0"):
    SamplingParams(top_p=0)


def test_prompts_as_arrays(model):
  prompts = [[1, 2, 3, 4], [9, 8, 7, 6]]
  want = generate(model, prompts, SamplingParams(max_new_tokens=6))
  assert generate(model, np.asarray(prompts), SamplingParams(max_new_tokens=6)) == want
  assert generate(model, jnp.asarray(prompts), SamplingParams(max_new_tokens=6)) == want
  assert generate(model, [np.asarray(p) for p in prompts], SamplingParams(max_new_tokens=6)) == want
  with pytest.raises(ValueError, match=r"must be 2-D \[B, T\], got shape \(4,\)"):
    generate(model, np.asarray(prompts[0]))
  with pytest.raises(ValueError, match="prompt 0 is not a list of integer token ids"):
    generate(model, [[1.5, 2.0]])


def test_logit_bias_in_generate(model):
  biased = SamplingParams(max_new_tokens=5, logit_bias={7: 100.0})
  assert generate(model, [[1, 2, 3]], biased)[0] == [7] * 5
  # Speculation draws from the biased law too (the model drafting for itself).
  assert generate(model, [[1, 2, 3]], biased, draft=model, num_speculative_tokens=2)[0] == [7] * 5
