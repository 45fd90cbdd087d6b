"""FlashAttention (Pallas, interpret mode on CPU) against the reference and jax.nn.

Each case runs the kernel's forward and backward once under one jit and compares the output,
the log-sum-exp and dq, dk, dv with `attention_reference`, and the output and gradients with
`jax.nn.dot_product_attention(implementation="xla")`. The sweep covers every axis of the spec
(T in {1, 17, 128, 257}, T != S, GQA ratios 1/2/4/8, head dims 64/128/other, causal or not,
segment ids, sliding windows, kv lengths, query positions, block sizes that do and don't divide
T, float32/bfloat16/float16, both kernel bodies) without running the full cross product.
"""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels import attention, attention_mask, attention_reference, flash_attention

TOL = {  # (atol=rtol for out and lse, atol=rtol for grads)
  jnp.float32: (1e-5, 1e-4),
  jnp.bfloat16: (2e-2, 2e-2),
  jnp.float16: (2e-2, 2e-2),
}


def _segments(key, B, T, S, num):
  """Packed-style ids: sorted kv segments, and the queries are the last T keys' segments."""
  kv_BS = jnp.sort(jax.random.randint(key, (B, S), 0, num), axis=-1)
  q_BT = kv_BS[:, S - T :] if T <= S else jnp.pad(kv_BS, ((0, 0), (T - S, 0)))
  return q_BT.astype(jnp.int32), kv_BS.astype(jnp.int32)


def _run_all(q, k, v, do, dlse, mask_arrays, *, static_masking, flash_kwargs, scale):
  """(out, lse, grads) of flash and of the reference, and (out, grads) of jax.nn."""
  masking = dict(mask_arrays, **static_masking)
  B, T, N, _ = q.shape
  S = k.shape[1]
  mask_BTS = attention_mask(T, S, B, **masking)
  # jax.nn gives fully masked rows a uniform average, not zeros: compare it on the other rows.
  live_BTN1 = jnp.broadcast_to(jnp.any(mask_BTS, -1)[:, :, None, None], (B, T, N, 1))
  dlse = jnp.where(live_BTN1[..., 0], dlse, 0.0)

  def with_lse(fn):
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    return out, lse, vjp((do, dlse))

  flash_fn = functools.partial(flash_attention, scale=scale, return_lse=True, **flash_kwargs)
  flash = with_lse(lambda q, k, v: flash_fn(q, k, v, **masking))
  # The reference runs in float32 on the same (possibly rounded) inputs: the ground truth.
  f32 = lambda x: x.astype(jnp.float32)
  (ref_out, ref_lse), ref_vjp = jax.vjp(
    lambda q, k, v: attention_reference(q, k, v, scale=scale, return_lse=True, **masking),
    f32(q),
    f32(k),
    f32(v),
  )
  ref = (ref_out, ref_lse, ref_vjp((f32(do), dlse)))

  def nn(q, k, v):
    out = jax.nn.dot_product_attention(
      q, k, v, scale=scale, mask=mask_BTS[:, None], implementation="xla"
    )
    return jnp.where(live_BTN1, out, 0.0)

  # jax.nn has no log-sum-exp output: its gradients get the reference's share from lse added.
  nn_out, nn_vjp = jax.vjp(nn, f32(q), f32(k), f32(v))
  lse_grads = ref_vjp((jnp.zeros_like(ref_out), dlse))
  nn_grads = jax.tree.map(jnp.add, nn_vjp(jnp.where(live_BTN1, f32(do), 0.0)), lse_grads)
  return flash, ref, (nn_out, nn_grads)


def check_against_references(
  *,
  B=1,
  T,
  S,
  N,
  K,
  H,
  dtype=jnp.float32,
  causal,
  segments=0,
  sliding_window=None,
  kv_lengths=None,
  q_positions=None,
  blocks=(),
  backend=None,
  scale=None,
  seed=0,
):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (B, T, N, H), jnp.float32).astype(dtype)
  dlse = jax.random.normal(keys[4], (B, T, N), jnp.float32)
  mask_arrays = dict(kv_lengths=kv_lengths, q_positions=q_positions)
  if segments:
    mask_arrays["q_segment_ids"], mask_arrays["kv_segment_ids"] = _segments(
      keys[5], B, T, S, segments
    )
  run = jax.jit(
    functools.partial(
      _run_all,
      static_masking=dict(causal=causal, sliding_window=sliding_window),
      flash_kwargs=dict(blocks, backend=backend, interpret=True),
      scale=scale,
    )
  )
  (out, lse, grads), (ref_out, ref_lse, ref_grads), (nn_out, nn_grads) = run(
    q, k, v, do, dlse, mask_arrays
  )

  tol, grad_tol = TOL[dtype]
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert all(g.dtype == dtype for g in grads)
  chex.assert_tree_all_finite((out, grads))
  chex.assert_trees_all_close(out.astype(jnp.float32), ref_out, atol=tol, rtol=tol)
  # -inf (rows that see no key) must sit at the same places.
  chex.assert_trees_all_close(lse, ref_lse, atol=tol, rtol=tol)
  chex.assert_trees_all_close(
    tuple(g.astype(jnp.float32) for g in grads), ref_grads, atol=grad_tol, rtol=grad_tol
  )
  live = jnp.isfinite(ref_lse)[..., None]
  chex.assert_trees_all_close(
    jnp.where(live, out.astype(jnp.float32), 0.0), nn_out, atol=tol, rtol=tol
  )
  chex.assert_trees_all_close(
    tuple(g.astype(jnp.float32) for g in grads), nn_grads, atol=grad_tol, rtol=grad_tol
  )
  return out, lse


SWEEP = {
  # name: kwargs of check_against_references
  "T1_decode_gqa4_causal": dict(T=1, S=40, N=4, K=1, H=64, causal=True),
  "T17_mha_causal_blocks_not_dividing": dict(
    T=17,
    S=17,
    N=2,
    K=2,
    H=64,
    causal=True,
    blocks=dict(block_q=8, block_k=16, block_q_bwd=16, block_k_bwd=8),
  ),
  "T17_S40_gqa2_h128_segments": dict(T=17, S=40, N=2, K=1, H=128, causal=False, segments=3),
  "T128_mqa8_causal_blocks_dividing": dict(
    T=128,
    S=128,
    N=8,
    K=1,
    H=64,
    causal=True,
    blocks=dict(block_q=32, block_k=64, block_q_bwd=64, block_k_bwd=32),
  ),
  "T128_S192_gqa2_h128_causal_default_blocks": dict(T=128, S=192, N=2, K=1, H=128, causal=True),
  "T257_gqa2_causal_segments": dict(
    T=257,
    S=257,
    N=2,
    K=1,
    H=64,
    causal=True,
    segments=3,
    blocks=dict(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64),
  ),
  "T257_S129_noncausal_h128": dict(T=257, S=129, N=1, K=1, H=128, causal=False),
  "T24_S16_causal_rows_before_first_key": dict(
    T=24, S=16, N=2, K=1, H=64, causal=True, blocks=dict(block_q=8, block_k=8)
  ),
  "sliding_window_causal": dict(
    T=65,
    S=65,
    N=2,
    K=1,
    H=64,
    causal=True,
    sliding_window=16,
    blocks=dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16),
  ),
  "sliding_window_noncausal_scale": dict(
    T=40,
    S=40,
    N=2,
    K=2,
    H=64,
    causal=False,
    sliding_window=7,
    scale=0.3,
    blocks=dict(block_q=16, block_k=8),
  ),
  "kv_lengths_b2": dict(
    B=2,
    T=16,
    S=48,
    N=2,
    K=1,
    H=64,
    causal=True,
    kv_lengths=jnp.array([30, 0], jnp.int32),
    blocks=dict(block_q=8, block_k=16, block_q_bwd=8, block_k_bwd=16),
  ),
  "q_positions_unordered_window": dict(
    T=12,
    S=32,
    N=2,
    K=1,
    H=64,
    causal=True,
    sliding_window=8,
    q_positions=jnp.array([[31, 3, 17, 0, 9, 25, 6, 30, 12, 20, 1, 28]], jnp.int32),
    blocks=dict(block_q=4, block_k=8, block_q_bwd=4, block_k_bwd=8),
  ),
  "gpu_layout_h80_padded": dict(T=33, S=33, N=2, K=1, H=80, causal=True, backend="gpu"),
  "tpu_body_causal_window_segments": dict(
    T=40,
    S=40,
    N=4,
    K=2,
    H=64,
    causal=True,
    sliding_window=24,
    segments=2,
    backend="tpu",
    blocks=dict(block_q=16, block_k=128, block_q_bwd=8, block_k_bwd=128),
  ),
  "tpu_body_T17_S140_gqa4": dict(
    T=17,
    S=140,
    N=4,
    K=1,
    H=128,
    causal=False,
    backend="tpu",
    blocks=dict(block_q=8, block_k=128, block_q_bwd=16, block_k_bwd=128),
  ),
  "bf16_T128_gqa4_causal_segments": dict(
    T=128,
    S=128,
    N=4,
    K=1,
    H=64,
    dtype=jnp.bfloat16,
    causal=True,
    segments=2,
    blocks=dict(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64),
  ),
  "bf16_T1_h128": dict(T=1, S=17, N=2, K=2, H=128, dtype=jnp.bfloat16, causal=True),
  "f16_T17_S33_h128": dict(
    T=17,
    S=33,
    N=2,
    K=2,
    H=128,
    dtype=jnp.float16,
    causal=False,
    blocks=dict(block_q=16, block_k=16),
  ),
}


@pytest.mark.parametrize("case", list(SWEEP), ids=list(SWEEP))
def test_matches_references(case):
  check_against_references(**SWEEP[case])


def test_fully_masked_rows_are_zero_not_nan():
  # Batch 0: query segment 7 appears in no key; batch 1: no valid keys at all.
  B, T, S, N, H = 2, 9, 12, 2, 32
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, S, 1, H))
  v = jax.random.normal(keys[2], (B, S, 1, H))
  q_seg = jnp.array([[0, 0, 7, 7, 1, 1, 1, 1, 1], [0] * T], jnp.int32)
  kv_seg = jnp.array([[0] * 6 + [1] * 6, [0] * S], jnp.int32)
  kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=jnp.array([S, 0], jnp.int32))

  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, return_lse=True, block_q=4, block_k=4, **kw)
    return jnp.sum(out**2), (out, lse)

  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  chex.assert_tree_all_finite(grads)
  dead_BT = jnp.zeros((B, T), bool).at[0, 2:4].set(True).at[1].set(True)
  np.testing.assert_array_equal(
    np.asarray(lse == -jnp.inf), np.broadcast_to(dead_BT[..., None], lse.shape)
  )
  np.testing.assert_array_equal(np.asarray(out[dead_BT]), 0.0)
  assert bool(jnp.all(jnp.abs(out[~dead_BT]).sum(-1) > 0))
  np.testing.assert_array_equal(np.asarray(grads[0][dead_BT]), 0.0)
  chex.assert_trees_all_close(out, attention_reference(q, k, v, **kw), atol=1e-5, rtol=1e-5)


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def _property_case(q, k, v, q_seg, kv_seg, kv_len, q_pos, *, causal, window):
  kw = dict(
    causal=causal,
    sliding_window=window,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    kv_lengths=kv_len,
    q_positions=q_pos,
  )

  def loss(fn, q, k, v):
    out, lse = fn(q, k, v, return_lse=True, **kw)
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

  flash = functools.partial(flash_attention, block_q=8, block_k=8, block_q_bwd=4, block_k_bwd=8)
  grad = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)
  return grad(flash, q, k, v), grad(attention_reference, q, k, v)


@hypothesis.settings(max_examples=15, deadline=None, derandomize=True)
@hypothesis.given(
  data=st.data(),
  causal=st.booleans(),
  window=st.sampled_from([None, 1, 5]),
)
def test_masks_property(data, causal, window):
  """Random segment ids, kv lengths and query positions: same output, lse and grads."""
  B, T, S, N, K, H = 2, 12, 20, 2, 1, 16
  ints = lambda n, lo, hi: np.array(
    data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int32
  )
  q_seg = ints(B * T, 0, 2).reshape(B, T)
  kv_seg = ints(B * S, 0, 2).reshape(B, S)
  kv_len = ints(B, 0, S)
  q_pos = ints(B * T, -3, S + 3).reshape(B, T)
  if data.draw(st.booleans(), label="default positions"):
    q_pos = (kv_len[:, None] - T + np.arange(T)[None]).astype(np.int32)
  keys = jax.random.split(jax.random.key(data.draw(st.integers(0, 2**16))), 3)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, S, K, H))
  v = jax.random.normal(keys[2], (B, S, K, H))
  ((_, (out, lse)), grads), ((_, (ref_out, ref_lse)), ref_grads) = _property_case(
    q, k, v, q_seg, kv_seg, kv_len, q_pos, causal=causal, window=window
  )
  chex.assert_tree_all_finite((out, grads))
  chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-4, rtol=1e-4)
  # Rows with no visible key are exactly zero.
  mask_BTS = attention_mask(
    T,
    S,
    B,
    causal=causal,
    sliding_window=window,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    kv_lengths=kv_len,
    q_positions=q_pos,
  )
  dead_BT = ~np.asarray(mask_BTS).any(-1)
  np.testing.assert_array_equal(np.asarray(out)[dead_BT], 0.0)


def _residual_bytes(fn, T, N=2, K=1, H=64):
  """Bytes the forward keeps for the backward: the leaves of the vjp closure (shapes only)."""
  q = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.float32)
  leaves = jax.eval_shape(
    lambda q, k, v: jax.tree_util.tree_leaves(jax.vjp(fn, q, k, v)[1]), q, kv, kv
  )
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


def test_residuals_grow_linearly():
  flash = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True)
  ref = lambda q, k, v: attention_reference(q, k, v, causal=True)
  flash_512, flash_1024 = _residual_bytes(flash, 512), _residual_bytes(flash, 1024)
  ref_512, ref_1024 = _residual_bytes(ref, 512), _residual_bytes(ref, 1024)
  # Doubling T doubles what FlashAttention saves (q, k, v, out, lse) ...
  assert 1.9 < flash_1024 / flash_512 < 2.1, (flash_512, flash_1024)
  # ... and almost quadruples what the reference saves ([T, S] probabilities and masks).
  assert ref_1024 / ref_512 > 3.5, (ref_512, ref_1024)
  # At T = 1024 the [T, S] residuals dominate: the reference keeps over 10x more.
  assert ref_1024 / flash_1024 > 10, (ref_1024, flash_1024)
  # FlashAttention keeps no more than q, k, v, out, lse and the per-row key bounds.
  T, N, K, H = 1024, 2, 1, 64
  assert flash_1024 <= 4 * (2 * T * N * H + 2 * T * K * H + T * N + 2 * T) + 64


def test_dispatcher_pallas_and_default():
  keys = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(keys[0], (1, 16, 4, 32))
  k = jax.random.normal(keys[1], (1, 24, 2, 32))
  v = jax.random.normal(keys[2], (1, 24, 2, 32))
  out = attention(q, k, v, causal=True, sliding_window=5, implementation="pallas")
  ref = attention_reference(q, k, v, causal=True, sliding_window=5)
  chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
  # On CPU, None picks the reference ("xla") path.
  chex.assert_trees_all_close(
    attention(q, k, v, causal=True), attention_reference(q, k, v, causal=True), atol=1e-6
  )


@pytest.mark.parametrize(
  "shapes, kwargs, match",
  [
    (((1, 8, 3, 16), (1, 8, 2, 16)), {}, r"N=3.*K=2.*q.shape=\(1, 8, 3, 16\)"),
    (((8, 3, 16), (1, 8, 2, 16)), {}, r"rank 4.*q.shape=\(8, 3, 16\)"),
    (((1, 8, 2, 16), (1, 8, 2, 32)), {}, r"head dim.*k.shape=\(1, 8, 2, 32\)"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_q=0), r"block_q"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_k=48, backend="gpu"), r"block_k=48.*power of two"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_q_bwd=8, backend="gpu"), r"block_q_bwd=8"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_k_bwd=100, backend="tpu"), r"multiple of 128"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_q=12, backend="tpu"), r"multiple of 8"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(backend="metal"), r"backend='metal'"),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(interpret=False, backend="cpu"), r"interpret=True"),
    (((1, 8, 2, 300), (1, 8, 2, 300)), dict(backend="gpu"), r"H=300.*\(1, 8, 2, 300\)"),
    (((1, 0, 2, 16), (1, 8, 2, 16)), {}, r"empty sequence.*q.shape=\(1, 0, 2, 16\)"),
  ],
)
def test_bad_inputs_raise(shapes, kwargs, match):
  q_shape, kv_shape = shapes
  q, kv = jnp.zeros(q_shape), jnp.zeros(kv_shape)
  with pytest.raises(ValueError, match=match):
    flash_attention(q, kv, kv, **{"interpret": True, **kwargs})


def test_bad_dtypes_raise():
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  kv = jnp.zeros((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="share a dtype"):
    flash_attention(q, kv, kv)
  with pytest.raises(ValueError, match="floating point"):
    flash_attention(*(jnp.zeros((1, 8, 2, 16), jnp.int32),) * 3)
  with pytest.raises(ValueError, match="segment_ids must have shape"):
    flash_attention(
      kv,
      kv,
      kv,
      q_segment_ids=jnp.zeros((1, 9), jnp.int32),
      kv_segment_ids=jnp.zeros((1, 8), jnp.int32),
    )


@pytest.mark.parametrize("platform, backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_lowers_for_accelerators(platform, backend):
  """The compiled kernels lower (Pallas -> Triton IR, Pallas -> Mosaic) for GPU and TPU."""
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)

  def loss(q, k, v, seg):
    out = flash_attention(
      q,
      k,
      v,
      causal=True,
      q_segment_ids=seg,
      kv_segment_ids=seg,
      sliding_window=100,
      backend=backend,
      interpret=False,
    )
    return out.astype(jnp.float32).sum()

  exported = jax.export.export(
    jax.jit(jax.grad(loss, (0, 1, 2))),
    platforms=[platform],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(q, kv, kv, seg)
  text = exported.mlir_module()
  target = "__gpu$xla.gpu.triton" if backend == "gpu" else "tpu_custom_call"
  assert text.count(target) >= 3  # forward, dq and dk/dv kernels


def test_tpu_index_maps_stream_only_the_visible_key_blocks():
  """Causal with a window of 100 over 512 keys in 128-key blocks: each query block's visible key
  blocks, and the streamed index clamped into them (a repeated index issues no copy)."""
  from atlas_jax.kernels.flash_attention import _key_bounds
  from atlas_jax.kernels.flash_kernels import (
    key_blocks_per_query_block,
    query_blocks_per_key_block,
  )
  from atlas_jax.kernels.flash_tpu import _clamped

  T = S = 512
  klo, khi = _key_bounds(
    1, T, S, T, S, causal=True, sliding_window=100, q_positions=None, kv_lengths=None
  )
  kfirst, klast = key_blocks_per_query_block(klo, khi, 128, 128)
  assert kfirst.tolist() == [[0, 0, 1, 2]] and klast.tolist() == [[1, 2, 3, 4]]
  streamed = [[int(_clamped(j, kfirst[0, i], klast[0, i], 4)) for j in range(4)] for i in range(4)]
  assert streamed == [[0, 0, 0, 0], [0, 1, 1, 1], [1, 1, 2, 2], [2, 2, 2, 3]]
  qfirst, qlast = query_blocks_per_key_block(klo, khi, 128, 128, S)
  assert qfirst.tolist() == [[0, 1, 2, 3]] and qlast.tolist() == [[2, 3, 4, 4]]
