"""The transformer: shapes, dtypes, causality, cached decoding == full forward, packing, scan."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig, RopeScaling
from atlas_jax.model.transformer import Transformer

V = 61


def make(**kw) -> Transformer:
  base = dict(
    vocab_size=V,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    max_seq_len=128,
    init_std=0.1,
  )
  base.update(kw)
  return Transformer(ModelConfig(**base), rngs=nnx.Rngs(0))


def tokens(B, T, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, V, dtype=jnp.int32)


class ForwardTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_shapes_and_finiteness(self):
    model = make()
    graphdef, state = nnx.split(model)
    fwd = self.variant(lambda state, t: nnx.merge(graphdef, state)(t))
    logits = fwd(state, tokens(3, 17))
    chex.assert_shape(logits, (3, 17, V))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)

  @chex.variants(with_jit=True, without_jit=True)
  def test_bf16_activations_f32_logits(self):
    model = make(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = nnx.split(model)
    fwd = self.variant(lambda state, t: nnx.merge(graphdef, state)(t))
    logits = fwd(state, tokens(2, 9))
    chex.assert_type(logits, jnp.float32)  # the head accumulates in float32
    ref = make()(tokens(2, 9))
    np.testing.assert_allclose(logits, ref, atol=5e-2)


# MHA, GQA, MQA: the mask does not depend on how heads share kv, so GQA runs by default and the
# other two with -m slow.
@pytest.mark.parametrize(
  "n_kv_heads",
  [pytest.param(4, marks=pytest.mark.slow), 2, pytest.param(1, marks=pytest.mark.slow)],
)
def test_causal_through_gradients(n_kv_heads):
  """d logits[t] / d embedding[s] is zero for every s > t."""
  model = make(n_kv_heads=n_kv_heads)
  graphdef, state = nnx.split(model)
  toks = tokens(1, 8)
  embed = state["embed"][...]

  def logits_at(x_TD, t):
    # Feed embeddings directly so the gradient reaches each position.
    st = jax.tree.map(lambda a: a, state)
    st["embed"] = nnx.Param(jnp.concatenate([embed, x_TD]))
    m = nnx.merge(graphdef, st)
    return m(V + jnp.arange(8, dtype=jnp.int32)[None])[0, t].sum()

  x_TD = embed[toks[0]]
  for t in (0, 3, 7):
    g_TD = jax.grad(logits_at)(x_TD, t)
    assert np.all(np.abs(np.asarray(g_TD[t + 1 :])) == 0.0)
    assert np.abs(np.asarray(g_TD[: t + 1])).sum() > 0


@pytest.mark.parametrize(
  "kw",
  [
    {},
    {"n_kv_heads": 1, "qkv_bias": True},
    {"qk_norm": True},
    {"sliding_window": 5},
    {"rope_scaling": RopeScaling(original_max_position_embeddings=16)},
  ],
)
def test_cache_decoding_matches_full_forward(kw):
  model = make(**kw)
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda state, t, cache: nnx.merge(graphdef, state)(t, cache=cache))
  toks = tokens(2, 20)
  full = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))(state, toks)
  cache = model.init_cache(2, 32)
  logits, cache = step(state, toks[:, :7], cache)
  steps = [logits]
  for t in range(7, 20):
    logits, cache = step(state, toks[:, t : t + 1], cache)
    steps.append(logits)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=2e-5)
  np.testing.assert_array_equal(cache.lengths, [20, 20])


def test_ragged_right_padded_prefill():
  """Rows of different lengths decode from their own lengths and match unpadded forwards."""
  model = make()
  a, b = tokens(1, 11, seed=1)[0], tokens(1, 5, seed=2)[0]
  padded = jnp.zeros((2, 11), jnp.int32).at[0].set(a).at[1, :5].set(b)
  cache = model.init_cache(2, 16)
  logits, cache = model(padded, cache=cache)
  cache = cache.replace(lengths=jnp.array([11, 5], jnp.int32))
  nxt = jnp.array([[3], [4]], jnp.int32)
  step, _ = model(nxt, cache=cache)
  ref_a = model(jnp.concatenate([a, nxt[0]])[None])[0, -1]
  ref_b = model(jnp.concatenate([b, nxt[1]])[None])[0, -1]
  chex.assert_trees_all_close(step[0, 0], ref_a, atol=2e-5)
  chex.assert_trees_all_close(step[1, 0], ref_b, atol=2e-5)
  chex.assert_trees_all_close(logits[1, :5], model(b[None])[0], atol=2e-5)


def test_packed_documents_equal_separate_forwards():
  model = make()
  a, b = tokens(1, 6, seed=3)[0], tokens(1, 9, seed=4)[0]
  packed = jnp.concatenate([a, b])[None]
  segments = jnp.array([[0] * 6 + [1] * 9], jnp.int32)
  positions = jnp.array([list(range(6)) + list(range(9))], jnp.int32)
  out = model(packed, positions_BT=positions, segment_ids_BT=segments)
  chex.assert_trees_all_close(out[0, :6], model(a[None])[0], atol=2e-5)
  chex.assert_trees_all_close(out[0, 6:], model(b[None])[0], atol=2e-5)


def test_layers_are_scanned_not_unrolled():
  """The traced program has the same size for 2 and 8 layers: compile time is flat in depth."""

  def n_eqns(n_layers):
    model = make(n_layers=n_layers)
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens(1, 4))
    return len(jaxpr.eqns)

  assert n_eqns(2) == n_eqns(8)


def test_layers_are_initialised_independently():
  wq = nnx.state(make(n_layers=3))["blocks"]["attn"]["wq"][...]
  chex.assert_shape(wq, (3, 64, 4, 16))
  assert not np.allclose(wq[0], wq[1])


def test_big_presets_by_eval_shape():
  """Llama-3-8B shapes without allocating: parameter count matches the published 8.03B."""
  from pathlib import Path

  from atlas_jax.config import load_config

  cfg = load_config(Path(__file__).parents[2] / "configs" / "llama3-8b.yaml")
  abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
  assert n == 8_030_261_248


def test_logits_at_selects_one_position_per_row():
  model = make()
  toks = tokens(3, 9)
  full = model(toks)
  at = jnp.array([8, 0, 4], jnp.int32)
  picked = model(toks, logits_at_B=at)
  chex.assert_shape(picked, (3, 1, V))
  chex.assert_trees_all_close(picked[:, 0], full[jnp.arange(3), at], atol=1e-6)


def test_logits_at_several_positions_per_row():
  """A ragged step's sequences' last tokens, J per row: [B, J, V]."""
  model = make()
  toks = tokens(2, 9)
  full = model(toks)
  at = jnp.array([[8, 0, 4], [1, 1, 7]], jnp.int32)
  picked = model(toks, logits_at_B=at)
  chex.assert_shape(picked, (2, 3, V))
  chex.assert_trees_all_close(picked, jnp.take_along_axis(full, at[..., None], axis=1), atol=1e-6)
