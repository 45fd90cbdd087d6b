"""The decoder-only transformer for every supported family.

One model: Llama-style GQA attention (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2/3-MoE, OLMoE)
or DeepSeek's Multi-head Latent Attention (`cfg.mla`), SwiGLU MLPs or mixture-of-experts layers
(`cfg.moe`, `atlas_jax.model.moe`), and optional multi-token-prediction heads (`cfg.mtp`). The
attention class is chosen once from the config; everything else is shared.

Layers are stored stacked (every block parameter has a leading [L] axis) and run under
`jax.lax.scan` (`atlas_jax.model.scan`), with the training-time remat policy applied to it. A
model whose layers are not all alike (DeepSeek's dense first layers, then MoE ones; Qwen-MoE's
`mlp_only_layers`) keeps one stack per kind, `blocks` (the MoE layers, or every layer of a dense
model) and `dense_blocks` (the dense layers of an MoE model, else None), and runs its layers as
`runs`: maximal runs of consecutive identical layers, in order, each a scan over a contiguous
slice of one stack (`ModelConfig.layer_runs`). Every cache keeps one layer axis for all L layers
in layer order, so each run reads and writes its own layers' slots and the cache protocol is the
same whatever the runs.

In training, a pipeline of stages (`pipeline`) can run the `blocks` stack instead of its scan:
the stages split that stack's stacked `layers` axis. An MoE model's dense layers must then all
come first (`atlas_jax.config.check_pipeline`, as DeepSeek's `first_k_dense_replace` has them);
their stack's axis is `dense_layers`, which no stage splits, and they run before the pipeline
with the rows split over every batch axis, `stage` included (the pipeline then gathers their
output over the stages, as it gathers the token ids when it starts at the embedding). Stages cut
at arbitrary points of interleaved runs would each run a different program, which one SPMD
pipeline cannot.

The model builds its own caches (`init_cache`, `init_pool`), and takes any cache that follows
`atlas_jax.cache.protocol`, so callers never branch on the family or the cache kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from atlas_jax import platforms
from atlas_jax.cache.contiguous import KVCache, LatentCache
from atlas_jax.cache.paged import HybridPool, KVPool, LatentPool
from atlas_jax.cache.protocol import Cache
from atlas_jax.config import LoRAConfig, ModelConfig
from atlas_jax.model import lora as lora_lib
from atlas_jax.model.attention import Attention, layer_kinds
from atlas_jax.model.block import Block, attention_class
from atlas_jax.model.layers import Ops, RMSNorm, normal, param
from atlas_jax.model.moe import RouterStats
from atlas_jax.model.mtp import MTPHeads
from atlas_jax.model.scan import (
  is_unstacked,
  is_unstacked_leaf,
  layer_count,
  run_unstacked,
  scan_layers,
  stacked,
)
from atlas_jax.quant import dequantized
from atlas_jax.schedule import layer_order as pipeline_layer_order

Array = jax.Array


def default_positions(tokens_BT: Array, cache: Cache | None) -> Array:
  """i32[B, T]: 0..T-1, or continuing from each sequence's cache length."""
  B, T = tokens_BT.shape
  start_B = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
  return start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


class Transformer(nnx.Module):
  """The decoder.

  Args:
    cfg: the architecture.
    rngs: parameter initialisation.
    implementation: attention implementation for `atlas_jax.kernels` (None: best available).
    remat, remat_every: training-time activation checkpointing (`atlas_jax.model.scan`).
    unroll_layers: unroll the layer scan (`train.scan_layers: false`; XLA's cost analysis also
      counts an unrolled stack whole, where it prices a loop body once).
    lora: LoRA adapters on every block's targeted projections (`atlas_jax.model.lora`).
    pipeline: runs the uncached `blocks` stack instead of its scan, called as
      `pipeline(step, carry, block_state, rows, policy=, every=, unroll=)` with
      `step(carry, layer_state, rows) -> (carry, router stats or None)` and returning (carry,
      each layer's stats on each of its U micro-batches, [L, U, ...], or None), and lays out the
      token ids the embedding reads (`pipeline.gather(tokens_BT)`): pipeline stages over a mesh
      (`atlas_jax.training.pipeline.Pipeline`). None: one scan.
    ops: how the model spells out the computations some compilers run badly (`layers.Ops`);
      None: as `atlas_jax.platforms.model_ops` says for the default backend.
  """

  def __init__(
    self,
    cfg: ModelConfig,
    *,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    remat: str = "none",
    remat_every: int | None = None,
    unroll_layers: bool = False,
    lora: LoRAConfig | None = None,
    pipeline: Callable | None = None,
    ops: Ops | None = None,
  ):
    V, D = cfg.vocab_size, cfg.d_model
    ops = Ops(**platforms.model_ops(jax.default_backend())) if ops is None else ops
    adapters = lora_lib.resolve(cfg, lora)
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.remat = (remat, remat_every, unroll_layers)  # static
    self.pipeline = pipeline  # static

    def block_factory(sparse: bool):
      return lambda r: Block(
        cfg, rngs=r, implementation=implementation, sparse=sparse, adapters=adapters, ops=ops
      )

    self.embed = param(normal(rngs, (V, D), cfg.init_std, pdt), ("vocab", "embed"))  # [V, D]
    sparse_L = cfg.sparse_layers()
    main = any(sparse_L)  # the kind `blocks` holds: MoE layers when there are any
    n_dense = sparse_L.count(False)
    # Every parameter [L_kind, ...]: the layers of that kind, in layer order.
    self.blocks = stacked(block_factory(main), sparse_L.count(main), rngs)
    # The dense layers' stack has its own axis name: pipeline stages split only `blocks`.
    self.dense_blocks = (
      stacked(block_factory(False), n_dense, rngs, axis="dense_layers")
      if main and n_dense
      else None
    )
    # Static: (stack name, first index in the stack, layers, first layer) per run.
    stacks, runs, first = layer_stacks(cfg), [], 0
    for _, n in cfg.layer_runs():
      runs.append((*stacks[first], n, first))
      first += n
    self.runs = tuple(runs)
    # Static: each layer's attention kind, i32[L, 2] (`attention.layer_kinds`), where they differ.
    kinds = cfg.attention_kinds()[0]
    self.kinds_L = None if len(kinds) == 1 else tuple(map(tuple, layer_kinds(cfg).tolist()))
    self.final_norm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=pdt)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else param(normal(rngs, (D, V), cfg.init_std, pdt), ("embed", "vocab"))  # [D, V]
    )
    # MTP modules count on past the trunk's layers (DeepSeek-V3's is an MoE layer).
    mtp_sparse = cfg.moe is not None and cfg.moe.is_sparse(cfg.n_layers)
    self.mtp = (
      None if cfg.mtp is None else MTPHeads(cfg, block_factory(mtp_sparse), rngs=rngs)
    )  # [J, ...]

  # -- caches ------------------------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache | LatentCache:
    """A zeroed contiguous cache of `max_len` slots per sequence (KV, or MLA latents)."""
    cfg, attn = self.cfg, attention_class(self.cfg)
    return attn.cache_type.init(
      n_layers=cfg.n_layers,
      batch=batch,
      max_len=max_len,
      dtype=jnp.dtype(cfg.dtype if dtype is None else dtype),
      **attn.cache_dims(cfg),
    )

  def init_pool(
    self, n_blocks: int, block_size: int, dtype=None, *, n_window_blocks: int | None = None
  ) -> KVPool | LatentPool | HybridPool:
    """A zeroed paged pool of `n_blocks` blocks of `block_size` tokens (KV, or MLA latents).

    With `n_window_blocks`, for a model mixing sliding-window and full-attention layers: a
    `HybridPool`, the windowed layers' blocks (that many) apart from the others' (`n_blocks`).
    Wrap it with a block table and lengths in `atlas_jax.cache.paged.PagedCache` (a hybrid
    pool's windowed layers' table as its `window_table`) to call the model on it.
    """
    cfg, attn = self.cfg, attention_class(self.cfg)
    dims = dict(
      block_size=block_size,
      dtype=jnp.dtype(cfg.dtype if dtype is None else dtype),
      **attn.cache_dims(cfg),
    )
    if n_window_blocks is not None:
      if attn.pool_type is not KVPool:
        raise ValueError("init_pool: n_window_blocks is for KV pools; MLA has no sliding window")
      return HybridPool.init(
        windowed_layers(cfg), n_blocks=n_blocks, n_window_blocks=n_window_blocks, **dims
      )
    return attn.pool_type.init(n_layers=cfg.n_layers, n_blocks=n_blocks, **dims)

  # -- forward -----------------------------------------------------------------------------------

  def _kinds(self, first: int, n: int, order=None):
    """The run's layers' kinds, i32[n, 2] (in `order` within it), or None when all are alike."""
    if self.kinds_L is None:
      return None
    kinds = np.asarray(self.kinds_L[first : first + n], np.int32)
    return jnp.asarray(kinds if order is None else kinds[order])

  def _static_kinds(self, first: int, n: int):
    """The run's layers' kinds as tuples of ints, for layers the program holds one by one: each
    then calls its own window's kernel, with no switch."""
    return None if self.kinds_L is None else self.kinds_L[first : first + n]

  def _head_DV(self) -> Array:
    return self.embed[...].T if self.lm_head is None else dequantized(self.lm_head[...])

  def output_head(self) -> dict[str, Array]:
    """The output head as stored, for losses that apply it themselves
    (`atlas_jax.training.loss.chunked_cross_entropy`): {"head_DV": [D, V]}, or with tied
    embeddings {"embed_VD": [V, D]}, so no transpose of the table is ever made."""
    cap = {"soft_cap": self.cfg.final_logit_softcapping} if self.cfg.final_logit_softcapping else {}
    if self.lm_head is None:
      return {"embed_VD": self.embed[...], **cap}
    return {"head_DV": self.lm_head[...], **cap}

  def hidden_states(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
  ) -> Array:
    """The final normalised hidden state [B, T, D] (compute dtype): the logits before the head."""
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT, None)
    return self._trunk(tokens_BT, positions_BT, segment_ids_BT, None)[1]

  def _logits(self, h_BTD: Array, *, flat: bool = False) -> Array:
    """f32[B, T, V]. `flat` (training): one [B x T, D] x [D, V] matmul, whose backward takes
    the head's weight gradient from dlogits as they lie (the 3-D einsum's made a transposed copy
    of them first). Serving keeps the einsum: over a vocabulary-parallel head the partitioner
    gathers its [B, V] logits, where for the 2-D form it gathered the whole head."""
    head_DV = self._head_DV().astype(h_BTD.dtype)
    if not flat:
      logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, head_DV, preferred_element_type=jnp.float32)
    else:
      B, T, D = h_BTD.shape
      logits_MV = jnp.dot(h_BTD.reshape(B * T, D), head_DV, preferred_element_type=jnp.float32)
      logits_BTV = logits_MV.reshape(B, T, -1)
    return soft_cap(logits_BTV, self.cfg.final_logit_softcapping)

  def _runs(self):
    """(graphdef, the run's slice of its stack's state, first layer) per run, in order."""
    stacks = {"blocks": nnx.split(self.blocks)}
    if self.dense_blocks is not None:
      stacks["dense_blocks"] = nnx.split(self.dense_blocks)
    for name, start, n, first in self.runs:
      graphdef, state = stacks[name]
      if n != layer_count(state):
        state = jax.tree.map(
          lambda a, start=start, n=n: a[start : start + n], state, is_leaf=is_unstacked_leaf
        )
      yield graphdef, state, first

  def _trunk(self, tokens_BT, positions_BT, segment_ids_BT, cache, *, keep_trunk=False):
    """Runs the layers: (input to the last block or None, final normalised hidden, new cache,
    router stats of the MoE layers stacked [L_moe, ...] in `blocks` order, or None).

    `keep_trunk` carries each block's input through the scan, for the parallel MTP heads.
    """
    dtype = jnp.dtype(self.cfg.dtype)
    pipelined = self.pipeline is not None and cache is None
    if pipelined and self.runs[0][0] == "blocks":
      # The pipeline starts at the embedding: every stage embeds all of its data shard's rows,
      # which the first stage needs (`pipeline.gather`). After dense layers, the pipeline
      # gathers their output instead.
      tokens_BT = self.pipeline.gather(tokens_BT)
    x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)
    if self.cfg.scale_embeddings:  # Gemma: by sqrt(D), rounded to the compute dtype
      x_BTD = x_BTD * jnp.asarray(self.cfg.d_model**0.5, dtype)
    trunk_BTD = x_BTD if keep_trunk else None
    storage = None if cache is None else cache.layers
    stats = []
    for (name, *_), (graphdef, state, first) in zip(self.runs, self._runs(), strict=True):
      if cache is None:
        (x_BTD, trunk_BTD), ys = self._uncached_run(
          graphdef,
          state,
          first,
          (x_BTD, trunk_BTD),
          positions_BT,
          segment_ids_BT,
          keep_trunk,
          pipelined=pipelined and name == "blocks",
        )
      else:
        (x_BTD, trunk_BTD, storage), ys = self._cached_run(
          graphdef, state, first, (x_BTD, trunk_BTD, storage), positions_BT, cache, keep_trunk
        )
      if ys is not None:
        stats.append(ys)
    stats = jax.tree.map(lambda *a: jnp.concatenate(a), *stats) if stats else None
    new_cache = None if cache is None else cache.advance(storage, positions_BT)
    return trunk_BTD, self.final_norm(x_BTD), new_cache, stats

  def _uncached_run(
    self,
    graphdef,
    state,
    first,
    carry,
    positions_BT,
    segment_ids_BT,
    keep_trunk,
    *,
    pipelined=False,
  ):
    """One run's layer scan without a cache, or the pipeline's stages when `pipelined`:
    ((x, the last block's input or None), router stats [L_run, ...] or None)."""

    # Positions and segment ids go in as `rows`, so a pipeline can hand each block its
    # micro-batch's. A layer is its state and its attention kind (None: all alike).
    def step(carry, layer, rows):
      state, kind = layer
      positions_BT, segment_ids_BT = rows
      x_BTD, _ = carry
      y_BTD, _, stats = nnx.merge(graphdef, state)(
        x_BTD, positions_BT, segment_ids_BT=segment_ids_BT, kind=kind
      )
      return (y_BTD, x_BTD if keep_trunk else None), stats

    policy, every, unroll = self.remat
    rows = (positions_BT, segment_ids_BT)
    remat = dict(policy=policy, every=every, unroll=unroll)
    n = layer_count(state)
    if is_unstacked(state):  # a served model's layers, one array each: a loop, no slices
      kinds = self._static_kinds(first, n)
      extra = [None] * n if kinds is None else list(kinds)
      return run_unstacked(lambda c, layer: step(c, layer, rows), carry, state, extra)
    if not pipelined:
      xs = (state, self._kinds(first, n))
      return scan_layers(lambda c, layer: step(c, layer, rows), carry, xs, **remat)
    # The pipeline's stacked layers are stored in its order (`pipeline.layer_order`).
    schedule = self.pipeline.schedule
    order = pipeline_layer_order(n, (schedule.stages, schedule.repeats))
    xs = (state, self._kinds(first, n, order))
    carry, stats_LU = self.pipeline(step, carry, xs, rows, **remat)
    # Each layer ran once per pipeline micro-batch: [L, U, ...] stats, merged per layer.
    return carry, None if stats_LU is None else stats_LU.merge_calls()

  def _cached_run(self, graphdef, state, first, carry, positions_BT, cache: Cache, keep_trunk):
    """One run's layer scan over a cache: its storage is carried whole, each layer writing and
    reading its own slice in place (`atlas_jax.cache.protocol`)."""

    def step(carry, layer):
      x_BTD, _, storage = carry
      state, (index, kind) = layer
      view = cache.layer(storage, index, positions_BT)
      y_BTD, view, stats = nnx.merge(graphdef, state)(x_BTD, positions_BT, cache=view, kind=kind)
      return (y_BTD, x_BTD if keep_trunk else None, view.storage), stats

    n = layer_count(state)
    kinds = self._kinds(first, n)
    if is_unstacked(state):  # a served model's layers, one array each (`unstack_layers`)
      # The layer index stays opaque to XLA: a constant one would turn the pool's per-layer
      # gather into a copy of the whole layer's pool, then a gather from it.
      index = lambda i: jax.lax.optimization_barrier(jnp.int32(first + i))
      static = self._static_kinds(first, n)
      extra = [(index(i), None if static is None else static[i]) for i in range(n)]
      return run_unstacked(step, carry, state, extra)
    if n == 1:  # one layer: no loop around it
      kind = None if kinds is None else self._static_kinds(first, 1)[0]
      carry, ys = step(carry, (jax.tree.map(lambda a: a[0], state), (jnp.int32(first), kind)))
      return carry, jax.tree.map(lambda y: y[None], ys)
    unroll = self.remat[2]  # `unroll_layers`: XLA's cost analysis then counts every layer
    xs = (state, (first + jnp.arange(n, dtype=jnp.int32), kinds))
    return jax.lax.scan(step, carry, xs, unroll=unroll)

  def __call__(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
    cache: Cache | None = None,
    logits_at_B: Array | None = None,
    return_hidden: bool = False,
  ):
    """Next-token logits.

    Args:
      tokens_BT: i32[B, T].
      positions_BT: i32[B, T]; default 0..T-1, or continuing from `cache.lengths`. With a paged
        cache, negative positions mark padding tokens (not written, not counted).
      segment_ids_BT: i32[B, T] document ids of packed sequences (no cache).
      cache: any cache from `init_cache`, or a `PagedCache` over `init_pool`'s pool; the
        tokens are appended to each sequence.
      logits_at_B: i32[B]; compute logits only at this index of each row (then T = 1 in the
        result): prefill needs only each prompt's last position.
      return_hidden: also return (the final normalised hidden state [B, T, D], the last block's
        input [B, T, D]) at every position: what multi-token-prediction heads draft from.

    Returns:
      f32[B, T, V] logits; with a cache, (logits, cache) where each row's length grew by the
      tokens it added; with return_hidden, the hidden states are appended to either.
    """
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT, cache)
    trunk_BTD, h_BTD, new_cache, _ = self._trunk(
      tokens_BT, positions_BT, segment_ids_BT, cache, keep_trunk=return_hidden
    )
    hidden = (h_BTD, trunk_BTD)
    if logits_at_B is not None:
      # Only the rows' chosen positions reach the head: [B, 1, V] logits, not [B, T, V].
      at_BJ = logits_at_B[:, None] if logits_at_B.ndim == 1 else logits_at_B
      h_BTD = jnp.take_along_axis(h_BTD, at_BJ[:, :, None], axis=1)
    logits_BTV = self._logits(h_BTD)
    out = (logits_BTV,) if cache is None else (logits_BTV, new_cache)
    out += (hidden,) if return_hidden else ()
    return out[0] if len(out) == 1 else out

  def forward_train(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
    hidden: bool = False,
  ) -> TrainOutputs:
    """Everything a training objective reads, from one pass: the next-token logits, the MTP
    heads' logits when the model has heads, the MoE layers' router stats when it has any.

    MTP head j (1-based) at position t predicts token t + 1 + j. With `hidden`, the normalised
    hidden states before the shared head instead of logits ([B, T, D], [J, B, T, D]), for a loss
    that applies the head itself (`output_head`).
    """
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT, None)
    # Parallel heads read the input of the last block; sequential ones the final hidden state.
    keep_trunk = self.mtp is not None and self.mtp.kind == "parallel"
    trunk_BTD, h_BTD, _, stats = self._trunk(
      tokens_BT, positions_BT, segment_ids_BT, None, keep_trunk=keep_trunk
    )
    mtp_JBT_ = None
    if self.mtp is not None:
      mtp_JBT_ = self.mtp(
        tokens_BT=tokens_BT,
        trunk_BTD=trunk_BTD,
        final_BTD=h_BTD,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        embed_VD=self.embed[...],
        head_DV=None if hidden else self._head_DV(),
      )
    return TrainOutputs(h_BTD if hidden else self._logits(h_BTD, flat=True), mtp_JBT_, stats)

  def forward_mtp(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
    hidden: bool = False,
  ) -> tuple[Array, Array]:
    """(next-token logits f32[B, T, V], MTP logits f32[J, B, T, V]): `forward_train`'s two
    outputs (with `hidden`, the hidden states [B, T, D], [J, B, T, D])."""
    if self.mtp is None:
      raise ValueError("forward_mtp: the model has no MTP heads (model.mtp is null)")
    out = self.forward_train(
      tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, hidden=hidden
    )
    return out.main, out.mtp


@struct.dataclass
class TrainOutputs:
  """`Transformer.forward_train`'s result."""

  main: Array  # f32[B, T, V] next-token logits, or [B, T, D] final hidden states
  mtp: Array | None  # f32[J, B, T, V] MTP logits, or [J, B, T, D]; None without heads
  router: RouterStats | None  # every field with a leading [L_moe] axis; None when dense


def soft_cap(logits: Array, cap: float | None) -> Array:
  """Gemma's logit capping, cap * tanh(logits / cap); `logits` unchanged for None."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def windowed_layers(cfg: ModelConfig) -> tuple[bool, ...]:
  """Per layer: whether it reads only a bounded run of recent positions, a sliding window or its
  chunk (`AttentionKind.reach`; `ModelConfig.attention_kinds`)."""
  kinds, index_L = cfg.attention_kinds()
  return tuple(kinds[i].reach is not None for i in index_L)


def with_longrope_frequencies(model: Transformer, max_len: int) -> tuple[Transformer, str | None]:
  """(the model with LongRoPE's frequency set fixed for contexts of `max_len` tokens, that set).

  The long set when `max_len` passes `original_max_position_embeddings`, else the short one
  (vLLM's rule for a server); the same model and None without LongRoPE or with a set already
  fixed. Attention modules hold their RoPEs as static fields, so the fixed model is a copy (its
  arrays shared) whose attentions hold RoPEs of the fixed config; the caller's model is unchanged.
  """
  s = model.cfg.rope_scaling
  if s is None or s.type != "longrope" or s.longrope_frequencies != "dynamic":
    return model, None
  which = "long" if max_len > s.original_max_position_embeddings else "short"
  fixed_scaling = dataclasses.replace(s, longrope_frequencies=which)
  fixed = nnx.merge(*nnx.split(model))
  fixed.cfg = dataclasses.replace(model.cfg, rope_scaling=fixed_scaling)
  for _, node in nnx.iter_graph(fixed):
    if isinstance(node, Attention):  # every layer kind whose RoPE carries the model's LongRoPE
      node.ropes = tuple(
        dataclasses.replace(r, scaling=fixed_scaling) if r.scaling == s else r for r in node.ropes
      )
  return fixed, which


def layer_stacks(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
  """(stack, index in it) of each layer: "blocks" holds the MoE layers (every layer of a dense
  model), "dense_blocks" the dense layers of a model that also has MoE ones."""
  sparse_L = cfg.sparse_layers()
  main = any(sparse_L)
  seen = {True: 0, False: 0}
  out = []
  for sparse in sparse_L:
    out.append(("blocks" if sparse == main else "dense_blocks", seen[sparse]))
    seen[sparse] += 1
  return tuple(out)


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, **kwargs) -> Transformer:
  """The model for `cfg` (any supported family). `kwargs` go to `Transformer`."""
  return Transformer(cfg, rngs=rngs, **kwargs)
