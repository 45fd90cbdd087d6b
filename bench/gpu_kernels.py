"""The kernel sections of `bench/gpu.py`: correctness, the attention sweep, decode bandwidth.

* correctness: every GPU kernel (FlashAttention forward and backward, cuDNN through the
  dispatcher, paged GQA decode, MLA decode contiguous and paged, at several KV split counts)
  against its pure-jnp reference; prints the max error per case and exits nonzero on a mismatch.
* attention: the FlashAttention-3 paper's sweep (16k tokens per batch, hidden 2048, head dim
  128, bf16) in TFLOP/s for ours (Pallas, Triton lowering), cuDNN and XLA, with the
  implementation `attention(..., implementation=None)` picks for the call (the timing is
  `bench/attention_sweep.py`, as for `bench/attention.py`).
* mgpu: the experimental Hopper FlashAttention in Mosaic GPU
  (`atlas_jax/kernels/experimental/flash_mgpu.py`), in a section of its own so that a failure or
  hang there costs nothing else: the error of its output and of its gradients (dq, dk, dv)
  against the reference, and its TFLOP/s forward and forward + backward against cuDNN on sm_90;
  elsewhere forward and gradient are only lowered for CUDA. Once it passes on a Hopper GPU, the
  kernel can leave `atlas_jax/kernels/experimental/`.
* decode: both decode kernels' achieved bandwidth (cache bytes held / step time) against the
  XLA reference and against the card's measured device-to-device copy bandwidth.

`smoke=True` runs the same code on CPU at toy sizes (Pallas in interpret mode).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from attention_sweep import FA3_HIDDEN, FA3_TOKENS, Case, cell, hopper, ratio, sweep
from timing import seconds_per_call

from atlas_jax.kernels import attention as attention_dispatch
from atlas_jax.kernels import attention_reference, flash_attention
from atlas_jax.kernels.attention import (
  AttentionCall,
  device_compute_capability,
  select_implementation,
)
from atlas_jax.kernels.experimental.flash_mgpu import flash_attention_mgpu
from atlas_jax.kernels.mla_decode import mla_decode
from atlas_jax.kernels.paged_attention import paged_attention
from atlas_jax.kernels.ragged_paged_attention import (
  ragged_paged_attention_pallas,
  ragged_paged_attention_xla,
)

# Max |ours - reference| allowed, outputs and gradients of unit-scale inputs.
TOLERANCE = {"float32": 5e-3, "bfloat16": 4e-2, "float16": 1e-2}


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def max_error(got, want) -> float:
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  return max(
    float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
    for g, w in zip(got, want)
  )


# -- inputs --------------------------------------------------------------------------------------


def paged_case(rng, *, B, length, K, H, Z, dtype, ragged):
  """A shuffled KV pool and block table holding B sequences; NaN in every slot not held."""
  M = -(-length // Z)
  lengths = np.full(B, length, np.int32)
  if ragged:  # one empty row, one of a single token, the rest spread below the capacity
    lengths = rng.integers(1, length + 1, B).astype(np.int32)
    lengths[0], lengths[min(1, B - 1)] = 0, 1
  P = B * M + 1
  table = rng.permutation(P)[: B * M].reshape(B, M).astype(np.int32)
  held = np.arange(M * Z).reshape(M, Z)[None] < lengths[:, None, None]  # [B, M, Z]
  pool = np.full((P, Z, 2, K, H), np.nan, np.float32)
  pool[table] = np.where(held[..., None, None, None], rng.normal(size=(B, M, Z, 2, K, H)), np.nan)
  pool = jnp.asarray(pool, dtype)
  return pool[:, :, 0], pool[:, :, 1], jnp.asarray(table), jnp.asarray(lengths)


def latent_case(rng, *, B, length, C, R, Z, dtype, ragged):
  """(contiguous cache [B, S, C + R], pool [P, Z, C + R], table, lengths) with equal contents."""
  M = -(-length // Z)
  lengths = np.full(B, length, np.int32)
  if ragged:
    lengths = rng.integers(1, length + 1, B).astype(np.int32)
    lengths[0], lengths[min(1, B - 1)] = 0, 1
  dense = rng.normal(size=(B, M * Z, C + R)).astype(np.float32)
  table = rng.permutation(B * M).reshape(B, M).astype(np.int32)
  pool = np.empty((B * M, Z, C + R), np.float32)
  pool[table] = dense.reshape(B, M, Z, C + R)
  return (
    jnp.asarray(dense, dtype),
    jnp.asarray(pool, dtype),
    jnp.asarray(table),
    jnp.asarray(lengths),
  )


# -- correctness ---------------------------------------------------------------------------------


def _grads(attend, q, k, v, do):
  """(dq, dk, dv) of <attend(q, k, v), do>."""
  loss = lambda q, k, v: jnp.vdot(attend(q, k, v).astype(jnp.float32), do.astype(jnp.float32))  # noqa: E731
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _mla(qn, qr, cache, lengths, table, **kw):
  """mla_decode with the block table as a positional (traced) argument."""
  return mla_decode(qn, qr, cache, lengths, block_table=table, **kw)


def correctness(smoke: bool) -> None:
  rng = np.random.default_rng(0)
  interpret = not on_gpu()
  rows = []  # (kernel, case, dtype, error)

  def check(kernel, case, dtype, got, want):
    err = max_error(got, want)
    rows.append((kernel, case, jnp.dtype(dtype).name, err))
    ok = err <= TOLERANCE[jnp.dtype(dtype).name]
    print(
      f"| {kernel} | {case} | {jnp.dtype(dtype).name} | {err:.2e} | {'ok' if ok else 'MISMATCH'} |"
    )

  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print("\n## correctness: kernels against their pure-jnp references (max abs error)")
  print("| kernel | case | dtype | max error | |")
  print("|---|---|---|---|---|")

  # FlashAttention forward and backward: causal GQA, packed segments, ragged lengths.
  B, T, N, K, H = (1, 96, 4, 2, 32) if smoke else (2, 1024, 16, 4, 128)
  dtypes = (jnp.float32,) if smoke else (jnp.bfloat16, jnp.float16, jnp.float32)
  for dtype in dtypes:
    q, k, v, do = (jnp.asarray(rng.normal(size=(B, T, n, H)), dtype) for n in (N, K, K, N))
    seg = jnp.asarray(np.repeat(np.arange(3), -(-T // 3))[None, :T].repeat(B, 0), jnp.int32)
    masking = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg)

    ours = functools.partial(flash_attention, interpret=interpret, **masking)
    ref = functools.partial(attention_reference, **masking)
    case = "causal, GQA, 3 packed segments"
    check("flash_attention fwd", case, dtype, jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v))
    ours_grads = jax.jit(functools.partial(_grads, ours))(q, k, v, do)
    ref_grads = jax.jit(functools.partial(_grads, ref))(q, k, v, do)
    check("flash_attention bwd", "dq, dk, dv of the same", dtype, ours_grads, ref_grads)
    if dtype != jnp.float32 and device_compute_capability() is not None:
      cudnn = functools.partial(attention_dispatch, causal=True, implementation="cudnn")
      want = jax.jit(functools.partial(attention_reference, causal=True))(q, k, v)
      check("cudnn (dispatcher)", "causal, GQA", dtype, jax.jit(cudnn)(q, k, v), want)
  if device_compute_capability() is None:
    print("| cudnn (dispatcher) | - | - | - | skipped: no NVIDIA GPU |")

  # Paged GQA decode at several split counts (None: the heuristic), ragged lengths with NaN
  # in every slot a sequence does not hold.
  B, length, K, G, H, Z = (3, 40, 2, 2, 16, 4) if smoke else (16, 1000, 8, 4, 128, 16)
  splits = (2,) if smoke else (None, 1, 3, 8)
  for dtype in (jnp.float32,) if smoke else (jnp.bfloat16, jnp.float32):
    pool_k, pool_v, table, lengths = paged_case(
      rng, B=B, length=length, K=K, H=H, Z=Z, dtype=dtype, ragged=True
    )
    q = jnp.asarray(rng.normal(size=(B, K * G, H)), dtype)
    want = paged_attention(q, pool_k, pool_v, table, lengths, implementation="xla")
    for x in splits:
      got = paged_attention(
        q,
        pool_k,
        pool_v,
        table,
        lengths,
        implementation="pallas",
        interpret=interpret,
        num_splits=x,
      )
      check("paged_attention", f"G={G}, Z={Z}, splits={x or 'auto'}", dtype, got, want)
    # The serving step's ragged kernel on the same decode tokens (one query per sequence).
    start, qlen = jnp.arange(B, dtype=jnp.int32), jnp.minimum(lengths, 1).astype(jnp.int32)
    for x in splits:
      got = ragged_paged_attention_pallas(
        q, pool_k, pool_v, table, start, qlen, lengths, interpret=interpret, num_splits=x
      )
      got = jnp.where(qlen[:, None, None] > 0, got, want)  # a row with no token: no query
      check("ragged_paged_attention", f"G={G}, Z={Z}, splits={x or 'auto'}", dtype, got, want)

  # MLA decode, contiguous and paged, DeepSeek-V3's latent and rope dims.
  B, length, N, C, R, Z = (2, 24, 4, 32, 8, 8) if smoke else (8, 1000, 128, 512, 64, 64)
  for dtype in (jnp.float32,) if smoke else (jnp.bfloat16,):
    dense, pool, table, lengths = latent_case(
      rng, B=B, length=length, C=C, R=R, Z=Z, dtype=dtype, ragged=True
    )
    qn = jnp.asarray(rng.normal(size=(B, N, C)) / 4, dtype)
    qr = jnp.asarray(rng.normal(size=(B, N, R)) / 4, dtype)
    kw = dict(scale=(128 + R) ** -0.5)
    want = mla_decode(qn, qr, dense, lengths, implementation="xla", **kw)
    layouts = (
      (("paged", pool, table),) if smoke else (("contiguous", dense, None), ("paged", pool, table))
    )
    for name, cache, tbl in layouts:
      for x in (2,) if smoke else (None, 1, 4):
        got = mla_decode(
          qn,
          qr,
          cache,
          lengths,
          block_table=tbl,
          implementation="pallas",
          interpret=interpret,
          num_splits=x,
          block_k=Z,
          **kw,
        )
        check("mla_decode", f"{name}, N={N}, splits={x or 'auto'}", dtype, got, want)

  bad = [r for r in rows if r[3] > TOLERANCE[r[2]]]
  print(f"\n{len(rows) - len(bad)} of {len(rows)} cases within tolerance {TOLERANCE}")
  if bad:
    sys.exit(1)


# -- attention sweep -----------------------------------------------------------------------------


def attention(smoke: bool) -> None:
  if smoke:
    tokens, hidden, H, dtype, iters = 256, 64, 32, jnp.float32, 1
    rows = [("fwd", False, 128), ("fwd_bwd", True, 64)]
  else:
    tokens, hidden, H, dtype, iters = FA3_TOKENS, FA3_HIDDEN, 128, jnp.bfloat16, 10
    rows = [("fwd", True, s) for s in (1024, 4096, 16384)]
    rows += [("fwd_bwd", True, s) for s in (1024, 4096, 16384)]
    rows += [("fwd", False, 4096)]
  capability = device_compute_capability()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print(
    f"\n## attention: TFLOP/s, {tokens} tokens per batch, hidden {hidden}, head dim {H}, "
    f"{jnp.dtype(dtype).name}, median of {iters}"
  )
  print(
    "| mode | causal | seq | ours (Pallas) | cuDNN | XLA | ours / cuDNN | ours / XLA | None picks |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  cases = [Case(mode, causal, seq, H) for mode, causal, seq in rows]
  kw = dict(tokens=tokens, hidden=hidden, dtype=dtype, iters=iters, interpret=not on_gpu())
  for (mode, causal, seq, _), tflops in sweep(cases, ("pallas", "cudnn", "xla"), **kw):
    call = AttentionCall(dtype=jnp.dtype(dtype), q_len=seq, kv_len=seq, head_dim=H, causal=causal)
    picks = select_implementation(
      call, platform=jax.default_backend(), compute_capability=capability
    )
    ours, cudnn, xla = tflops["pallas"], tflops["cudnn"], tflops["xla"]
    digits = 4 if smoke else 0
    print(
      f"| {mode} | {causal} | {seq} | {cell(ours, digits)} | {cell(cudnn, digits)} "
      f"| {cell(xla, digits)} | {cell(ratio(ours, cudnn))} "
      f"| {cell(ratio(ours, xla))} | {picks} |",
      flush=True,
    )


# -- decode bandwidth ----------------------------------------------------------------------------


def decode(smoke: bool) -> None:
  import serve as serve_bench  # bench/serve.py: the copy-bandwidth probe

  rng = np.random.default_rng(0)
  interpret = not on_gpu()
  iters = 1 if smoke else 20
  copy = serve_bench.copy_bandwidth(1 << 20 if smoke else 1 << 30)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print(
    f"\n## decode: cache bytes held / step time, TB/s (copy bandwidth {copy / 1e12:.3g} TB/s, "
    "device to device, read + write)"
  )
  print("| kernel | shape | splits | ours TB/s | XLA TB/s | ours / XLA | ours / copy |")
  print("|---|---|---|---|---|---|---|")

  splits = (None,) if smoke else (None, 1)  # the heuristic's splits, and none

  def rows(kernel, shape, cache_bytes, ours_fn, xla_fn, args):
    """One row per split count: ours_fn(..., num_splits=x) against xla_fn, timed once."""
    xla = cache_bytes / seconds_per_call(jax.jit(xla_fn), *args, iters=iters, repeat=3) / 1e12
    for x in splits:
      fn = jax.jit(functools.partial(ours_fn, num_splits=x))
      ours = cache_bytes / seconds_per_call(fn, *args, iters=iters, repeat=3) / 1e12
      print(
        f"| {kernel} | {shape} | {x or 'auto'} | {ours:.3g} | {xla:.3g} | {ours / xla:.2f} | "
        f"{ours * 1e12 / copy:.2f} |",
        flush=True,
      )

  # Paged GQA decode: the shape (batch 64, 2k context, 32 / 8 heads, head dim 128,
  # pages of 16) and a small batch with a long context, where the splits fill the card.
  dtype = jnp.float32 if smoke else jnp.bfloat16
  gqa = [(2, 64, 2, 2, 16, 8)] if smoke else [(64, 2048, 8, 4, 128, 16), (4, 16384, 8, 4, 128, 16)]
  for B, length, K, G, H, Z in gqa:
    pool_k, pool_v, table, lengths = paged_case(
      rng, B=B, length=length, K=K, H=H, Z=Z, dtype=dtype, ragged=False
    )
    q = jnp.asarray(rng.normal(size=(B, K * G, H)), dtype)
    nbytes = 2 * B * length * K * H * jnp.dtype(dtype).itemsize
    shape = f"B={B} S={length} N={K * G} K={K} H={H} Z={Z}"
    xla = functools.partial(paged_attention, implementation="xla")
    ours = functools.partial(paged_attention, implementation="pallas", interpret=interpret)
    args = (q, pool_k, pool_v, table, lengths)
    rows("paged_attention", shape, nbytes, ours, xla, args)
    # The serving step's ragged kernel, each sequence one decode token.
    start, qlen = jnp.arange(B, dtype=jnp.int32), jnp.ones((B,), jnp.int32)
    xla = functools.partial(ragged_paged_attention_xla, max_query_len=1)
    ours = functools.partial(ragged_paged_attention_pallas, max_query_len=1, interpret=interpret)
    args = (q, pool_k, pool_v, table, start, qlen, lengths)
    rows("ragged_paged_attention", shape, nbytes, ours, xla, args)

  # MLA decode: DeepSeek-V3's shape (batch 32, 4k context, 128 heads, latent 512 + rope 64),
  # contiguous (viewed as pages of 64) and paged (pages of 64, as FlashMLA), and batch 4.
  mla = (
    [(2, 32, 4, 32, 8, 8)] if smoke else [(32, 4096, 128, 512, 64, 64), (4, 4096, 128, 512, 64, 64)]
  )
  for B, length, N, C, R, Z in mla:
    dense, pool, table, lengths = latent_case(
      rng, B=B, length=length, C=C, R=R, Z=Z, dtype=dtype, ragged=False
    )
    qn = jnp.asarray(rng.normal(size=(B, N, C)) / 4, dtype)
    qr = jnp.asarray(rng.normal(size=(B, N, R)) / 4, dtype)
    nbytes = B * length * (C + R) * jnp.dtype(dtype).itemsize
    scale = (128 + R) ** -0.5
    layouts = (
      [("paged", pool, table)] if smoke else [("contiguous", dense, None), ("paged", pool, table)]
    )
    for name, cache, tbl in layouts:
      xla = functools.partial(_mla, scale=scale, implementation="xla")
      ours = functools.partial(
        _mla, scale=scale, implementation="pallas", interpret=interpret, block_k=Z
      )
      shape = f"{name} B={B} S={length} N={N} C={C} R={R} Z={Z}"
      args = (qn, qr, cache, lengths, tbl)
      rows("mla_decode", shape, nbytes, ours, xla, args)


# -- the Mosaic GPU FlashAttention (experimental) -------------------------------------------------


def mgpu(smoke: bool) -> None:
  B, T, N, K, H = 2, 1024, 16, 4, 128
  tol = TOLERANCE["bfloat16"]
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print("\n## mgpu: the Mosaic GPU FlashAttention (experimental), bf16, GQA 16 / 4")
  if not hopper():
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
    do = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    for causal in (False, True):
      attend = functools.partial(flash_attention_mgpu, causal=causal)
      jax.jit(attend).trace(q, k, k).lower(lowering_platforms=("cuda",))
      grads = jax.jit(functools.partial(_grads, attend))
      grads.trace(q, k, k, do).lower(lowering_platforms=("cuda",))
    print(
      "not run: needs sm_90; forward and gradient lowered for CUDA (causal and not) without error"
    )
    return
  rng = np.random.default_rng(0)
  print("| causal | out | dq | dk | dv | |")
  print("|---|---|---|---|---|---|")
  bad = False
  for causal in (False, True):
    q, k, v, do = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.bfloat16) for n in (N, K, K, N))
    ours = functools.partial(flash_attention_mgpu, causal=causal)
    ref = functools.partial(attention_reference, causal=causal)
    errors = [max_error(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v))]
    try:  # the backward kernels fail on their own line, after the forward's error
      ours_grads = jax.jit(functools.partial(_grads, ours))(q, k, v, do)
      ref_grads = jax.jit(functools.partial(_grads, ref))(q, k, v, do)
      errors += [max_error(g, w) for g, w in zip(ours_grads, ref_grads)]
      status = "ok" if all(e <= tol for e in errors) else "MISMATCH"
    except Exception as err:  # reported as this row's failure
      status = f"FAILED: backward {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    bad |= status != "ok"
    cells = [f"{e:.2e}" for e in errors] + ["-"] * (4 - len(errors))
    print(f"| {causal} | {' | '.join(cells)} | {status} |", flush=True)
  print("\n| mode | causal | seq | Mosaic GPU TFLOP/s | cuDNN TFLOP/s | Mosaic GPU / cuDNN |")
  print("|---|---|---|---|---|---|")
  rows = [("fwd", True, 4096), ("fwd", True, 16384), ("fwd", False, 4096)]
  rows += [("fwd_bwd", True, 4096), ("fwd_bwd", False, 4096)]
  cases = [Case(mode, causal, seq, 128) for mode, causal, seq in rows]
  kw = dict(tokens=FA3_TOKENS, hidden=FA3_HIDDEN, dtype=jnp.bfloat16, iters=10, interpret=False)
  for (mode, causal, seq, _), tflops in sweep(cases, ("mgpu", "cudnn"), **kw):
    ours, theirs = tflops["mgpu"], tflops["cudnn"]
    print(
      f"| {mode} | {causal} | {seq} | {cell(ours, 0)} | {cell(theirs, 0)} "
      f"| {cell(ratio(ours, theirs))} |",
      flush=True,
    )
  if bad:
    sys.exit(1)
