"""The pure training step: (state, batch) -> (state, metrics), jitted with the state donated.

One function covers every configuration: gradient accumulation over micro-batches (a `lax.scan`
inside the step), precision policies (float32 master weights, bf16/fp16 compute, dynamic loss
scaling for fp16), remat policies (in the model's layer scan), ZeRO/TP/EP sharding (the jit's
in/out shardings plus a constraint on the gradients; the mesh is in context while the model is
traced, so mixture-of-experts layers run their experts expert-parallel), pipeline stages (the
model's layers run by `atlas_jax.training.pipeline`, each accumulation micro-batch split again
into the pipeline's), and mixture-of-experts load balancing (`atlas_jax.training.experts`: the aux
and z losses in the objective, the selection-bias update after the optimizer's).

The gradient and the optimizer see only what trains (`split_trainable`): the model's
`nnx.Param`s, or with LoRA (train.lora) the adapters alone. The rest (the routers' selection
biases; with LoRA the frozen base weights, held quantized with train.base_quantization: QLoRA)
is carried in `TrainState.params` beside them, passed through the step untouched, and saved
with them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from atlas_jax import platforms, quant
from atlas_jax.config import Config, check_context, check_pipeline
from atlas_jax.model import Transformer, build, context_parallel
from atlas_jax.model.layers import Ops
from atlas_jax.model.lora import LoRAParam
from atlas_jax.schedule import Schedule
from atlas_jax.training import pipeline
from atlas_jax.training import sharding as shd
from atlas_jax.training.experts import COUNTS, load_metrics, router_terms, update_router_bias
from atlas_jax.training.loss import chunked_cross_entropy, cross_entropy
from atlas_jax.training.optimizer import learning_rate_schedule, make_optimizer
from atlas_jax.training.precision import LossScale, training_model_config

Array = jax.Array


@struct.dataclass
class TrainState:
  params: Any  # nnx.State of the model: its Params (float32 master weights; adapters included;
  # QLoRA's base projections as QArrays) and other variables
  opt_state: Any  # optax state for what trains (`split_trainable`)
  step: Array  # i32[] steps run (skipped ones included: the data position)
  first_nonfinite: (
    Array  # i32[] first step (1-based) whose loss or gradients were not finite; 0: none
  )
  loss_scale: LossScale | None = None  # fp16 only


def build_model(
  cfg: Config,
  key: Array | None = None,
  pipe: pipeline.Pipeline | None = None,
  *,
  base: Any = None,
) -> Transformer:
  """The model this run trains (random init from `key`; abstract when called under eval_shape),
  its layers run by `pipe` where the mesh has stages.

  `base`: a pure dict of pretrained weights (no adapters) that replace the random ones (whose
  draws XLA then drops as dead code). With train.base_quantization (QLoRA) the base's
  projections are then quantized (`quantize_base`).
  """
  ops = None
  if cfg.train.fp8 is not None:
    ops = Ops(**platforms.model_ops(jax.default_backend()), fp8=cfg.train.fp8)
  model = build(
    training_model_config(cfg.model, cfg.train.precision),
    rngs=nnx.Rngs(0 if key is None else key),
    implementation=cfg.attention.implementation,
    remat=cfg.train.remat,
    remat_every=cfg.train.remat_every,
    unroll_layers=not cfg.train.scan_layers,
    lora=cfg.train.lora,
    pipeline=pipe,
    ops=ops,
  )
  if base is not None:
    rest = nnx.state(model, nnx.Not(LoRAParam))
    nnx.replace_by_pure_dict(rest, base)
    nnx.update(model, rest)
  quantize_base(cfg, model)
  return model


def quantize_base(cfg: Config, model: Transformer) -> list[str]:
  """QLoRA (train.base_quantization): the frozen base's projections replaced, in place, by
  qwix QArrays (`atlas_jax.quant`: the 8- or 4-bit values and their float32 scales), which the
  matmuls dequantize as they multiply. The embeddings, norms, LM head and the adapters stay
  float32. Returns the dotted paths quantized (none without train.base_quantization)."""
  t = cfg.train
  if t.base_quantization is None:
    return []
  group = t.base_quantization_group_size
  return quant.quantize_model(
    model, t.base_quantization, group_size=group, field="train.base_quantization"
  )


def split_trainable(cfg: Config, params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(what the gradient and the optimizer see, the rest): the model's Params, or with LoRA its
  adapters alone. The rest holds every other variable (the routers' selection biases) and, with
  LoRA, the frozen base weights."""
  return nnx.split_state(params, LoRAParam if cfg.train.lora is not None else nnx.Param, ...)


def init_state(
  cfg: Config, optimizer: optax.GradientTransformation, key: Array, base: Any = None
) -> TrainState:
  """A fresh training state: the model initialised from `key`, the optimizer's zero state.

  `base`: a pure dict of pretrained weights (no adapters) that replace the random ones
  (`build_model`); adapters are drawn from `key`.
  """
  params = nnx.state(build_model(cfg, key, base=base))
  scale = LossScale.create(cfg.train.loss_scale) if cfg.train.precision == "fp16" else None
  zero = jnp.zeros((), jnp.int32)
  trainable, _ = split_trainable(cfg, params)
  return TrainState(params, optimizer.init(trainable), zero, zero, scale)


@dataclasses.dataclass(frozen=True)
class Trainer:
  """Everything static about a run: the model graph, optimizer, mesh and shardings."""

  cfg: Config
  graphdef: nnx.GraphDef
  optimizer: optax.GradientTransformation
  mesh: Mesh
  state_shardings: TrainState
  grad_shardings: Any
  # (stages, repeats) the stacked layers are stored for (`pipeline.layer_order`); (1, 1): depth.
  layout: pipeline.Layout = (1, 1)

  def init(self, key: Array, base: Any = None) -> TrainState:
    """Initialises model and optimizer under jit straight into their shardings (the same model
    whatever the mesh: drawn in depth order, then stored in this run's layer order).

    `base`: pretrained weights in depth order (a pure dict of arrays already laid out in their
    shardings, `atlas_jax.hf.init_from`), donated: the state takes their buffers.
    """

    def init(key, base=None):
      state = init_state(self.cfg, self.optimizer, key, base)
      return pipeline.reorder_layers(state, (1, 1), self.layout)

    if base is None:
      return jax.jit(init, out_shardings=self.state_shardings)(key)
    return jax.jit(init, out_shardings=self.state_shardings, donate_argnums=1)(key, base)

  def abstract_state(self) -> TrainState:
    return jax.eval_shape(
      functools.partial(init_state, self.cfg, self.optimizer), jax.random.key(0)
    )

  def checkpoint_meta(self, step: int) -> dict[str, Any]:
    """What a checkpoint of `step` records beside the state: the data position and the order
    its stacked layers are stored in."""
    return {"step": step, "data_index": step, "layer_layout": list(self.layout)}

  def restored(self, state: TrainState, meta: dict[str, Any]) -> TrainState:
    """A restored state in this run's layer order, whatever the order it was saved in."""
    saved = tuple(meta.get("layer_layout", (1, 1)))
    if saved == self.layout:
      return state
    move = functools.partial(pipeline.reorder_layers, src=saved, dst=self.layout)
    return jax.jit(move, out_shardings=self.state_shardings, donate_argnums=0)(state)


def make_trainer(cfg: Config, mesh: Mesh | None = None) -> Trainer:
  mesh = shd.make_mesh(cfg.mesh) if mesh is None else mesh
  stages = mesh.shape["stage"]
  check_pipeline(cfg.model, cfg.train, stages=stages, batch_shards=shd.data_parallel_size(mesh))
  if mesh.shape["context"] > 1:  # the sizes -1 left open, now known
    sizes = dict(context=mesh.shape["context"], stage=stages, fsdp=mesh.shape["fsdp"])
    check_context(cfg.model, cfg.train, dataclasses.replace(cfg.mesh, **sizes))
  pipe, layout = None, (1, 1)
  if stages > 1:
    t = cfg.train
    pipe = pipeline.Pipeline(mesh, Schedule(stages, t.pipeline_microbatches, t.pipeline_repeats))
    layout = (stages, t.pipeline_repeats)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(cfg, pipe=pipe)))
  optimizer = make_optimizer(cfg.train)
  abstract = jax.eval_shape(functools.partial(init_state, cfg, optimizer), jax.random.key(0))
  shd.check_declared(abstract.params)
  rules = shd.strategy_rules(cfg.train.sharding)
  rep = shd.replicated(mesh)
  state_shardings = TrainState(
    params=shd.tree_shardings(abstract.params, mesh, rules["params"]),
    opt_state=shd.tree_shardings(abstract.opt_state, mesh, rules["opt_state"]),
    step=rep,
    first_nonfinite=rep,
    loss_scale=None
    if abstract.loss_scale is None
    else jax.tree.map(lambda _: rep, abstract.loss_scale),
  )
  trainable, _ = split_trainable(cfg, abstract.params)
  grad_shardings = shd.tree_shardings(trainable, mesh, rules["grads"])
  return Trainer(cfg, graphdef, optimizer, mesh, state_shardings, grad_shardings, layout)


def loss_fn(
  graphdef: nnx.GraphDef,
  params,
  batch: dict[str, Array],
  *,
  z_loss: float = 0.0,
  loss_chunk: int = 0,
  moe_aux_loss: float = 0.0,
  moe_z_loss: float = 0.0,
) -> tuple[Array, dict]:
  """Cross-entropy of the model on batch["tokens"] i32[B, T + 1] (inputs and shifted targets),
  plus the routers' balance and z losses for mixture-of-experts models.

  Optional batch entries, all [B, T] for the inputs: "positions", "segment_ids", "loss_mask".
  `loss_chunk` > 0: the chunked cross-entropy over that many positions at a time (the LM head
  applied inside it; the same loss and gradients without the [B, T, V] float32 logits).
  """
  tokens_BT1 = batch["tokens"]
  inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
  positions_BT, segment_ids_BT = batch.get("positions"), batch.get("segment_ids")
  mask_BT = batch.get("loss_mask")
  if context_parallel.context_size() > 1:
    # The sequence striped over the mesh's `context` axis: every [B, T] input in the same order
    # (the loss sums over tokens, so it is unchanged); positions made explicit first.
    B, T = inputs_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    named = dict(
      inputs=inputs_BT,
      targets=targets_BT,
      positions=positions_BT,
      segment_ids=segment_ids_BT,
      mask=mask_BT,
    )
    named = context_parallel.stripe_batch({k: v for k, v in named.items() if v is not None})
    inputs_BT, targets_BT, positions_BT = named["inputs"], named["targets"], named["positions"]
    segment_ids_BT, mask_BT = named.get("segment_ids"), named.get("mask")
  model = nnx.merge(graphdef, params)
  out = model.forward_train(
    inputs_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, hidden=bool(loss_chunk)
  )
  if loss_chunk:
    loss, aux = chunked_cross_entropy(
      out.main, targets_BT, mask_BT, chunk=loss_chunk, z_loss=z_loss, **model.output_head()
    )
  else:
    loss, aux = cross_entropy(out.main, targets_BT, mask_BT, z_loss=z_loss)
  routers, router_aux = router_terms(out.router, aux_loss=moe_aux_loss, z_loss=moe_z_loss)
  return loss + routers, {**aux, **router_aux}


def objective(cfg: Config) -> Callable:
  """(graphdef, params, batch) -> (loss, aux): next-token cross-entropy, plus the multi-token
  prediction heads' losses when the model has them, plus the routers' losses when it has
  mixture-of-experts layers."""
  chunk = cfg.train.loss_chunk
  moe = dict(moe_aux_loss=cfg.train.moe_aux_loss, moe_z_loss=cfg.train.moe_z_loss)
  if cfg.model.mtp is not None:
    from atlas_jax.training import mtp

    return functools.partial(mtp.loss_fn, loss_chunk=chunk, **moe)
  return functools.partial(loss_fn, z_loss=cfg.train.z_loss, loss_chunk=chunk, **moe)


def _accumulated_grads(trainer: Trainer, params, batch, scale):
  """Mean loss and float32 gradients of what trains (`split_trainable`; the rest are constants)
  over train.grad_accum micro-batches (a scan, not a loop)."""
  cfg = trainer.cfg.train
  A = cfg.grad_accum
  compute_loss = _in_mesh(trainer, objective(trainer.cfg))
  trainable, frozen = split_trainable(trainer.cfg, params)

  def micro(batch_m):
    def scaled_loss(trainable):
      loss, aux = compute_loss(trainer.graphdef, nnx.merge_state(trainable, frozen), batch_m)
      return loss * scale, (loss, aux)

    grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(trainable)
    return grads, loss, aux

  if A == 1:
    return micro(batch)
  # Micro-batch a takes rows a, a + A, a + 2A, ...: every data-parallel shard's block of rows
  # splits in place, so the split moves no data between devices.
  split = jax.tree.map(lambda x: x.reshape(x.shape[0] // A, A, *x.shape[1:]).swapaxes(0, 1), batch)

  def body(acc, batch_m):
    grads, loss, aux = micro(batch_m)
    acc = jax.tree.map(jnp.add, acc, (grads, loss, aux))
    return acc, None

  zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(micro, jax.tree.map(lambda x: x[0], split)))
  (grads, loss, aux), _ = jax.lax.scan(body, zeros, split)
  return jax.tree.map(lambda x: x / A, (grads, loss, aux))


def _in_mesh(trainer: Trainer, fn: Callable) -> Callable:
  """`fn` traced with the trainer's mesh in context (what `atlas_jax.model.moe` and
  `atlas_jax.model.context_parallel` read) and train.context_parallel's attention mode."""
  mode = trainer.cfg.train.context_parallel

  def in_mesh(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh), context_parallel.use(mode):
      return fn(*args, **kwargs)

  return in_mesh


def make_train_step(trainer: Trainer) -> Callable:
  """The jitted step; `state` is donated, so its buffers are reused for the new state."""
  cfg = trainer.cfg.train
  optimizer = trainer.optimizer
  schedule = learning_rate_schedule(cfg)

  def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict]:
    scale = jnp.float32(1.0) if state.loss_scale is None else state.loss_scale.scale
    grads, loss, aux = _accumulated_grads(trainer, state.params, batch, scale)
    if state.loss_scale is not None:
      grads = state.loss_scale.unscale(grads)
    # ZeRO-2/3: gradients live sharded, so the all-reduce becomes a reduce-scatter.
    grads = jax.lax.with_sharding_constraint(grads, trainer.grad_shardings)
    # Named, so a step's profile (`bench/step_profile.py`) can price the update.
    with jax.named_scope("optimizer"):
      # One pass over the gradient for its norm, which clipping, the metric and the finite check
      # share: a NaN or an infinity anywhere makes it non-finite (so does a norm past float32's
      # range, 1.8e19, which no step worth taking has).
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
      trainable, frozen = split_trainable(trainer.cfg, state.params)

      def update(trainable, opt_state):
        updates, opt_state = optimizer.update(grads, opt_state, trainable, grad_norm=grad_norm)
        return optax.apply_updates(trainable, updates), opt_state

      # A non-finite step never touches parameters or optimizer state: fp16 overflow and
      # on_nan=skip carry on; on_nan=stop has the host stop at `first_nonfinite`, state intact.
      # A branch, not a select per leaf after the update: the update then runs in place in the
      # donated buffers, where the select needed every old moment copied aside first.
      new, opt_state = jax.lax.cond(
        finite, update, lambda *state: state, trainable, state.opt_state
      )
      new_frozen = frozen
      counts_LE = aux.pop(COUNTS, None)
      if counts_LE is not None:
        aux.update(load_metrics(counts_LE, aux["moe_dropped"]))
      if counts_LE is not None and cfg.lora is None:  # LoRA: the base model, biases too, frozen
        # Outside the gradient: the selection biases step towards the load this step saw.
        new_frozen = update_router_bias(frozen, counts_LE, cfg.moe_bias_update_rate)
      skip = ~finite
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
      if new_frozen is not frozen:
        new_frozen = keep(new_frozen, frozen)
      params = nnx.merge_state(new, new_frozen)
    loss_scale = None if state.loss_scale is None else state.loss_scale.update(finite)
    metrics = {
      **aux,
      # The next-token cross-entropy alone, comparable across runs with and without MTP heads or
      # z-loss; the objective the gradients came from beside it.
      "loss": aux["ce"],
      "loss_total": loss,
      "grad_norm": grad_norm,
      "learning_rate": schedule(state.step),
      "skipped": skip.astype(jnp.int32),
    }
    if loss_scale is not None:
      metrics["loss_scale"] = loss_scale.scale
    step = state.step + 1
    overflow_ok = state.loss_scale is not None  # fp16: expected while the scale settles
    first = jnp.where(
      (state.first_nonfinite == 0) & skip & ~overflow_ok, step, state.first_nonfinite
    )
    new_state = TrainState(params, opt_state, step, first, loss_scale)
    return new_state, metrics

  batch_sh = shd.batch_sharding(trainer.mesh)
  return jax.jit(
    train_step,
    in_shardings=(trainer.state_shardings, batch_sh),
    out_shardings=(trainer.state_shardings, shd.replicated(trainer.mesh)),
    donate_argnums=0,
  )


def make_eval_step(trainer: Trainer) -> Callable:
  """(params, batch) -> f32[] the next-token cross-entropy (MTP heads and z-loss left out)."""
  compute_loss = _in_mesh(trainer, objective(trainer.cfg))

  def eval_step(params, batch):
    return compute_loss(trainer.graphdef, params, batch)[1]["ce"]

  return jax.jit(
    eval_step, in_shardings=(trainer.state_shardings.params, shd.batch_sharding(trainer.mesh))
  )
