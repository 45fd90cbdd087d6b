"""Mixture-of-experts feed-forward layers: routers, the experts' computation, shared experts.

For the t tokens of a call (the batch flattened, t = B x T), with E experts and k per token:

    logits_tE = x_tD @ W_router                    float32, whatever the compute dtype
    experts_tk, weights_tk = route(logits_tE)      each token's k experts and their weights
    y_tD = sum_j weights_tk[t, j] * expert[experts_tk[t, j]](x_tD[t])  (+ shared experts(x_tD))

Routers (`route`, configured by `atlas_jax.config.MoEConfig`): softmax or sigmoid scores; top-k
plain (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2 `greedy`), within the best groups of experts
(DeepSeek-V2 `group_limited_greedy`: a group scores its best expert), or DeepSeek-V3's `noaux_tc`
(a per-expert selection bias added for choosing only; a group scores the sum of its two best
biased scores); optional renormalisation of the k weights; `routed_scaling_factor`.

The experts' computation has one signature,
`(x_tD, experts_tk, weights_tk, w_gate_EDF, w_up_EDF, w_down_EFD) -> y_tD`, in four forms, each
taking gpt-oss's options as keywords: `biases` (each expert's gate, up and down biases, gathered
per row by its expert) and `act` (the hidden activation; `clamped_swiglu`):

* `grouped_experts` (default, dropless): the t x k assignments sorted by expert, so each expert's
  rows are one contiguous group, and `jax.lax.ragged_dot` multiplies every group by its expert's
  weights in one grouped matmul. Nothing is dropped, and no [t, E] intermediate is made. On CPU,
  XLA lowers `ragged_dot` to one masked matmul per group over every row: E x the active FLOPs
  (`bench/moe.py` measures it; BENCHMARKS.md), so a CPU run pays the dense price or more.
* `dense_experts` (the reference): every expert on every token, combined with a one-hot [t, E]
  weight matrix. E / k times the FLOPs; the tests hold the other forms to it.
* `capacity_experts` (`MoEConfig.capacity_factor`): GShard's fixed slots, [E, e, D] buffers with
  e = ceil(capacity_factor x t x k / E); an expert's assignments past its e slots, in token order,
  are dropped (deterministically) and counted (it returns the count beside y).
* `expert_parallel(mesh)` (a mesh in context, `jax.sharding.use_abstract_mesh`, with more than one
  device): the experts split over the mesh's `expert` axis (and their hidden width over `tensor`)
  inside a `shard_map`, dropless or with capacity per expert-parallel group (it returns the
  dropped count too). Inside a pipeline stage's `shard_map` (manual over `stage`) it maps over
  the axes left automatic.

Expert ids outside [0, E) mark assignments that contribute nothing (dropped ones, or experts held
by another device).

Expert parallelism: masked local experts + a reduction, chosen over all-to-all. Each device of
the `expert` axis gathers the tokens (and their routing) of its expert-parallel group
(`all_gather`), runs only its own E / ep experts on the assignments that chose them (the others'
ids fall outside its range), and the partial outputs are summed back onto each token's own device
(`psum_scatter`; `psum` over `tensor`). All-to-all would send each assignment only to its expert's
device, but XLA's all-to-all moves fixed-size buffers: dropless, each destination's buffer must hold
every local assignment (k x the tokens), k times what the all-gather moves, and only with a
capacity factor does it move less (capacity_factor x k / (ep - 1) of it), at the price of dropped
tokens. `bench/moe.py` measures both from the compiled programs on 8 devices (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from atlas_jax.config import ModelConfig, MoEConfig
from atlas_jax.model.layers import MLP, PLAIN, Ops, normal, param
from atlas_jax.quant import dequantized, w8a8_experts, w8a8_grouped_product

Array = jax.Array


class RouterBias(nnx.Variable):
  """DeepSeek-V3's per-expert selection bias (`e_score_correction_bias`): not trained by the
  gradient; the trainer moves it towards balanced load (`train.moe_bias_update_rate`)."""


# ---------------------------------------------------------------------------------------------
# Routing.


def route(
  logits_tE: Array, cfg: MoEConfig, bias_E: Array | None = None
) -> tuple[Array, Array, Array]:
  """Each token's experts and weights from its router logits.

  Args:
    logits_tE: f32[t, E] router logits.
    cfg: the router's configuration (scoring, topk_method, groups, renormalisation, scale).
    bias_E: f32[E] selection bias (noaux_tc only): added to the scores to choose experts, never
      to the weights.

  Returns:
    (experts i32[t, k], weights f32[t, k], probs f32[t, E]): probs are the scores normalised to
    sum to 1 per token, what the load-balancing loss reads.
  """
  E, k = cfg.n_experts, cfg.top_k
  if cfg.scoring == "softmax":
    scores_tE = jax.nn.softmax(logits_tE, axis=-1)
    probs_tE = scores_tE
  else:
    scores_tE = jax.nn.sigmoid(logits_tE)
    probs_tE = scores_tE / jnp.sum(scores_tE, axis=-1, keepdims=True)
  choice_tE = scores_tE
  if cfg.topk_method == "noaux_tc":
    if bias_E is None:
      raise ValueError("route: topk_method='noaux_tc' needs bias_E, the selection bias f32[E]")
    choice_tE = scores_tE + jax.lax.stop_gradient(bias_E)
  if cfg.topk_method != "greedy" and cfg.n_group > 1:
    t = logits_tE.shape[0]
    g = cfg.n_group
    grouped_tgE = choice_tE.reshape(t, g, E // g)  # E // g experts per group
    if cfg.topk_method == "noaux_tc":
      group_tg = jnp.sum(jax.lax.top_k(grouped_tgE, 2)[0], axis=-1)  # its two best
    else:
      group_tg = jnp.max(grouped_tgE, axis=-1)  # its best
    _, best_groups = jax.lax.top_k(group_tg, cfg.topk_group)
    keep_tg = jnp.sum(jax.nn.one_hot(best_groups, g, dtype=jnp.int32), axis=1) > 0
    keep_tE = jnp.repeat(keep_tg, E // g, axis=1)
    choice_tE = jnp.where(keep_tE, choice_tE, -jnp.inf)
  _, experts_tk = jax.lax.top_k(choice_tE, k)
  weights_tk = jnp.take_along_axis(scores_tE, experts_tk, axis=-1)
  if cfg.norm_topk_prob:
    weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + 1e-20)
  return experts_tk.astype(jnp.int32), weights_tk * cfg.routed_scaling_factor, probs_tE


@struct.dataclass
class RouterStats:
  """What training reads from the routers of one or more MoE layers (leading [L] once stacked)."""

  counts_E: Array  # f32[E] assignments routed to each expert (before any drop)
  probs_E: Array  # f32[E] mean routing probability per expert (differentiable)
  z_loss: Array  # f32[] mean over tokens of logsumexp(router logits)^2
  dropped: Array  # f32[] assignments dropped by the capacity limit

  def balance_loss(self) -> Array:
    """The Switch/Mixtral load-balancing loss E * sum_e f_e P_e, f_e the share of assignments
    expert e took and P_e its mean probability: 1.0 when balanced, up to E when one expert takes
    every token ([L] once stacked). Its gradient reaches the router through P_e."""
    E = self.counts_E.shape[-1]
    share_E = self.counts_E / jnp.maximum(jnp.sum(self.counts_E, axis=-1, keepdims=True), 1.0)
    return E * jnp.sum(share_E * self.probs_E, axis=-1)

  def merge_calls(self) -> RouterStats:
    """Stats [L, U, ...] of U calls on equal shares of the tokens (pipeline micro-batches) as
    one call's [L, ...]: assignments and drops add up; probabilities and z-losses, means over
    equal token counts, average."""
    return RouterStats(
      counts_E=jnp.sum(self.counts_E, axis=1),
      probs_E=jnp.mean(self.probs_E, axis=1),
      z_loss=jnp.mean(self.z_loss, axis=1),
      dropped=jnp.sum(self.dropped, axis=1),
    )


def router_stats(
  logits_tE: Array, experts_tk: Array, probs_tE: Array, dropped: Array
) -> RouterStats:
  """One layer's stats from its routing of t tokens (f32[t, E], i32[t, k], f32[t, E], i32[])."""
  E = logits_tE.shape[-1]
  counts_E = jnp.sum(jax.nn.one_hot(experts_tk, E, dtype=jnp.float32), axis=(0, 1))
  return RouterStats(
    counts_E=jax.lax.stop_gradient(counts_E),
    probs_E=jnp.mean(probs_tE, axis=0),
    z_loss=jnp.mean(jnp.square(jax.nn.logsumexp(logits_tE, axis=-1))),
    dropped=jnp.asarray(dropped, jnp.float32),
  )


# ---------------------------------------------------------------------------------------------
# The experts' computation: one signature, four forms.


def _valid(experts_tk: Array, E: int) -> Array:
  return (experts_tk >= 0) & (experts_tk < E)


def _combine(out_tkD: Array, weights_tk: Array) -> Array:
  """f32[t, D]: each token's k expert outputs weighted and summed in float32."""
  return jnp.einsum("tkD,tk->tD", out_tkD.astype(jnp.float32), weights_tk.astype(jnp.float32))


def clamped_swiglu(gate: Array, up: Array, *, limit: float, alpha: float) -> Array:
  """gpt-oss's expert activation: gate clamped to <= limit, up to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate)."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


def _swiglu(x, w_gate, w_up, w_down, matmul, matmul_down=None, *, bias=None, act=None):
  """The experts' SwiGLU with `matmul` (and `matmul_down` for the down projection, default the
  same); the outputs are named for the selective remat policy.

  `bias`: None or (gate, up, down) biases, each broadcasting against its projection's output
  (the rows' experts' biases); `act`: (gate, up) -> hidden, default silu(gate) * up."""
  gate, up = matmul(x, w_gate), matmul(x, w_up)
  if bias is not None:
    gate, up = gate + bias[0].astype(gate.dtype), up + bias[1].astype(up.dtype)
  gate = checkpoint_name(gate, "expert_gate")
  up = checkpoint_name(up, "expert_up")
  down = matmul if matmul_down is None else matmul_down
  out = down(jax.nn.silu(gate) * up if act is None else act(gate, up), w_down)
  if bias is not None:
    out = out + bias[2].astype(out.dtype)
  return checkpoint_name(out, "expert_down")


def _sorted(experts_tk: Array, E: int) -> tuple[Array, Array, Array]:
  """(order i32[a], group sizes i32[E], rank i32[a]) of the a = t x k assignments, token-major:
  `order` sorts them by expert (ids outside [0, E) last), stable, so an expert's rows keep token
  order; `rank` is each assignment's place among its expert's (in assignment order)."""
  key_a = jnp.where(_valid(experts_tk, E), experts_tk, E).reshape(-1)
  order_a = jnp.argsort(key_a, stable=True)
  sizes_E = jnp.bincount(key_a, length=E + 1)[:E].astype(jnp.int32)
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  a = key_a.shape[0]
  sorted_key_a = key_a[order_a]
  sorted_rank_a = jnp.arange(a, dtype=jnp.int32) - jnp.take(starts_E, sorted_key_a, mode="clip")
  rank_a = jnp.zeros((a,), jnp.int32).at[order_a].set(sorted_rank_a)
  return order_a, sizes_E, rank_a


def _grouped_f32(
  x_tD,
  experts_tk,
  weights_tk,
  w_gate_EDF,
  w_up_EDF,
  w_down_EFD,
  *,
  biases=None,
  act=None,
  w8a8=False,
) -> Array:
  t, k = experts_tk.shape
  D = x_tD.shape[-1]
  E = w_gate_EDF.shape[0]
  dtype = x_tD.dtype
  order_a, sizes_E, _ = _sorted(experts_tk, E)
  x_aD = jnp.take(x_tD, order_a // k, axis=0)  # the assignments' tokens, grouped by expert
  ids_a = jnp.where(_valid(experts_tk, E), experts_tk, E).reshape(-1)[order_a]  # E: past them
  # Rows past the last group (ids outside [0, E)) come out of ragged_dot as zeros.
  if w8a8:  # e4m3 stacks: FP8 ragged matmuls, each row's expert's scales
    matmul = lambda lhs, rhs: w8a8_grouped_product(lhs, rhs, sizes_E, ids_a)
  else:
    matmul = lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs.astype(dtype), sizes_E)
  bias = None
  if biases is not None:  # each sorted row takes its expert's biases (none past the groups)
    bias = tuple(jnp.take(b, ids_a, axis=0, mode="fill", fill_value=0) for b in biases)
  out_aD = _swiglu(x_aD, w_gate_EDF, w_up_EDF, w_down_EFD, matmul, bias=bias, act=act)
  # Back to assignment order (the inverse permutation), then summed per token.
  inverse_a = jnp.zeros_like(order_a).at[order_a].set(jnp.arange(t * k, dtype=order_a.dtype))
  out_tkD = jnp.take(out_aD, inverse_a, axis=0).reshape(t, k, D)
  return _combine(out_tkD, jnp.where(_valid(experts_tk, E), weights_tk, 0.0))


def grouped_experts(x_tD, experts_tk, weights_tk, *weights, **options) -> Array:
  """Dropless: the assignments sorted by expert, one `jax.lax.ragged_dot` per matmul.

  Args:
    x_tD: [t, D] tokens (compute dtype).
    experts_tk: i32[t, k] each token's experts; ids outside [0, E) contribute nothing.
    weights_tk: f32[t, k] their weights.
    weights: w_gate_EDF, w_up_EDF: [E, D, F]; w_down_EFD: [E, F, D] the experts' SwiGLU weights.
    options: `biases`: None, or the experts' (gate [E, F], up [E, F], down [E, D]) biases
      (gpt-oss); `act`: (gate, up) -> hidden, None: silu(gate) * up; `w8a8`: the stacks are
      e4m3 QArrays multiplied by e4m3 activations (`quant.w8a8_grouped_product`).

  Returns:
    [t, D] in x's dtype.
  """
  y_tD = _grouped_f32(x_tD, experts_tk, weights_tk, *weights, **options)
  return y_tD.astype(x_tD.dtype)


def dense_experts(
  x_tD, experts_tk, weights_tk, w_gate_EDF, w_up_EDF, w_down_EFD, *, biases=None, act=None
) -> Array:
  """The reference: every expert on every token, combined through a one-hot [t, E] matrix."""
  E = w_gate_EDF.shape[0]
  dtype = x_tD.dtype
  combine_tE = jnp.einsum(
    "tkE,tk->tE", jax.nn.one_hot(experts_tk, E, dtype=jnp.float32), weights_tk
  )  # ids outside [0, E) one-hot to zero rows
  gate_tEF = jnp.einsum("tD,EDF->tEF", x_tD, w_gate_EDF.astype(dtype))
  up_tEF = jnp.einsum("tD,EDF->tEF", x_tD, w_up_EDF.astype(dtype))
  if biases is not None:
    gate_tEF, up_tEF = gate_tEF + biases[0].astype(dtype), up_tEF + biases[1].astype(dtype)
  h_tEF = jax.nn.silu(gate_tEF) * up_tEF if act is None else act(gate_tEF, up_tEF)
  out_tED = jnp.einsum("tEF,EFD->tED", h_tEF, w_down_EFD.astype(dtype))
  if biases is not None:
    out_tED = out_tED + biases[2].astype(dtype)
  y_tD = jnp.einsum("tED,tE->tD", out_tED.astype(jnp.float32), combine_tE)
  return y_tD.astype(dtype)


def capacity(cfg: MoEConfig, tokens: int) -> int:
  """e: slots per expert for `tokens` tokens at `cfg.capacity_factor`."""
  return max(1, math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts))


def capacity_experts(
  x_tD,
  experts_tk,
  weights_tk,
  w_gate_EDF,
  w_up_EDF,
  w_down_EFD,
  *,
  slots: int,
  out_dtype=None,
  biases=None,
  act=None,
) -> tuple[Array, Array]:
  """GShard's fixed capacity: `slots` (e) tokens per expert, the rest dropped in token order.

  Returns:
    ([t, D] in `out_dtype` (default x's dtype), i32[] assignments dropped).
  """
  t, k = experts_tk.shape
  E, D, _ = w_gate_EDF.shape
  dtype = x_tD.dtype
  _, _, rank_a = _sorted(experts_tk, E)
  valid_a = _valid(experts_tk, E).reshape(-1)
  keep_a = valid_a & (rank_a < slots)
  # Each kept assignment's slot in the flattened [E * e] buffer; the dropped ones point past it.
  slot_a = jnp.where(keep_a, experts_tk.reshape(-1) * slots + rank_a, E * slots)
  x_aD = jnp.repeat(x_tD, k, axis=0)
  buffer_EeD = jnp.zeros((E * slots, D), dtype).at[slot_a].set(x_aD, mode="drop")
  buffer_EeD = buffer_EeD.reshape(E, slots, D)
  up = lambda x_EeD, w_EDF: jnp.einsum("EeD,EDF->EeF", x_EeD, w_EDF.astype(dtype))
  down = lambda h_EeF, w_EFD: jnp.einsum("EeF,EFD->EeD", h_EeF, w_EFD.astype(dtype))
  bias = None if biases is None else tuple(b[:, None] for b in biases)  # [E, 1, F or D]
  out_EeD = _swiglu(buffer_EeD, w_gate_EDF, w_up_EDF, w_down_EFD, up, down, bias=bias, act=act)
  out_aD = jnp.take(out_EeD.reshape(E * slots, D), slot_a, axis=0, mode="fill", fill_value=0)
  weights_tk = jnp.where(keep_a.reshape(t, k), weights_tk, 0.0)
  y_tD = _combine(out_aD.reshape(t, k, D), weights_tk).astype(out_dtype or dtype)
  return y_tD, jnp.sum(valid_a & ~keep_a, dtype=jnp.int32)


def _expert_parallel_local(
  x_tD,
  experts_tk,
  weights_tk,
  w_gate_EDF,
  w_up_EDF,
  w_down_EFD,
  biases,
  *,
  ep,
  tp,
  batch,
  slots,
  act,
):
  """One device's part of `expert_parallel` (inside its shard_map): f32[t, D] and its drops."""
  E_local = w_gate_EDF.shape[0]
  if ep is not None:
    x_tD = jax.lax.all_gather(x_tD, ep, axis=0, tiled=True)
    experts_tk = jax.lax.all_gather(experts_tk, ep, axis=0, tiled=True)
    weights_tk = jax.lax.all_gather(weights_tk, ep, axis=0, tiled=True)
    # This device's experts are [first, first + E_local): their ids become 0 .. E_local - 1,
    # every other id falls outside and contributes nothing here.
    experts_tk = experts_tk - jax.lax.axis_index(ep) * E_local
  w = (w_gate_EDF, w_up_EDF, w_down_EFD)
  biases = biases or None
  if biases is not None and tp is not None:
    # The down projection is a partial sum over the tensor shards: one shard adds its bias.
    first = (jax.lax.axis_index(tp) == 0).astype(biases[2].dtype)
    biases = (biases[0], biases[1], biases[2] * first)
  options = dict(biases=biases, act=act)
  if slots is None:
    y_tD = _grouped_f32(x_tD, experts_tk, weights_tk, *w, **options)
    dropped = jnp.zeros((), jnp.int32)
  else:
    y_tD, dropped = capacity_experts(
      x_tD,
      experts_tk,
      weights_tk,
      *w,
      slots=slots(x_tD.shape[0]),
      out_dtype=jnp.float32,
      **options,
    )
  if ep is not None:
    y_tD = jax.lax.psum_scatter(y_tD, ep, scatter_dimension=0, tiled=True)
  if tp is not None:
    # Each tensor shard computed a slice of every expert's width: its down projection is a
    # partial sum (the drop count is the same on every shard).
    y_tD = jax.lax.psum(y_tD, tp)
  return y_tD, (jax.lax.psum(dropped, batch) if batch else dropped)


def free_axes(mesh) -> tuple[str, ...]:
  """The mesh's axes of more than one device that are not already manual (inside a pipeline
  stage's shard_map, `stage` is): what `expert_parallel` can split over."""
  if mesh.empty:
    return ()
  manual = set(mesh.manual_axes)
  return tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)


def expert_parallel(mesh, *, slots: Callable[[int], int] | None = None) -> Callable:
  """The experts over a mesh: split over its `expert` axis, their width over `tensor`.

  The tokens are split over every other mesh axis (as the trainer splits the batch). Each
  expert-parallel group of devices gathers its tokens, each device runs its own experts on the
  assignments that chose them, and the partial sums return to the tokens' devices (see the module
  docstring).

  Args:
    mesh: the (abstract) mesh.
    slots: None for dropless (`grouped_experts` on each device); else a function from the
      tokens an expert-parallel group holds to each expert's capacity (`capacity_experts`, so the
      capacity is per group of devices).

  Returns:
    (x_tD, experts_tk, weights_tk, w_gate_EDF, w_up_EDF, w_down_EFD, *, biases=None, act=None)
    -> ([t, D], i32[] dropped).
  """

  free = free_axes(mesh)

  def axis(name: str, dim: int) -> str | None:
    """`name` if the mesh has it and it divides `dim`, else None (that dim stays whole)."""
    size = mesh.shape.get(name, 1)
    return name if size > 1 and dim % size == 0 else None

  def experts(
    x_tD, experts_tk, weights_tk, w_gate_EDF, w_up_EDF, w_down_EFD, *, biases=None, act=None
  ):
    E, _, F = w_gate_EDF.shape
    # The tokens split as the batch is (every axis but tensor), as far as their count divides.
    # Axes already manual (a pipeline stage's, inside its shard_map) are not this map's.
    batch, split = [], 1
    for name in free:
      if name != "tensor" and x_tD.shape[0] % (split * mesh.shape[name]) == 0:
        batch.append(name)
        split *= mesh.shape[name]
    batch = tuple(batch)
    ep = axis("expert", E) if "expert" in batch else None
    tp = axis("tensor", F)
    tokens, up = P(batch, None), P(ep, None, tp)
    bias_specs = () if biases is None else (P(ep, tp), P(ep, tp), P(ep, None))
    run = jax.shard_map(
      functools.partial(_expert_parallel_local, ep=ep, tp=tp, batch=batch, slots=slots, act=act),
      mesh=mesh,
      in_specs=(tokens, tokens, tokens, up, up, P(ep, tp, None), bias_specs),
      out_specs=(tokens, P()),
      axis_names=set(free),
    )
    y_tD, dropped = run(
      x_tD, experts_tk, weights_tk, w_gate_EDF, w_up_EDF, w_down_EFD, tuple(biases or ())
    )
    return y_tD.astype(x_tD.dtype), dropped

  return experts


# ---------------------------------------------------------------------------------------------
# The layer.


class MoE(nnx.Module):
  """A mixture-of-experts SwiGLU feed-forward layer: router, E routed experts, shared experts."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, ops: Ops = PLAIN):
    m = cfg.moe
    # `ops.w8a8`: kept e4m3 expert stacks multiply e4m3 activations (the dropless path on one
    # device; the others, and every other format, dequantize the stacks in the step).
    self.ops = ops  # static
    D, E, F = cfg.d_model, m.n_experts, m.expert_ffn_dim
    pdt = jnp.dtype(cfg.param_dtype)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.cfg = m
    self.router = param(normal(rngs, (D, E), std, jnp.float32), ("embed", "experts"))  # [D, E]
    self.router_bias = (  # [E] gpt-oss
      param(jnp.zeros((E,), jnp.float32), ("experts",), decay=False) if m.router_bias else None
    )
    self.score_bias = (
      RouterBias(jnp.zeros((E,), jnp.float32), logical_axes=("experts",))  # [E]
      if m.topk_method == "noaux_tc"
      else None
    )
    expert_in = ("experts", "embed", "expert_mlp")
    self.w_gate = param(normal(rngs, (E, D, F), std, pdt), expert_in)  # [E, D, F]
    self.w_up = param(normal(rngs, (E, D, F), std, pdt), expert_in)  # [E, D, F]
    self.w_down = param(
      normal(rngs, (E, F, D), out_std, pdt), ("experts", "expert_mlp", "embed")
    )  # [E, F, D]
    if m.expert_bias:  # gpt-oss: [E, F], [E, F], [E, D]
      bias = lambda *shape_axes: param(
        jnp.zeros(tuple(n for n, _ in shape_axes), pdt),
        tuple(a for _, a in shape_axes),
        decay=False,
      )
      self.b_gate = bias((E, "experts"), (F, "expert_mlp"))
      self.b_up = bias((E, "experts"), (F, "expert_mlp"))
      self.b_down = bias((E, "experts"), (D, "embed"))
    else:
      self.b_gate = self.b_up = self.b_down = None
    self.shared = (
      MLP(D, m.shared_ffn_dim, init_std=std, out_std=out_std, rngs=rngs, param_dtype=pdt)
      if m.shared_ffn_dim
      else None
    )
    self.shared_gate = (
      param(normal(rngs, (D,), std, pdt), ("embed",)) if m.shared_expert_gate else None
    )  # [D]

  def __call__(self, x_BTD: Array, *, dropless: bool = False) -> tuple[Array, RouterStats]:
    """([B, T, D] output, this call's router stats). `dropless` ignores the capacity factor
    (calls with a cache)."""
    B, T, D = x_BTD.shape
    dtype = x_BTD.dtype
    x_tD = x_BTD.reshape(B * T, D)
    # The router in float32: its logits choose the experts, and bf16 rounding would flip
    # near-ties.
    logits_tE = jnp.einsum("tD,DE->tE", x_tD.astype(jnp.float32), self.router[...])
    if self.router_bias is not None:
      logits_tE = logits_tE + self.router_bias[...]
    bias_E = None if self.score_bias is None else self.score_bias[...]
    experts_tk, weights_tk, probs_tE = route(logits_tE, self.cfg, bias_E)
    mesh = jax.sharding.get_abstract_mesh()
    capped = self.cfg.capacity_factor is not None and not dropless
    stacks = (self.w_gate[...], self.w_up[...], self.w_down[...])
    w8a8 = self.ops.w8a8 and not free_axes(mesh) and not capped and all(map(w8a8_experts, stacks))
    # Other quantized experts (`atlas_jax.quant`) are dequantized here, inside the step.
    weights = stacks if w8a8 else tuple(dequantized(w) for w in stacks)
    options = {"w8a8": True} if w8a8 else {}
    if self.b_gate is not None:
      options["biases"] = tuple(b[...] for b in (self.b_gate, self.b_up, self.b_down))
    if self.cfg.swiglu_limit is not None:
      limit, alpha = self.cfg.swiglu_limit, self.cfg.swiglu_alpha
      options["act"] = functools.partial(clamped_swiglu, limit=limit, alpha=alpha)
    dropped = jnp.zeros((), jnp.int32)
    if free_axes(mesh):
      slots = (lambda tokens: capacity(self.cfg, tokens)) if capped else None
      y_tD, dropped = expert_parallel(mesh, slots=slots)(
        x_tD, experts_tk, weights_tk, *weights, **options
      )
    elif capped:
      slots = capacity(self.cfg, B * T)
      y_tD, dropped = capacity_experts(
        x_tD, experts_tk, weights_tk, *weights, slots=slots, **options
      )
    else:
      y_tD = grouped_experts(x_tD, experts_tk, weights_tk, *weights, **options)
    if self.shared is not None:
      shared_tD = self.shared(x_tD[None])[0]
      if self.shared_gate is not None:
        gate_t1 = jax.nn.sigmoid(x_tD @ self.shared_gate[...].astype(dtype))[:, None]
        shared_tD = gate_t1 * shared_tD
      y_tD = y_tD + shared_tD
    stats = router_stats(logits_tE, experts_tk, probs_tE, dropped)
    return y_tD.reshape(B, T, D), stats
