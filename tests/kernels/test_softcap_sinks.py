"""Logit soft-capping and attention sinks in every implementation behind `kernels.attention`:
forward (output and log-sum-exp) and gradients (dq, dk, dv and d sinks) against
`attention_reference`, whose sinks are checked against jax.nn with the sink as a biased key."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

from atlas_jax.kernels import attention, attention_reference, flash_attention
from atlas_jax.kernels.attention import AttentionCall, cudnn_unsupported, select_implementation

B, T, N, K, H = 2, 21, 4, 2, 16
HOPPER = (9, 0)


def _inputs(seed=0, T=T, S=T):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (B, T, N, H)) * 2.0  # scores large enough for a cap to bite
  k = jax.random.normal(keys[1], (B, S, K, H)) * 2.0
  v = jax.random.normal(keys[2], (B, S, K, H))
  sinks = jax.random.normal(keys[3], (N,)) * 2.0
  do = jax.random.normal(keys[4], (B, T, N, H))
  dlse = jax.random.normal(keys[5], (B, T, N))
  return q, k, v, sinks, do, dlse


def test_reference_sinks_are_a_key_of_zeros_with_the_sink_as_bias():
  q, k, v, sinks, _, _ = _inputs()
  got = attention_reference(q, k, v, causal=True, sliding_window=6, sinks=sinks)
  zero_key = jnp.zeros((B, 1, K, H))
  k1, v1 = jnp.concatenate([k, zero_key], 1), jnp.concatenate([v, zero_key], 1)
  s = jnp.arange(T + 1)[None, :]
  t = jnp.arange(T)[:, None]
  mask_TS = ((s <= t) & (s > t - 6)) | (s == T)
  bias = jnp.zeros((1, N, T, T + 1)).at[..., T].set(sinks[:, None])
  k1 = jnp.repeat(k1, N // K, axis=2)
  v1 = jnp.repeat(v1, N // K, axis=2)
  want = jax.nn.dot_product_attention(q, k1, v1, bias=bias, mask=mask_TS[None, None])
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_soft_cap_bounds_the_scores():
  """With a tiny cap every visible key's score is nearly 0: the output is the keys' mean."""
  q, k, v, *_ = _inputs()
  got = attention_reference(q, k, v, soft_cap=1e-4)
  want = jnp.broadcast_to(jnp.repeat(v.mean(1, keepdims=True), N // K, axis=2), got.shape)
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


def _grads(fn, q, k, v, sinks, do, dlse, with_lse):
  def f(q, k, v, sinks):
    return fn(q, k, v, sinks)

  out, vjp = jax.vjp(f, q, k, v, sinks)
  return out, vjp((do, dlse) if with_lse else do)


OPTIONS = {
  "cap": dict(soft_cap=3.0),
  "sinks": dict(sinks=True),
  "cap_sinks_window": dict(soft_cap=3.0, sinks=True, sliding_window=6),
}


def _call(options, sinks):
  kw = dict(options)
  if kw.pop("sinks", False):
    kw["sinks"] = sinks
  return kw


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_flash_forward_and_gradients(name, backend):
  """Both kernel bodies (interpreted), with kv lengths leaving one row no key, blocks that do
  not divide T, and a cotangent on the log-sum-exp as well as the output."""
  q, k, v, sinks, do, dlse = _inputs(T=T, S=T + 3)
  kv_lengths = jnp.asarray([T + 3, 9], jnp.int32)
  sinks_given = OPTIONS[name].get("sinks", False)
  blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
  if backend == "tpu":
    blocks = dict(block_q=8, block_k=128, block_q_bwd=8, block_k_bwd=128)

  def run(fn):
    def call(q, k, v, sinks):
      return fn(q, k, v, causal=True, kv_lengths=kv_lengths, **_call(OPTIONS[name], sinks))

    return jax.jit(lambda *a: _grads(call, *a, with_lse=True))(q, k, v, sinks, do, dlse)

  flash = lambda *a, **kw: flash_attention(
    *a, return_lse=True, backend=backend, interpret=True, **blocks, **kw
  )
  reference = lambda *a, **kw: attention_reference(*a, return_lse=True, **kw)
  (out, lse), grads = run(flash)
  (ref_out, ref_lse), ref_grads = run(reference)
  chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
  chex.assert_tree_all_finite(grads[:3])
  chex.assert_trees_all_close(grads[:3], ref_grads[:3], atol=1e-4, rtol=1e-4)
  if sinks_given:
    assert float(jnp.abs(ref_grads[3]).min()) > 1e-3  # every head's sink takes part
    chex.assert_trees_all_close(grads[3], ref_grads[3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("positions", [False, True])
def test_dispatcher_paths_match_the_reference(implementation, positions):
  """ "xla" self-attention takes the blocked path, with query positions the reference; "pallas"
  FlashAttention. bfloat16 inputs, gradients of all four."""
  q, k, v, sinks, do, _ = _inputs(seed=1)
  q, k, v, do = (x.astype(jnp.bfloat16) for x in (q, k, v, do))
  extra = {}
  if positions:
    extra["q_positions"] = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  options = dict(soft_cap=3.0, sliding_window=6)

  def run(**kw):
    fn = lambda q, k, v, sinks: attention(
      q, k, v, causal=True, sinks=sinks, **options, **extra, **kw
    )
    return jax.jit(lambda *a: _grads(fn, *a, with_lse=False))(q, k, v, sinks, do, None)

  out, grads = run(implementation=implementation)
  ref_out, ref_grads = run(implementation="reference")
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  chex.assert_trees_all_close(f32(out), f32(ref_out), atol=2e-2, rtol=2e-2)
  chex.assert_trees_all_close(f32(grads), f32(ref_grads), atol=5e-2, rtol=5e-2)


def test_cudnn_refuses_soft_cap_and_sinks_and_the_gpu_default_moves_on():
  call = lambda **kw: AttentionCall(jnp.dtype(jnp.bfloat16), 128, 128, 64, causal=True, **kw)
  assert cudnn_unsupported(call(), HOPPER) is None
  assert "soft-cap" in cudnn_unsupported(call(soft_cap=50.0), HOPPER)
  assert "sinks" in cudnn_unsupported(call(sinks=True), HOPPER)
  for kw in (dict(soft_cap=50.0), dict(sinks=True)):
    assert select_implementation(call(**kw), platform="gpu", compute_capability=HOPPER) == "pallas"
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run this call"):
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    attention(q, q, q, soft_cap=5.0, implementation="cudnn")


def test_bad_options_name_the_field():
  q = jnp.zeros((1, 8, 4, 16))
  k = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match=r"soft_cap must be a Python float > 0 or None, got -1.0"):
    attention(q, k, k, soft_cap=-1.0)
  with pytest.raises(ValueError, match=r"sinks must be one logit per query head, shape \(4,\)"):
    attention(q, k, k, sinks=jnp.zeros((2,)))


@pytest.mark.parametrize("platform, backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_flash_with_soft_cap_sinks_and_window_lowers_for_accelerators(platform, backend):
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  sinks = jax.ShapeDtypeStruct((4,), jnp.float32)

  def loss(q, k, v, sinks):
    out = flash_attention(
      q,
      k,
      v,
      causal=True,
      sliding_window=100,
      soft_cap=50.0,
      sinks=sinks,
      backend=backend,
      interpret=False,
    )
    return out.astype(jnp.float32).sum()

  exported = jax.export.export(
    jax.jit(jax.grad(loss, (0, 1, 2, 3))),
    platforms=[platform],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(q, kv, kv, sinks)
  text = exported.mlir_module()
  target = "__gpu$xla.gpu.triton" if backend == "gpu" else "tpu_custom_call"
  assert text.count(target) >= 3  # forward, dq and dk/dv kernels
