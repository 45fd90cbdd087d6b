"""FlashAttention for Hopper in Pallas's Mosaic GPU backend, with its backward (experimental).

The Hopper design (FlashAttention-3, Shah et al. 2024) in Pallas's Mosaic GPU dialect
(`jax.experimental.pallas.mosaic_gpu`): each program holds 2 * block_q query rows of one head and
runs three warpgroups:

* a producer warpgroup that only issues TMA copies of K and V blocks into a ring of `stages`
  shared-memory slots, each slot guarded by a "ready" barrier (the copy landed) and a "free"
  barrier (both consumers are done with it);
* two consumer warpgroups, block_q query rows each, that run QK^T and PV on the tensor cores
  with wgmma (Q and K/V from shared memory, P from registers) and the online softmax in
  registers, in base 2 with the scale folded into one multiply.

Causal masks are bottom-right aligned (query t sits at position S - T + t), as everywhere in
`atlas_jax.kernels`; key blocks a consumer's rows cannot see are never computed, and the mask
is applied only on the blocks that straddle the diagonal. Grouped K/V heads are read in place
(query head n reads kv head n // G). The output is the attention and the log-sum-exp per row.

The backward (`jax.custom_vjp`; the forward saves the log-sum-exp) is FlashAttention-2's in
two more kernels of the same shape, after delta = rowsum(dO * O) in jnp (`backward_delta`; a
cotangent on the returned log-sum-exp is folded into delta):

* dQ: a program per 2 x 64 query rows of one head, the producer streaming K and V blocks;
  each consumer recomputes P = exp2(S - lse) from the saved log-sum-exp, dP = dO V^T,
  dS = P (dP - delta), dQ += dS K.
* dK, dV: a program per 2 x 64 keys of one kv head (64 per consumer, K and V held in
  shared memory), the producer streaming Q, dO, lse and delta blocks; computed transposed so the
  keys are the wgmma rows: dV += P^T dO, dK += dS^T Q. The G query heads of a kv head are
  looped over inside the program and summed in the f32 accumulators, so dK and dV are written
  once, in the input dtype, with no [B, S, N, H] per-query-head copy and no bf16 rounding
  before the sum.

Causal backward blocks follow the forward: query/key block pairs with nothing visible are never
computed, and only the diagonal-straddling ones are masked. The backward uses its own 64-row tiles
(whatever the forward's block_q and block_kv; it shares `stages`), sized to the registers: a
dK/dV consumer holds two f32 [64, H] accumulators, so it needs H <= 128, and S a multiple of
128.

What it is not, yet: no segment ids, kv lengths or sliding windows, and no ping-pong scheduling
between the two consumers (FlashAttention-3 staggers their softmax against the other's
matmuls); `attention(implementation=None)` never picks it. It needs sm_90 to run; tests only
lower it (forward and gradient) for CUDA on a CPU, check its argument checks and check
`backward_delta` against jax.grad, and `bench/gpu.py --only mgpu` checks its output and
gradients against the reference and times it on a GPU. Nothing here has run on a GPU yet, so it
lives in `atlas_jax/kernels/experimental/` (`atlas_jax.kernels.experimental.flash_mgpu`) until
`python bench/gpu.py --only mgpu` passes once on a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Array = jax.Array
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_LOG2E = math.log2(math.e)
_CONSUMERS = 2
# The backward's tiles, fixed whatever the forward's: a dK/dV consumer holds dK and dV
# (2 * 64 * H f32) and three [64, 64] f32 score-shaped tiles in registers, about 224 per thread
# at H = 128 against the 232 it is given; larger tiles or head dims would spill.
_BWD_BLOCK = 64
_MAX_BWD_HEAD_DIM = 128


def _check(q: Array, k: Array, v: Array, *, causal: bool, block_q: int, block_kv: int, stages):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  shapes = f"q.shape={tuple(q.shape)} k.shape={tuple(k.shape)} v.shape={tuple(v.shape)}"
  if k.shape != (B, S, K, H) or v.shape != k.shape or N % K:
    raise ValueError(f"flash_attention_mgpu: need q [B, T, N, H], k = v [B, S, K, H]; {shapes}")
  if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in DTYPES:
    raise ValueError(
      f"flash_attention_mgpu: q, k, v must share a dtype in {[d.name for d in DTYPES]}, got "
      f"{q.dtype}, {k.dtype}, {v.dtype}"
    )
  if H % 64 or H > 256:
    raise ValueError(f"flash_attention_mgpu: head dim H={H} must be a multiple of 64, <= 256")
  for name, value in (("block_q", block_q), ("block_kv", block_kv)):
    if value % 64:
      raise ValueError(f"flash_attention_mgpu: {name}={value} must be a multiple of 64")
  if stages < 2:
    raise ValueError(f"flash_attention_mgpu: stages={stages} must be at least 2")
  if T % (_CONSUMERS * block_q) or S % block_kv:
    raise ValueError(
      f"flash_attention_mgpu: T={T} must be a multiple of 2 * block_q={2 * block_q} and "
      f"S={S} of block_kv={block_kv}; {shapes}"
    )
  if causal and T > S:
    raise ValueError(f"flash_attention_mgpu: causal needs T <= S, got T={T} S={S}")


def _produce(load, total_steps, stages: int, free) -> None:
  """The producer's loop: fill the ring of `stages` slots, then reload slot j % stages with
  step j once every barrier in `free` says both consumers are done with it."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  for j in range(stages):

    @pl.when(j < total_steps)
    def _fill(j=j):
      load(j, j)

  @pl.loop(stages, total_steps)
  def _refill(j):
    slot = lax.rem(j, jnp.int32(stages))
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])
    load(j, slot)


def _skip_slot(ready, free, slot) -> None:
  """A consumer's turn on a step loaded for the other consumer only: wait for each copy (so
  every barrier's phase is observed in order) and hand the slot back."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  for barrier in ready:
    plgpu.barrier_wait(barrier.at[slot])
  for barrier in free:
    plgpu.barrier_arrive(barrier.at[slot])


def _scores(lhs_smem, rhs_smem, shape):
  """f32[shape] lhs @ rhs^T on the tensor cores (wgmma from shared memory into registers)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def matmul(acc_ref):
    plgpu.wgmma(acc_ref, lhs_smem, plgpu.transpose_ref(rhs_smem, (1, 0)))
    return acc_ref[...]

  return pl.run_scoped(matmul, plgpu.ACC(shape, jnp.float32))


def _masked(s_XY, visible):
  """s_XY with -inf where visible(i, j) is False (i, j: the tile's row and column iotas)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  i = plgpu.broadcasted_iota(jnp.int32, s_XY.shape, 0, layout=plgpu.Layout.WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, s_XY.shape, 1, layout=plgpu.Layout.WGMMA)
  return jnp.where(visible(i, j), s_XY, -jnp.inf)


def _kv_producer(kv_refs, ring, at, total_steps, block_kv: int, stages: int):
  """The producer warpgroup of a query-tile program (the forward, dQ): the K and V blocks of
  (batch, kv head) `at`, one per step for `total_steps` steps, into the ring ((smem, ready,
  free), each a (K, V) pair)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  plgpu.set_max_registers(40, action="decrease")
  k_ref, v_ref = kv_refs
  (k_smem, v_smem), (k_ready, v_ready), free = ring
  b, kv_head = at

  def load(j, slot):
    block = (b, pl.ds(j * block_kv, block_kv), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[block], k_smem.at[slot], k_ready.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[block], v_smem.at[slot], v_ready.at[slot])

  _produce(load, total_steps, stages, free)


def _query_schedule(q_ref, k_ref, *, causal: bool, block_q: int, block_kv: int):
  """Where a query-tile program (the forward, dQ) is and which key blocks it walks.

  Returns (b, n, wg, offset, total_steps, row0, steps, unmasked): batch, head and warpgroup; the
  causal offset (query t sits at position offset + t: bottom-right alignment); the key blocks the
  producer loads, what the later consumer needs (the earlier one skips the tail); and for a
  consumer warpgroup its first query row, the key blocks its rows see, and how many of those
  every row sees entirely (keys <= offset + row0), which need no mask.
  """
  b, n = lax.axis_index("batch"), lax.axis_index("heads")
  tile, wg = lax.axis_index("q_tiles"), lax.axis_index("wg")
  T, S = q_ref.shape[1], k_ref.shape[1]
  offset = S - T
  all_steps = S // block_kv

  def visible_steps(row_end):
    """Key blocks that query rows < row_end can see."""
    if not causal:
      return jnp.int32(all_steps)
    return jnp.minimum(pl.cdiv(row_end + offset, jnp.int32(block_kv)), all_steps)

  tile_row0 = tile * (_CONSUMERS * block_q)
  total_steps = visible_steps(tile_row0 + _CONSUMERS * block_q)
  row0 = tile_row0 + wg * block_q
  steps = visible_steps(row0 + block_q)
  unmasked = steps
  if causal:
    unmasked = jnp.minimum(lax.div(row0 + offset + 1, jnp.int32(block_kv)), steps)
  return b, n, wg, offset, total_steps, row0, steps, unmasked


def _kernel(
  q_ref, k_ref, v_ref, o_ref, lse_ref, scratch, *, causal, scale, groups, block_q, block_kv, stages
):
  """One program: 2 * block_q query rows of head `heads`; warpgroups 0, 1 consume, 2 loads."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  (q_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free) = scratch
  # q_smem2 [2, Q, H] (reused for the output), k_smem / v_smem [stages, Z, H], lse_smem2 [2, Q]
  H, dtype = q_ref.shape[3], q_ref.dtype
  b, n, wg, offset, total_steps, row0, steps, unmasked = _query_schedule(
    q_ref, k_ref, causal=causal, block_q=block_q, block_kv=block_kv
  )

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    q_smem = q_smem2.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, block_q), n], q_smem, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m_Q = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
    l_Q = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
    acc_QH = plgpu.layout_cast(jnp.zeros((block_q, H), jnp.float32), plgpu.Layout.WGMMA)

    def step(j, carry, *, masked):
      acc_QH, m_Q, l_Q = carry
      slot = lax.rem(j, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])

      # Scores in base 2: exp(x * scale) = exp2(x * scale * log2(e)).
      s_QZ = _scores(q_smem, k_smem.at[slot], (block_q, block_kv))
      plgpu.barrier_arrive(k_free.at[slot])
      s_QZ = s_QZ * jnp.float32(scale * _LOG2E)
      if masked:
        s_QZ = _masked(s_QZ, lambda r, c: j * block_kv + c <= offset + row0 + r)
      m_new_Q = jnp.maximum(m_Q, s_QZ.max(axis=1))
      alpha_Q = jnp.exp2(m_Q - m_new_Q)
      p_QZ = jnp.exp2(s_QZ - lax.broadcast_in_dim(m_new_Q, s_QZ.shape, [0]))
      l_Q = l_Q * alpha_Q + p_QZ.sum(axis=1)
      acc_QH = acc_QH * lax.broadcast_in_dim(alpha_Q, acc_QH.shape, [0])
      plgpu.barrier_wait(v_ready.at[slot])

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_QZ.astype(dtype), v_smem.at[slot])

      acc_QH = pl.run_state(pv)(plgpu.ACC.init(acc_QH))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc_QH, m_new_Q, l_Q

    carry = (acc_QH, m_Q, l_Q)
    carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
    if causal:
      carry = lax.fori_loop(unmasked, steps, functools.partial(step, masked=True), carry)
    acc_QH, m_Q, l_Q = carry

    # Blocks loaded for the other consumer only: wait for each (so every barrier's phase is
    # observed in order) and hand the slot back.
    @pl.loop(steps, total_steps)
    def _release(j):
      _skip_slot((k_ready, v_ready), (k_free, v_free), lax.rem(j, jnp.int32(stages)))

    # Every row sees at least one key (T <= S when causal), so l > 0.
    q_smem[...] = (acc_QH / lax.broadcast_in_dim(l_Q, acc_QH.shape, [0])).astype(dtype)
    lse_smem = lse_smem2.at[wg]
    lse_smem[...] = (m_Q + jnp.log2(l_Q)) * jnp.float32(math.log(2.0))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(row0, block_q), n])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, n, pl.ds(row0, block_q)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    ring = ((k_smem, v_smem), (k_ready, v_ready), (k_free, v_free))
    at = (b, lax.div(n, jnp.int32(groups)))
    _kv_producer((k_ref, v_ref), ring, at, total_steps, block_kv, stages)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static configuration of one call (hashable: the custom_vjp's nondiff argument)."""

  causal: bool
  scale: float
  block_q: int
  block_kv: int
  stages: int


# wgmma reads 128-byte swizzled tiles of 8 rows x 64 columns from shared memory.
def _tiled():
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _forward(q: Array, k: Array, v: Array, cfg: _Config) -> tuple[Array, Array]:
  """out [B, T, N, H] and the natural-log log-sum-exp f32[B, N, T]."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  B, T, N, H = q.shape
  K = k.shape[2]
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  kernel = functools.partial(
    _kernel,
    causal=cfg.causal,
    scale=cfg.scale,
    groups=N // K,
    block_q=block_q,
    block_kv=block_kv,
    stages=stages,
  )

  def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
    buffers = (
      plgpu.SMEM((_CONSUMERS, block_q, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((stages, block_kv, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((stages, block_kv, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
    )
    ready = (
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=_CONSUMERS),
    )
    free = (plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),) * 2
    pl.run_scoped(
      lambda *scratch: kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scratch),
      buffers,
      ready,
      free,
      collective_axes="wg",
    )

  return plgpu.kernel(
    entry,
    out_type=(
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),  # T minor: 1-D copies of block_q rows
    ),
    grid=(N, T // (_CONSUMERS * block_q), B),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=_CONSUMERS + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q, k, v)


# -- backward -------------------------------------------------------------------------------------


def _check_backward(q: Array, k: Array) -> None:
  """What the backward needs beyond the forward's checks (raised when the gradient is traced)."""
  H, S = q.shape[3], k.shape[1]
  if H > _MAX_BWD_HEAD_DIM:
    raise ValueError(
      f"flash_attention_mgpu backward: head dim H={H} must be <= {_MAX_BWD_HEAD_DIM} (each "
      f"dK/dV consumer holds two f32 [{_BWD_BLOCK}, H] accumulators in registers)"
    )
  if S % (_CONSUMERS * _BWD_BLOCK):
    raise ValueError(
      f"flash_attention_mgpu backward: S={S} must be a multiple of {_CONSUMERS * _BWD_BLOCK} "
      f"(each dK/dV program holds 2 x {_BWD_BLOCK} keys); k.shape={tuple(k.shape)}"
    )


def backward_delta(out: Array, do: Array, dlse_BNT: Array | None = None) -> Array:
  """f32[B, N, T] delta_t = sum_s P_ts dP_ts = <dO_t, O_t>, lowered by the lse cotangent.

  dS_ts = P_ts (dP_ts - delta_t); a cotangent g_t on lse_t adds g_t P_ts to dS_ts (d lse_t /
  d s_ts = P_ts), which is the same as lowering delta_t by g_t, so one kernel serves both.
  """
  delta_BNT = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
  return delta_BNT if dlse_BNT is None else delta_BNT - dlse_BNT


def _dq_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dq_ref,
  scratch,
  *,
  causal,
  scale,
  groups,
  block_q,
  block_kv,
  stages,
):
  """dQ of 2 * block_q query rows of head `heads`: warpgroups 0, 1 consume, 2 streams K and V.

  The forward's pipeline with two more matmuls per key block: P is recomputed from the saved
  log-sum-exp (no running max), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  (q_smem2, do_smem2, k_smem, v_smem, lse_smem2, delta_smem2), rows_ready, kv_ready, free = scratch
  k_ready, v_ready = kv_ready
  k_free, v_free = free
  H, dtype = q_ref.shape[3], q_ref.dtype
  b, n, wg, offset, total_steps, row0, steps, unmasked = _query_schedule(
    q_ref, k_ref, causal=causal, block_q=block_q, block_kv=block_kv
  )

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    rows = (b, pl.ds(row0, block_q), n)
    row_stats = (b, n, pl.ds(row0, block_q))
    q_ready, do_ready, lse_ready, delta_ready = (r.at[wg] for r in rows_ready)
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_ready)
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_ready)
    plgpu.copy_gmem_to_smem(lse_ref.at[row_stats], lse_smem2.at[wg], lse_ready)
    plgpu.copy_gmem_to_smem(delta_ref.at[row_stats], delta_smem2.at[wg], delta_ready)
    for barrier in (q_ready, do_ready, lse_ready, delta_ready):
      plgpu.barrier_wait(barrier)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lse2_Q = plgpu.load(lse_smem2.at[wg], (), layout=row_layout)
    delta_Q = plgpu.load(delta_smem2.at[wg], (), layout=row_layout)
    dq_QH = plgpu.layout_cast(jnp.zeros((block_q, H), jnp.float32), plgpu.Layout.WGMMA)

    def step(j, dq_QH, *, masked):
      slot = lax.rem(j, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])

      s_QZ = _scores(q_smem, k_smem.at[slot], (block_q, block_kv)) * jnp.float32(scale * _LOG2E)
      if masked:
        s_QZ = _masked(s_QZ, lambda r, c: j * block_kv + c <= offset + row0 + r)
      # The saved lse (in base 2 here) normalises directly: P = exp2(s - lse2), 0 where masked.
      p_QZ = jnp.exp2(s_QZ - lax.broadcast_in_dim(lse2_Q, s_QZ.shape, [0]))
      plgpu.barrier_wait(v_ready.at[slot])

      def dov(dp_ref):
        plgpu.wgmma(dp_ref, do_smem, plgpu.transpose_ref(v_smem.at[slot], (1, 0)))
        return dp_ref[...]

      dp_QZ = pl.run_scoped(dov, plgpu.ACC((block_q, block_kv), jnp.float32))
      plgpu.barrier_arrive(v_free.at[slot])
      ds_QZ = p_QZ * (dp_QZ - lax.broadcast_in_dim(delta_Q, dp_QZ.shape, [0]))

      def dsk(dq_ref):
        plgpu.wgmma(dq_ref, ds_QZ.astype(dtype), k_smem.at[slot])

      dq_QH = pl.run_state(dsk)(plgpu.ACC.init(dq_QH))
      plgpu.barrier_arrive(k_free.at[slot])
      return dq_QH

    dq_QH = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), dq_QH)
    if causal:
      dq_QH = lax.fori_loop(unmasked, steps, functools.partial(step, masked=True), dq_QH)

    @pl.loop(steps, total_steps)
    def _release(j):
      slot = lax.rem(j, jnp.int32(stages))
      _skip_slot((k_ready, v_ready), (k_free, v_free), slot)

    q_smem[...] = (dq_QH * jnp.float32(scale)).astype(dtype)  # q is no longer needed
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    ring = ((k_smem, v_smem), (k_ready, v_ready), (k_free, v_free))
    at = (b, lax.div(n, jnp.int32(groups)))
    _kv_producer((k_ref, v_ref), ring, at, total_steps, block_kv, stages)


def _dkv_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dk_ref,
  dv_ref,
  scratch,
  *,
  causal,
  scale,
  groups,
  block_q,
  block_kv,
  stages,
):
  """dK, dV of 2 * block_kv keys of kv head `kv_heads`: warpgroups 0, 1 consume (block_kv keys
  each), 2 streams Q, dO, lse and delta blocks of every query head of the group.

  Computed transposed, so the keys are the wgmma rows and the accumulators stay [Z, H]:
  S^T = K Q^T, P^T = exp2(S^T - lse2), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
  dK += dS^T Q. The G query heads of a group are summed here, in the f32 accumulators.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem), kv_ready, rows_ready, free = scratch
  q_ready, do_ready, lse_ready, delta_ready = rows_ready
  b, h = lax.axis_index("batch"), lax.axis_index("kv_heads")
  tile, wg = lax.axis_index("kv_tiles"), lax.axis_index("wg")
  T, S, H = q_ref.shape[1], k_ref.shape[1], q_ref.shape[3]
  dtype = q_ref.dtype
  offset = S - T
  num_q_blocks = T // block_q

  def first_visible(key0):
    """First query block with a row that sees key key0 (row t sees keys <= offset + t)."""
    if not causal:
      return jnp.int32(0)
    return lax.div(jnp.maximum(key0 - offset, 0), jnp.int32(block_q))

  # The producer streams what the earlier consumer (lower keys) needs; the later one skips the
  # head of each group's run of query blocks.
  tile_key0 = tile * (_CONSUMERS * block_kv)
  tile_first = first_visible(tile_key0)
  per_group = num_q_blocks - tile_first
  total_steps = groups * per_group

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    key0 = tile_key0 + wg * block_kv
    keys = (b, pl.ds(key0, block_kv), h)
    k_ready, v_ready = (r.at[wg] for r in kv_ready)
    plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, k_ready)
    plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, v_ready)
    plgpu.barrier_wait(k_ready)
    plgpu.barrier_wait(v_ready)
    first = first_visible(key0)
    # Query blocks from `unmasked` on see the whole key block: offset + i * block_q >= key0 +
    # block_kv - 1; the ones before it straddle the diagonal.
    unmasked = first
    if causal:
      last_key = jnp.maximum(key0 + block_kv - 1 - offset, 0)
      unmasked = jnp.clip(pl.cdiv(last_key, jnp.int32(block_q)), first, num_q_blocks)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    zeros_ZH = plgpu.layout_cast(jnp.zeros((block_kv, H), jnp.float32), plgpu.Layout.WGMMA)
    zeros_ZQ = plgpu.layout_cast(jnp.zeros((block_kv, block_q), jnp.float32), plgpu.Layout.WGMMA)

    def step(i, carry, *, base, masked):
      dk_ZH, dv_ZH = carry
      slot = lax.rem(base + i - tile_first, jnp.int32(stages))
      plgpu.barrier_wait(q_ready.at[slot])

      s_ZQ = _scores(k_smem, q_smem.at[slot], (block_kv, block_q)) * jnp.float32(scale * _LOG2E)
      if masked:
        s_ZQ = _masked(s_ZQ, lambda key, r: key0 + key <= offset + i * block_q + r)
      plgpu.barrier_wait(lse_ready.at[slot])
      lse2_Q = plgpu.load(lse_smem.at[slot], (), layout=col_layout)
      p_ZQ = jnp.exp2(s_ZQ - lax.broadcast_in_dim(lse2_Q, s_ZQ.shape, [1]))
      plgpu.barrier_wait(do_ready.at[slot])

      def pdo_vdo(refs):
        # Both matmuls read dO: issued together, they share one wgmma wait.
        dv_ref, dp_ref = refs
        plgpu.wgmma(dv_ref, p_ZQ.astype(dtype), do_smem.at[slot])
        plgpu.wgmma(dp_ref, v_smem, plgpu.transpose_ref(do_smem.at[slot], (1, 0)))

      dv_ZH, dp_ZQ = pl.run_state(pdo_vdo)((plgpu.ACC.init(dv_ZH), plgpu.ACC.init(zeros_ZQ)))
      plgpu.barrier_wait(delta_ready.at[slot])
      delta_Q = plgpu.load(delta_smem.at[slot], (), layout=col_layout)
      ds_ZQ = p_ZQ * (dp_ZQ - lax.broadcast_in_dim(delta_Q, dp_ZQ.shape, [1]))

      def dsq(dk_ref):
        plgpu.wgmma(dk_ref, ds_ZQ.astype(dtype), q_smem.at[slot])

      dk_ZH = pl.run_state(dsq)(plgpu.ACC.init(dk_ZH))
      plgpu.barrier_arrive(free.at[slot])
      return dk_ZH, dv_ZH

    def group(g, carry):
      base = g * per_group

      # Query blocks streamed for the other consumer only (none unless causal).
      @pl.loop(tile_first, first)
      def _skip(i):
        slot = lax.rem(base + i - tile_first, jnp.int32(stages))
        _skip_slot(rows_ready, (free,), slot)

      if causal:
        carry = lax.fori_loop(
          first, unmasked, functools.partial(step, base=base, masked=True), carry
        )
      return lax.fori_loop(
        unmasked, num_q_blocks, functools.partial(step, base=base, masked=False), carry
      )

    dk_ZH, dv_ZH = lax.fori_loop(0, groups, group, (zeros_ZH, zeros_ZH))
    k_smem[...] = (dk_ZH * jnp.float32(scale)).astype(dtype)  # K and V are no longer needed
    v_smem[...] = dv_ZH.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    def load(j, slot):
      n = h * groups + lax.div(j, per_group)
      row0 = (tile_first + lax.rem(j, per_group)) * block_q
      rows, row_stats = (b, pl.ds(row0, block_q), n), (b, n, pl.ds(row0, block_q))
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[row_stats], lse_smem.at[slot], lse_ready.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[row_stats], delta_smem.at[slot], delta_ready.at[slot])

    _produce(load, total_steps, stages, (free,))


def _backward(q, k, v, out, lse_BNT, do, dlse_BNT, cfg: _Config):
  """dq, dk, dv: delta in jnp, then the dQ kernel and the dK/dV kernel."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  _check_backward(q, k)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  # T is a multiple of 2 * block_q, so of 2 * _BWD_BLOCK; S is checked above.
  block_q = block_kv = _BWD_BLOCK
  stages = cfg.stages
  delta_BNT = backward_delta(out, do, dlse_BNT)
  lse2_BNT = lse_BNT * jnp.float32(_LOG2E)  # the kernels work in base 2
  static = dict(
    causal=cfg.causal,
    scale=cfg.scale,
    groups=N // K,
    block_q=block_q,
    block_kv=block_kv,
    stages=stages,
  )
  params = plgpu.CompilerParams(approx_math=True)
  args = (q, k, v, do, lse2_BNT, delta_BNT)

  def dq_entry(*refs):
    buffers = (
      plgpu.SMEM((_CONSUMERS, block_q, H), q.dtype, transforms=_tiled()),  # q, then dq
      plgpu.SMEM((_CONSUMERS, block_q, H), q.dtype, transforms=_tiled()),  # do
      plgpu.SMEM((stages, block_kv, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((stages, block_kv, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
      plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
    )
    rows_ready = (plgpu.Barrier(num_barriers=_CONSUMERS),) * 4
    kv_ready = (plgpu.Barrier(num_barriers=stages),) * 2
    free = (plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),) * 2
    pl.run_scoped(
      lambda *scratch: _dq_kernel(*refs, scratch, **static),
      buffers,
      rows_ready,
      kv_ready,
      free,
      collective_axes="wg",
    )

  dq = plgpu.kernel(
    dq_entry,
    out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
    grid=(N, T // (_CONSUMERS * block_q), B),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=_CONSUMERS + 1,
    thread_name="wg",
    compiler_params=params,
  )(*args)

  def dkv_entry(*refs):
    buffers = (
      plgpu.SMEM((_CONSUMERS, block_kv, H), q.dtype, transforms=_tiled()),  # k, then dk
      plgpu.SMEM((_CONSUMERS, block_kv, H), q.dtype, transforms=_tiled()),  # v, then dv
      plgpu.SMEM((stages, block_q, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((stages, block_q, H), q.dtype, transforms=_tiled()),
      plgpu.SMEM((stages, block_q), jnp.float32),
      plgpu.SMEM((stages, block_q), jnp.float32),
    )
    kv_ready = (plgpu.Barrier(num_barriers=_CONSUMERS),) * 2
    rows_ready = (plgpu.Barrier(num_barriers=stages),) * 4
    # One "free" barrier per slot: Q, the last of the four a step reads, frees them all.
    free = plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages)
    pl.run_scoped(
      lambda *scratch: _dkv_kernel(*refs, scratch, **static),
      buffers,
      kv_ready,
      rows_ready,
      free,
      collective_axes="wg",
    )

  dk, dv = plgpu.kernel(
    dkv_entry,
    out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
    grid=(K, S // (_CONSUMERS * block_kv), B),
    grid_names=("kv_heads", "kv_tiles", "batch"),
    num_threads=_CONSUMERS + 1,
    thread_name="wg",
    compiler_params=params,
  )(*args)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q: Array, k: Array, v: Array, cfg: _Config) -> tuple[Array, Array]:
  return _forward(q, k, v, cfg)


def _attention_fwd(q, k, v, cfg: _Config):
  out, lse_BNT = _forward(q, k, v, cfg)
  # Kept for the backward: the inputs, the output and one float per query row.
  return (out, lse_BNT), (q, k, v, out, lse_BNT)


def _attention_bwd(cfg: _Config, residuals, cotangents):
  q, k, v, out, lse_BNT = residuals
  do, dlse_BNT = cotangents
  return _backward(q, k, v, out, lse_BNT, do, dlse_BNT, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(
  jax.jit, static_argnames=("causal", "scale", "block_q", "block_kv", "stages", "return_lse")
)
def flash_attention_mgpu(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool = False,
  scale: float | None = None,
  block_q: int = 64,
  block_kv: int = 64,
  stages: int = 2,
  return_lse: bool = False,
) -> Array | tuple[Array, Array]:
  """FlashAttention on Hopper (sm_90), differentiable: see the module docstring for its scope.

  Args:
    q: [B, T, N, H] bfloat16 or float16; T a multiple of 2 * block_q; H a multiple of 64
      (<= 256; <= 128 for the gradient).
    k: [B, S, K, H], N a multiple of K; S a multiple of block_kv (of 128 for the gradient; and
      >= T when causal).
    v: [B, S, K, H].
    causal: bottom-right aligned causal mask.
    scale: softmax scale, default H ** -0.5.
    block_q: forward query rows per consumer warpgroup (a multiple of 64).
    block_kv: forward keys per pipeline stage (a multiple of 64). The backward's tiles are 64.
    stages: blocks in flight (shared-memory ring slots), at least 2, forward and backward.
    return_lse: also return the log-sum-exp f32[B, T, N] (differentiable too).

  Returns:
    out [B, T, N, H] in q.dtype (and the log-sum-exp).
  """
  _check(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv, stages=stages)
  H = q.shape[3]
  scale = H**-0.5 if scale is None else scale
  cfg = _Config(
    causal=causal, scale=float(scale), block_q=block_q, block_kv=block_kv, stages=stages
  )
  out, lse_BNT = _attention(q, k, v, cfg)
  if return_lse:
    return out, jnp.transpose(lse_BNT, (0, 2, 1))
  return out
