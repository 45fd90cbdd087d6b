"""Context parallelism: a training sequence split over the mesh's `context` axis.

With C devices on `context`, a sequence of T tokens is cut into 2C chunks of c = T / (2C) and
device i holds chunks i and 2C-1-i (load-balanced striping): under a causal mask an early chunk
sees few keys and a late one many, so each device gets one of each and the attention work is
even. `stripe_permutation` is that order; the trainer permutes a batch's inputs, targets,
positions, segment ids and loss mask by it before the model runs (the loss is a sum over tokens,
so it does not change), and every layer but attention works token by token.

Attention (`context_attention`, inside a `shard_map` over the whole mesh) knows each local
query's global index from its device's place on the axis, and builds the causal mask from the
global indices, never the local row:

* "all_gather" (the default): K, V and the segment ids are gathered across the axis and put back
  in sequence order, and the existing attention kernel (`atlas_jax.kernels.attention`, Pallas
  FlashAttention where the dispatcher picks it, XLA on CPU) runs the local queries against them
  with `q_positions` = their global indices.
* "ring": K/V blocks travel around the axis with `jax.lax.ppermute`, C steps; each step's partial
  softmax (its output and log-sum-exp) merges into the running one by log-sum-exp. The partials
  come from FlashAttention with `return_lse` where the dispatcher picks a kernel, else from an
  XLA block.

Gradients are autodiff of the shard_map body (an all-gather transposes to a reduce-scatter, a
ppermute to the reverse ppermute).

The mode is set by the trainer (`use(mode)`, around tracing) and read where attention is traced;
it is active only while the mesh in context has a `context` axis of more than one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from atlas_jax import kernels
from atlas_jax.kernels import flash_attention
from atlas_jax.kernels.reference import chunk_start

Array = jax.Array
AXIS = "context"
MODES = ("all_gather", "ring")
# Mesh axes that split the batch (rows); `tensor` splits heads, `context` the sequence.
_ROW_AXES = ("data", "fsdp", "expert", "stage")

_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("context_parallel", default=None)


@contextlib.contextmanager
def use(mode: str | None):
  """Context-parallel attention in `mode` ("all_gather" or "ring") for what is traced inside."""
  if mode is not None and mode not in MODES:
    raise ValueError(f"train.context_parallel={mode!r} is not one of {MODES}")
  token = _MODE.set(mode)
  try:
    yield
  finally:
    _MODE.reset(token)


def context_size(mesh=None) -> int:
  """Devices on the `context` axis of `mesh` (default: the abstract mesh in context)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return dict(mesh.shape).get(AXIS, 1) if mesh is not None and mesh.shape else 1


def active() -> str | None:
  """The context-parallel mode for attention traced now, or None (no `context` axis)."""
  mode = _MODE.get()
  return mode if mode is not None and context_size() > 1 else None


def stripe_permutation(T: int, C: int) -> np.ndarray:
  """i32[T]: striped[p] = x[perm[p]]; device i's block [i * T/C, (i+1) * T/C) of the striped
  sequence holds chunks i and 2C-1-i of 2C.

  Raises ValueError when 2C does not divide T.
  """
  if T % (2 * C):
    raise ValueError(
      f"train.seq_len={T} must be divisible by 2 * mesh.context = {2 * C} (two chunks a device)"
    )
  c = T // (2 * C)
  chunks = [k for i in range(C) for k in (i, 2 * C - 1 - i)]
  return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks]).astype(np.int32)


def unstripe_permutation(T: int, C: int) -> np.ndarray:
  """The inverse of `stripe_permutation`: x[n] = striped[inv[n]]."""
  return np.argsort(stripe_permutation(T, C)).astype(np.int32)


def stripe(x_BT_: Array, C: int) -> Array:
  """`x` [B, T, ...] in striped order along T."""
  return x_BT_[:, stripe_permutation(x_BT_.shape[1], C)]


def unstripe(x_BT_: Array, C: int) -> Array:
  return x_BT_[:, unstripe_permutation(x_BT_.shape[1], C)]


def row_axes(mesh, B: int) -> tuple[str, ...] | None:
  """The mesh axes splitting B rows (those of data, fsdp, expert, stage whose product divides
  B), or None."""
  rows, split = [], 1
  for name in _ROW_AXES:
    size = dict(mesh.shape).get(name, 1)
    if size > 1 and B % (split * size) == 0:
      rows.append(name)
      split *= size
  return tuple(rows) or None


def stripe_batch(arrays: dict[str, Array]) -> dict[str, Array]:
  """[B, T] arrays (inputs, targets, positions, ...) striped along T and laid out split over
  the mesh's `context` axis (the mesh in context); unchanged without one."""
  mesh = jax.sharding.get_abstract_mesh()
  C = context_size(mesh)
  if C == 1:
    return arrays
  out = {}
  for name, x in arrays.items():
    spec = P(row_axes(mesh, x.shape[0]), AXIS)
    out[name] = jax.lax.with_sharding_constraint(
      stripe(x, C), jax.sharding.NamedSharding(mesh, spec)
    )
  return out


def context_attention(
  q_BTNH: Array,
  k_BTKH: Array,
  v_BTKH: Array,
  *,
  segment_ids_BT: Array | None = None,
  sliding_window: int | None = None,
  scale: float | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  implementation: str | None = None,
  mode: str = "all_gather",
  attention_chunk: int | None = None,
) -> Array:
  """Causal self-attention of a striped sequence split over the mesh's `context` axis.

  Args:
    q_BTNH, k_BTKH, v_BTKH: queries, keys and values in striped order (`stripe_permutation`).
    segment_ids_BT: i32[B, T] packed-document ids, striped too.
    sliding_window, scale, soft_cap, sinks, implementation: as `atlas_jax.kernels.attention`.
      The ring merges its blocks' partial softmaxes first and adds the sinks' share once.
    mode: "all_gather" or "ring".
    attention_chunk: C, a chunked layer's (`kernels.reference`); chunks follow the global
      sequence index. The ring scores a chunked layer's blocks with XLA: FlashAttention's
      partials take positions relative to a block's first key, where a chunk's start is not a
      bound the kernel takes.

  Returns:
    [B, T, N, H] in striped order.
  """
  if mode not in MODES:
    raise ValueError(f"train.context_parallel={mode!r} is not one of {MODES}")
  mesh = jax.sharding.get_abstract_mesh()
  C = mesh.shape[AXIS]
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  perm_CT = jnp.asarray(stripe_permutation(T, C).reshape(C, T // C))
  rows = row_axes(mesh, B)
  t = dict(mesh.shape).get("tensor", 1)
  heads = "tensor" if t > 1 and N % t == 0 and K % t == 0 else None
  spec_x = P(rows, AXIS, heads, None)
  spec_s = P(rows, AXIS)
  body = _all_gather_local if mode == "all_gather" else _ring_local
  scoring = dict(sliding_window=sliding_window, scale=scale, soft_cap=soft_cap)
  if attention_chunk is not None:
    scoring["attention_chunk"] = attention_chunk
  local = functools.partial(body, C=C, implementation=implementation, T=T, **scoring)
  args, specs = [q_BTNH, k_BTKH, v_BTKH, perm_CT], [spec_x, spec_x, spec_x, P()]
  args.append(jnp.zeros((0,), jnp.float32) if segment_ids_BT is None else segment_ids_BT)
  specs.append(P() if segment_ids_BT is None else spec_s)
  if sinks is not None:
    args.append(sinks)
    specs.append(P(heads))
  run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=spec_x, check_vma=False)
  return run(*args)


def _local_positions(perm_CT: Array, b: int) -> Array:
  """i32[b, t]: the global sequence index of each of this device's queries."""
  i = jax.lax.axis_index(AXIS)
  return jnp.broadcast_to(perm_CT[i][None], (b, perm_CT.shape[1]))


def _all_gather_local(q, k, v, perm_CT, seg, sinks=None, *, C, T, implementation, **scoring):
  """One device's queries against the whole sequence's K/V, gathered and put back in order."""
  seg = None if seg.ndim == 1 else seg  # a placeholder where there are no segment ids
  inv = unstripe_permutation(T, C)
  gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)[:, inv]
  k_all, v_all = gather(k), gather(v)
  seg_all = None if seg is None else gather(seg)
  return kernels.attention(
    q,
    k_all,
    v_all,
    causal=True,
    q_positions=_local_positions(perm_CT, q.shape[0]),
    q_segment_ids=seg,
    kv_segment_ids=seg_all,
    sinks=sinks,
    implementation=implementation,
    **scoring,
  )


def _ring_local(q, k, v, perm_CT, seg, sinks=None, *, C, T, implementation, **scoring):
  """One device's queries against each device's K/V block in turn, passed around the ring."""
  seg = None if seg.ndim == 1 else seg  # a placeholder where there are no segment ids
  b, t = q.shape[:2]
  i = jax.lax.axis_index(AXIS)
  q_pos = _local_positions(perm_CT, b)
  use_kernel = _picks_kernel(q, k, implementation) and "attention_chunk" not in scoring
  shift = [(j, (j + 1) % C) for j in range(C)]
  out, lse, kv_seg = None, None, seg
  for step in range(C):
    src = (i - step) % C  # the device whose block this is
    kv_pos = perm_CT[src]
    partial = _flash_partial if use_kernel else _xla_partial
    o_s, lse_s = partial(q, k, v, q_pos, kv_pos, seg, kv_seg, **scoring)
    out, lse = (o_s, lse_s) if out is None else merge_partials(out, lse, o_s, lse_s)
    if step + 1 < C:
      k, v = (jax.lax.ppermute(x, AXIS, shift) for x in (k, v))
      kv_seg = None if seg is None else jax.lax.ppermute(kv_seg, AXIS, shift)
  if sinks is not None:  # each head's sink joins the softmax once: the keys' share shrinks
    sink_N = sinks.astype(jnp.float32)
    out = out * jnp.exp(lse - jnp.logaddexp(lse, sink_N))[..., None]
  return out.astype(q.dtype)


def _picks_kernel(q, k, implementation) -> bool:
  impl = implementation or kernels.default_implementation(
    q, k, causal=True, q_positions=jnp.zeros(q.shape[:2], jnp.int32)
  )
  return impl in ("pallas", "cudnn")


def _xla_partial(
  q,
  k,
  v,
  q_pos_bt,
  kv_pos_s,
  q_seg,
  kv_seg,
  *,
  sliding_window,
  scale=None,
  soft_cap=None,
  attention_chunk=None,
):
  """(f32[b, t, N, H] softmax-weighted values, f32[b, t, N] log-sum-exp; -inf where no key is
  visible) of q against one block of keys at global indices kv_pos_s."""
  b, t, N, H = q.shape
  K = k.shape[2]
  G = N // K
  qg = q.reshape(b, t, K, G, H).astype(jnp.float32)
  scale = H**-0.5 if scale is None else scale
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  visible = kv_pos_s[None, None, :] <= q_pos_bt[:, :, None]  # [b, t, s]
  if sliding_window is not None:
    visible &= q_pos_bt[:, :, None] - kv_pos_s[None, None, :] < sliding_window
  if attention_chunk is not None:
    first_bt = chunk_start(q_pos_bt, attention_chunk)
    visible &= kv_pos_s[None, None, :] >= first_bt[:, :, None]
  if q_seg is not None:
    visible &= q_seg[:, :, None] == kv_seg[:, None, :]
  visible = visible[:, None, None]  # [b, 1, 1, t, s]
  scores = jnp.where(visible, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m)
  total = jnp.sum(p, axis=-1, keepdims=True)
  some = total > 0
  o = jnp.einsum("bkgts,bskh->btkgh", p / jnp.where(some, total, 1.0), v.astype(jnp.float32))
  lse = jnp.where(some, m + jnp.log(jnp.where(some, total, 1.0)), -jnp.inf)[..., 0]
  return o.reshape(b, t, N, H), lse.transpose(0, 3, 1, 2).reshape(b, t, N)


def _flash_partial(
  q, k, v, q_pos_bt, kv_pos_s, q_seg, kv_seg, *, sliding_window, scale=None, soft_cap=None
):
  """`_xla_partial` by FlashAttention: a block holds two contiguous chunks, each one kernel call
  with the query positions taken relative to the chunk's first key."""
  s = k.shape[1]
  half = s // 2
  out, lse = None, None
  for lo in (0, half):
    o_c, lse_c = flash_attention(
      q,
      k[:, lo : lo + half],
      v[:, lo : lo + half],
      causal=True,
      q_positions=q_pos_bt - kv_pos_s[lo],
      q_segment_ids=q_seg,
      kv_segment_ids=None if kv_seg is None else kv_seg[:, lo : lo + half],
      sliding_window=sliding_window,
      scale=scale,
      soft_cap=soft_cap,
      return_lse=True,
    )
    o_c = o_c.astype(jnp.float32)
    out, lse = (o_c, lse_c) if out is None else merge_partials(out, lse, o_c, lse_c)
  return out, lse


def merge_partials(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> tuple[Array, Array]:
  """Two partial softmaxes over disjoint keys as one: weights exp(lse - lse_total); rows no key
  reached stay (0, -inf)."""
  m = jnp.maximum(lse_a, lse_b)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  total = w_a + w_b
  some = total > 0
  safe = jnp.where(some, total, 1.0)
  out = (o_a * w_a[..., None] + o_b * w_b[..., None]) / safe[..., None]
  lse = jnp.where(some, m + jnp.log(safe), -jnp.inf)
  return out, lse


def per_device_tokens(T: int, C: int) -> int:
  """Tokens of a sequence each context device holds."""
  return math.ceil(T / C)
