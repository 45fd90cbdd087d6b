"""The chunked cross-entropy: the plain loss's values and gradients, without [B, T, V] logits."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import measure
from atlas_jax.config import ConfigError, MLAConfig, ModelConfig, MTPConfig
from atlas_jax.training import mtp as mtp_loss
from atlas_jax.training.loss import chunked_cross_entropy, cross_entropy
from atlas_jax.training.step import build_model, loss_fn, objective

from .common import tiny_config

B, T, D, V = 3, 13, 16, 97


def _inputs(dtype):
  k = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
  w = (0.3 * jax.random.normal(k[1], (D, V))).astype(jnp.float32)
  t = jax.random.randint(k[2], (B, T), 0, V)
  m = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.float32)
  return h, w, t, m


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 13, 64])  # 4 leaves a padded last chunk
def test_values_and_gradients_equal_the_plain_loss_f32(tied, chunk):
  h, w, t, m = _inputs(jnp.float32)

  def plain(h, w):
    logits = jnp.einsum("BTD,DV->BTV", h, w, preferred_element_type=jnp.float32)
    return cross_entropy(logits, t, m, z_loss=1e-2)

  def chunked(h, w):
    head = {"embed_VD": w.T} if tied else {"head_DV": w}
    return chunked_cross_entropy(h, t, m, chunk=chunk, z_loss=1e-2, **head)

  (l0, a0), g0 = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(h, w)
  (l1, a1), g1 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(h, w)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  chex.assert_trees_all_close(a1, a0, rtol=1e-6)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-7)


def test_bf16_compute_matches_the_plain_loss_to_bf16_rounding():
  """bf16 hidden states and head (cast once), float32 logits: the plain loss's numbers.

  Gradients: each is within bf16 rounding of the float32 one, no further than the plain loss's.
  """
  h, w, t, m = _inputs(jnp.bfloat16)

  def plain(h, w):
    logits = jnp.einsum("BTD,DV->BTV", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return cross_entropy(logits, t, m, z_loss=1e-3)[0]

  def chunked(h, w):
    return chunked_cross_entropy(h, t, m, head_DV=w, chunk=4, z_loss=1e-3)[0]

  exact = jax.grad(plain, argnums=(0, 1))(h.astype(jnp.float32), w)
  l0, g0 = jax.value_and_grad(plain, argnums=(0, 1))(h, w)
  l1, g1 = jax.value_and_grad(chunked, argnums=(0, 1))(h, w)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b, ref in zip(g0, g1, exact):
    scale = float(jnp.abs(ref).max())
    err_plain = float(jnp.abs(a.astype(jnp.float32) - ref).max())
    err_chunked = float(jnp.abs(b.astype(jnp.float32) - ref).max())
    assert b.dtype == a.dtype
    assert err_chunked <= max(1.5 * err_plain, 2**-8 * scale), (err_chunked, err_plain, scale)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True])
def test_train_loss_and_parameter_gradients_equal_the_plain_loss(precision, tied):
  cfg = tiny_config(
    f"train.precision={precision}",
    f"model.tie_embeddings={str(tied).lower()}",
    "train.z_loss=1e-3",
    "model.n_layers=2",
  )
  graphdef, params = nnx.split(build_model(cfg))
  rng = np.random.default_rng(0)
  batch = {
    "tokens": jnp.asarray(rng.integers(0, 64, (4, 17)), jnp.int32),
    "loss_mask": jnp.asarray(rng.random((4, 16)) > 0.2, jnp.float32),
    "segment_ids": jnp.asarray(np.repeat([[0] * 9 + [1] * 7], 4, 0), jnp.int32),
  }

  def run(chunk):
    f = lambda p: loss_fn(graphdef, p, batch, z_loss=1e-3, loss_chunk=chunk)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (l0, _), g0 = run(0)
  (l1, _), g1 = run(5)
  tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
  np.testing.assert_allclose(l1, l0, rtol=1e-5 if precision == "fp32" else 1e-3)
  chex.assert_trees_all_close(g1, g0, **tol)


@pytest.mark.parametrize("kind,mla", [("sequential", True), ("parallel", False)])
def test_mtp_loss_with_chunks_equals_the_plain_mtp_loss(kind, mla):
  cfg = ModelConfig(
    vocab_size=31,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=2,
    ffn_dim=48,
    mla=MLAConfig(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    if mla
    else None,
    mtp=MTPConfig(kind=kind, n_predict=2, loss_weight=0.5),
  )
  from atlas_jax.model import Transformer

  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = np.random.RandomState(0).randint(0, 31, (2, 11)).astype(np.int32)
  segments = np.array([[0] * 6 + [1] * 4, [0] * 10], np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments)}

  def run(chunk):
    f = lambda p: mtp_loss.loss_fn(graphdef, p, batch, loss_chunk=chunk)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (l0, a0), g0 = run(0)
  (l1, a1), g1 = run(3)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for key in ("loss_main", "loss_mtp_1", "loss_mtp_2"):
    np.testing.assert_allclose(a1[key], a0[key], rtol=1e-5)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-6)


def _grad_memory(chunk: int, vocab: int, batch: int, seq: int):
  """(saved residual shapes of the loss's vjp, their bytes less the parameters', compiled temp
  bytes of the gradient)."""
  cfg = tiny_config(
    f"model.vocab_size={vocab}",
    f"train.seq_len={seq}",
    f"train.loss_chunk={chunk}",
    "model.n_layers=1",
  )
  graphdef, params = nnx.split(build_model(cfg))
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  loss = objective(cfg)
  f = lambda p, t: loss(graphdef, p, {"tokens": t})[0]
  residuals = jax.eval_shape(
    lambda p, t: jax.tree.leaves(jax.vjp(lambda p: f(p, t), p)[1]), params, tokens
  )
  compiled = jax.jit(jax.grad(f)).lower(params, tokens).compile()
  saved = measure.saved_activation_bytes(cfg, batch=batch)
  return [r.shape for r in residuals], saved, compiled.memory_analysis().temp_size_in_bytes


def test_no_btv_float32_buffer_is_saved_or_allocated():
  Bm, Tm, Vm, C = 2, 64, 8192, 4
  logits_bytes = Bm * Tm * Vm * 4
  shapes0, saved0, temp0 = _grad_memory(0, Vm, Bm, Tm)
  shapes1, saved1, temp1 = _grad_memory(C, Vm, Bm, Tm)
  # The plain loss saves [B, T, V] float32 logits and allocates at least one such buffer.
  assert (Bm, Tm, Vm) in shapes0
  assert temp0 >= logits_bytes
  # Chunked: no residual with a vocabulary axis but the tables themselves ([V, D] / [D, V]), the
  # saved bytes shrink by at least the logits, and the step's scratch memory holds a few
  # [B, C, V] chunks, far below one [B, T, V] float32 buffer.
  assert all(Vm not in s or len(s) == 2 for s in shapes1), shapes1
  assert saved0 - saved1 >= logits_bytes
  assert temp1 < logits_bytes / 2, (temp1, logits_bytes)
  assert temp1 < temp0 / 2


def test_loss_chunk_is_validated():
  with pytest.raises(ConfigError, match=r"train\.loss_chunk=-1 .*0 for the plain loss"):
    tiny_config("train.loss_chunk=-1")
  with pytest.raises(ValueError, match="exactly one of head_DV and embed_VD"):
    chunked_cross_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), chunk=1)
