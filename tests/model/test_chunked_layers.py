"""Llama 4's chunked local attention as a layer kind: config, and cached decoding (a contiguous
cache) equal to the uncached forward on a model alternating chunked and global layers."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, ModelConfig
from atlas_jax.kernels.reference import attention_reference
from atlas_jax.model.attention import layer_kinds
from atlas_jax.model.transformer import Transformer

V = 61
CHUNK = 6
SHAPES = dict(
  vocab_size=V,
  d_model=64,
  n_layers=4,
  n_heads=4,
  n_kv_heads=2,
  ffn_dim=96,
  max_seq_len=64,
  init_std=0.1,
)
LAYERS = ("chunked_attention", "full_attention", "chunked_attention", "sliding_attention")


def test_layer_kinds_carry_the_chunk():
  cfg = ModelConfig(**SHAPES, layer_types=LAYERS, attention_chunk_size=CHUNK, sliding_window=5)
  kinds, index = cfg.attention_kinds()
  assert [kinds[i].attention_chunk for i in index] == [CHUNK, None, CHUNK, None]
  assert [kinds[i].sliding_window for i in index] == [None, None, None, 5]
  np.testing.assert_array_equal(layer_kinds(cfg)[:, 1], [0, 1, 0, 2])
  every = ModelConfig(**SHAPES, attention_chunk_size=CHUNK).attention_kinds()[0]
  assert [k.attention_chunk for k in every] == [CHUNK]


@pytest.mark.parametrize(
  "fields, match",
  [
    (dict(layer_types=LAYERS[:3] + ("full_attention",)), r"model\.attention_chunk_size=None"),
    (dict(attention_chunk_size=0), r"model\.attention_chunk_size=0 .*positive int"),
    (
      dict(attention_chunk_size=4, sliding_window=3),
      r"model\.attention_chunk_size=4 .*layer_types",
    ),
    (dict(layer_types=("chunked", "full_attention") * 2), r"model\.layer_types='chunked'"),
  ],
)
def test_bad_chunk_fields_are_named(fields, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig(**SHAPES, **fields)


def _model(**kw):
  cfg = ModelConfig(
    **SHAPES,
    layer_types=("chunked_attention", "full_attention") * 2,
    attention_chunk_size=CHUNK,
    **kw,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))


def test_cached_decoding_equals_the_uncached_forward():
  model = _model()
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda state, t, cache: nnx.merge(graphdef, state)(t, cache=cache))
  toks = jax.random.randint(jax.random.key(0), (2, 20), 0, V, dtype=jnp.int32)
  full = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))(state, toks)
  cache = model.init_cache(2, 32)
  logits, cache = step(state, toks[:, :7], cache)  # a prefill crossing a chunk boundary
  steps = [logits]
  for t in range(7, 20):
    logits, cache = step(state, toks[:, t : t + 1], cache)
    steps.append(logits)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=2e-5)
  # The chunked layers matter: the same weights with every layer global give other logits.
  glob = Transformer(ModelConfig(**{**SHAPES, "n_layers": 4}), rngs=nnx.Rngs(0))
  assert not np.allclose(glob(toks), full, atol=1e-3)


def test_a_chunked_layer_attends_within_its_chunk():
  """One chunked layer's attention output equals the reference's chunked mask on its q, k, v:
  the uncached path calls the kernels with the layer's chunk."""
  q = jax.random.normal(jax.random.key(1), (1, 14, 4, 16))
  k = jax.random.normal(jax.random.key(2), (1, 14, 2, 16))
  v = jax.random.normal(jax.random.key(3), (1, 14, 2, 16))
  from atlas_jax.kernels import attention

  got = attention(q, k, v, causal=True, attention_chunk=CHUNK)
  want = attention_reference(q, k, v, causal=True, attention_chunk=CHUNK)
  chex.assert_trees_all_close(got, want, atol=1e-6)
  # Query 6 opens a chunk: it sees only itself, so its output is its own value.
  chex.assert_trees_all_close(got[0, 6], jnp.repeat(v[0, 6], 2, axis=0), atol=1e-6)


def _paged_takes_chunks() -> bool:
  from atlas_jax.cache.paged import PagedKVLayer

  return "attention_chunk" in inspect.signature(PagedKVLayer.attend).parameters


@pytest.mark.skipif(
  not _paged_takes_chunks(), reason="the paged KV layer's attend does not yet pass attention_chunk"
)
def test_paged_cache_equals_the_contiguous_cache():
  """A batched, padded prefill and lockstep decoding over a paged pool (the ragged kernel) give
  each row's contiguous-cache logits, across chunk boundaries."""
  from tests.serving.test_paged_model import paged_vs_contiguous

  paged_vs_contiguous(_model(), [13, 5], steps=6)


@pytest.mark.parametrize("mode", ["all_gather", "ring"])
def test_context_parallel_chunked_attention_matches_one_device(mode):
  """A striped sequence over 4 `context` devices: a chunked layer's attention and its gradients
  equal the whole sequence's (chunks by global index; the ring's blocks scored with XLA)."""
  from atlas_jax import kernels
  from atlas_jax.model import context_parallel as cp
  from atlas_jax.training import sharding as shd
  from tests.training.common import tiny_config

  B, T, N, K, H, C = 2, 16, 4, 2, 8, 4
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
  weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)

  def whole(q, k, v):
    out = kernels.attention(q, k, v, causal=True, attention_chunk=CHUNK)
    return jnp.sum(out * weights), out

  mesh = shd.make_mesh(
    tiny_config("mesh.fsdp=1", "mesh.data=2", f"mesh.context={C}").mesh, jax.devices()
  )

  def split(q, k, v):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      st = lambda x: cp.stripe(x, C)
      out = cp.context_attention(st(q), st(k), st(v), attention_chunk=CHUNK, mode=mode)
    out = cp.unstripe(out, C)
    return jnp.sum(out * weights), out

  (_, want), want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  with jax.sharding.set_mesh(mesh):
    (_, got), got_grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2), has_aux=True))(
      q, k, v
    )
  np.testing.assert_allclose(got, want, atol=1e-5)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-5)
