"""FlashAttention forward for Hopper in Pallas's Mosaic GPU backend (experimental, unmeasured).

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

What it is not, yet: it has no backward pass, no segment ids, kv lengths or sliding windows,
and no ping-pong scheduling between the two consumers (FlashAttention-3 staggers their softmax
against the other's matmuls); `attention(implementation=None)` never picks it. It needs
sm_90 to run; tests only lower it for CUDA on a CPU, and `bench/gpu.py` checks it against the
reference and times it on a GPU.
"""

from __future__ import annotations

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


def _kernel(
  q_ref, k_ref, v_ref, o_ref, lse_ref, scratch, *, causal, scale, groups, block_q, block_kv, stages
):
  """One program: 2 * block_q query rows of head `heads`; warpgroups 0, 1 consume, 2 loads."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  (q_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free) = scratch
  # q_smem2 [2, Q, H] (reused for the output), k_smem / v_smem [stages, Z, H], lse_smem2 [2, Q]
  b, n = lax.axis_index("batch"), lax.axis_index("heads")
  tile, wg = lax.axis_index("q_tiles"), lax.axis_index("wg")
  T, S, H = q_ref.shape[1], k_ref.shape[1], q_ref.shape[3]
  dtype = q_ref.dtype
  offset = S - T  # query t sits at position offset + t (bottom-right alignment)
  all_steps = S // block_kv

  def visible_steps(row_end):
    """Key blocks that query rows < row_end can see."""
    if not causal:
      return jnp.int32(all_steps)
    return jnp.minimum(pl.cdiv(row_end + offset, jnp.int32(block_kv)), all_steps)

  # The producer loads what the later consumer needs; the earlier one skips the tail.
  tile_row0 = tile * (_CONSUMERS * block_q)
  total_steps = visible_steps(tile_row0 + _CONSUMERS * block_q)

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    q_smem = q_smem2.at[wg]
    row0 = tile_row0 + wg * block_q
    steps = visible_steps(row0 + block_q)
    # Blocks every row sees entirely need no mask: keys <= offset + row0.
    unmasked = steps
    if causal:
      unmasked = jnp.minimum(lax.div(row0 + offset + 1, jnp.int32(block_kv)), steps)
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

      def qk(scores_ref):
        plgpu.wgmma(scores_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return scores_ref[...]

      # Scores in base 2: exp(x * scale) = exp2(x * scale * log2(e)).
      s_QZ = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      s_QZ = s_QZ * jnp.float32(scale * _LOG2E)
      if masked:
        shape = (block_q, block_kv)
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        s_QZ = jnp.where(j * block_kv + cols <= offset + row0 + rows, s_QZ, -jnp.inf)
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
      slot = lax.rem(j, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])

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
    plgpu.set_max_registers(40, action="decrease")
    kv_head = lax.div(n, jnp.int32(groups))

    def load(j, slot):
      block = (b, pl.ds(j * block_kv, block_kv), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[block], k_smem.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[block], v_smem.at[slot], v_ready.at[slot])

    for j in range(stages):  # fill the ring

      @pl.when(j < total_steps)
      def _fill(j=j):
        load(j, j)

    @pl.loop(stages, total_steps)
    def _refill(j):
      slot = lax.rem(j, jnp.int32(stages))
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])
      load(j, slot)


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
  """FlashAttention forward on Hopper (sm_90): see the module docstring for what it covers.

  Args:
    q: [B, T, N, H] bfloat16 or float16; T a multiple of 2 * block_q; H a multiple of 64.
    k: [B, S, K, H], N a multiple of K; S a multiple of block_kv (and >= T when causal).
    v: [B, S, K, H].
    causal: bottom-right aligned causal mask.
    scale: softmax scale, default H ** -0.5.
    block_q: query rows per consumer warpgroup (a multiple of 64).
    block_kv: keys per pipeline stage (a multiple of 64).
    stages: K/V blocks in flight (shared-memory ring slots), at least 2.
    return_lse: also return the log-sum-exp f32[B, T, N].

  Returns:
    out [B, T, N, H] in q.dtype (and the log-sum-exp).
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  _check(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv, stages=stages)
  B, T, N, H = q.shape
  K = k.shape[2]
  scale = H**-0.5 if scale is None else scale
  kernel = functools.partial(
    _kernel,
    causal=causal,
    scale=float(scale),
    groups=N // K,
    block_q=block_q,
    block_kv=block_kv,
    stages=stages,
  )

  def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
    # wgmma reads 128-byte swizzled tiles of 8 rows x 64 columns from shared memory.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    buffers = (
      plgpu.SMEM((_CONSUMERS, block_q, H), q.dtype, transforms=transforms),
      plgpu.SMEM((stages, block_kv, H), q.dtype, transforms=transforms),
      plgpu.SMEM((stages, block_kv, H), q.dtype, transforms=transforms),
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

  out, lse_BNT = plgpu.kernel(
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
  if return_lse:
    return out, jnp.transpose(lse_BNT, (0, 2, 1))
  return out
