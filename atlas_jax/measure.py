"""Measured counterparts of the planner's figures, read off the real modules without allocating.

The planner (`atlas_jax.plan.planner`) is arithmetic on a config; this module builds the real
things abstractly (`jax.eval_shape`, `jax.make_jaxpr`) and counts their bytes, so tests, the
notebooks and `bench/remat.py` can set the two side by side:

* `param_counts`: the initialised model's parameters, by top-level group;
* `cache_bytes` / `paged_pool_bytes`: the arrays of the model's own KV (or MLA latent) cache and of
  its paged block pool;
* `train_state_bytes`: per-device bytes of parameters, gradients and optimizer state as the
  trainer lays them out on a mesh;
* `saved_activation_bytes`: what the train step's forward pass saves for its backward pass;
  `saved_activation_bytes_per_device`: the same per device as the sharded (or pipelined) step
  lays it out;
* `train_step_flops`: XLA's cost analysis of the compiled gradient;
* `pipeline_loops` / `collective_permute_bytes`: a compiled train step's pipeline iterations and
  the bytes its stages send each other (from `compiled_train_step`).

Every call into model, cache and trainer code that the planner is checked against goes through
here, so a change of those modules' surface is absorbed in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core
from jax.sharding import Mesh

from atlas_jax.config import Config, ModelConfig
from atlas_jax.model import Transformer, build
from atlas_jax.training import sharding as shd
from atlas_jax.training.precision import training_model_config
from atlas_jax.training.step import (
  build_model,
  make_train_step,
  make_trainer,
  objective,
  split_trainable,
)


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _size(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def abstract_model(cfg: ModelConfig) -> nnx.Module:
  """The model a config builds, as shapes only."""
  return nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Parameters of the initialised model by top-level group (embed, blocks, ...) and in total."""
  state = nnx.state(abstract_model(cfg), nnx.Param)
  counts = {str(name): _size(sub) for name, sub in state.items()}
  counts["total"] = sum(counts.values())
  return counts


def cache_bytes(cfg: ModelConfig, *, batch: int, length: int, dtype: str) -> int:
  """Bytes of the keys and values (or MLA latents) of the model's own cache for `batch` x `length`.

  The per-sequence lengths counter (int32[B]) is bookkeeping, not cache, and is left out.
  """
  model = abstract_model(cfg)
  cache = jax.eval_shape(lambda: model.init_cache(batch, length, jnp.dtype(dtype)))
  arrays = [x for x in jax.tree.leaves(cache) if x.ndim > 1]
  return _nbytes(arrays)


def paged_pool_bytes(cfg: ModelConfig, *, n_blocks: int, block_size: int, dtype: str) -> int:
  """Bytes of the model's paged pool (KV, or MLA latents) of `n_blocks` blocks of `block_size`."""
  model = abstract_model(cfg)
  return _nbytes(jax.eval_shape(lambda: model.init_pool(n_blocks, block_size, jnp.dtype(dtype))))


def train_state_bytes(cfg: Config, mesh: Mesh | None = None) -> dict[str, int]:
  """Per-device bytes of parameters, gradients and optimizer state as the trainer shards them."""
  trainer = make_trainer(cfg, mesh=mesh)
  abstract = trainer.abstract_state()
  trainable, _ = split_trainable(cfg, abstract.params)
  return {
    "params": shd.sharded_bytes(abstract.params, trainer.state_shardings.params),
    # What is differentiated: the Params, or with LoRA the adapters.
    "grads": shd.sharded_bytes(trainable, trainer.grad_shardings),
    "opt_state": shd.sharded_bytes(abstract.opt_state, trainer.state_shardings.opt_state),
  }


def _param_view(params: set[int], producers: dict[int, jex_core.JaxprEqn]) -> Callable:
  """Whether a var is a parameter or a free view of one: reshapes, and a pipeline's shard_map
  handing its slice of a parameter back out (followed into its body and out again)."""

  def is_param(v, params=params, producers=producers) -> bool:
    while id(v) not in params:
      eqn = producers.get(id(v))
      if eqn is None:
        return False
      if eqn.primitive.name == "reshape":
        v = eqn.invars[0]
      elif eqn.primitive.name == "shard_map":
        body = eqn.params["jaxpr"]
        inner_params = {
          id(b) for b, a in zip(body.invars, eqn.invars) if is_param(a, params, producers)
        }
        inner = {id(w): e for e in body.eqns for w in e.outvars}
        return _param_view(inner_params, inner)(body.outvars[eqn.outvars.index(v)])
      else:
        return False
    return True

  return is_param


def _residual_vars(cfg: Config, batch: int):
  """(residual vars of the train step's vjp, the parameter input vars, defining equations)."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
  loss = objective(cfg)

  def forward(params, tokens_BT1):
    return jax.vjp(lambda p: loss(graphdef, p, {"tokens": tokens_BT1})[0], params)

  tokens = jax.ShapeDtypeStruct((batch, cfg.train.seq_len + 1), jnp.int32)
  closed, (_, vjp_fn) = jax.make_jaxpr(forward, return_shape=True)(params, tokens)
  jaxpr = closed.jaxpr
  n_residuals = len(jax.tree.leaves(vjp_fn))
  residuals = jaxpr.outvars[len(jaxpr.outvars) - n_residuals :]
  param_vars = jaxpr.invars[: len(jax.tree.leaves(params))]
  producers = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  return residuals, param_vars, producers


def saved_activation_bytes(cfg: Config, *, batch: int) -> int:
  """Bytes the train step's forward pass saves for the backward pass (shapes only, no compute).

  The residuals of `jax.vjp` of the run's loss with respect to the parameters, minus the
  parameters themselves (and free reshapes of them, as the every_k policy's layer grouping):
  saved activations, plus any low-precision weight copies the policy keeps (bf16 compute casts
  the float32 master weights once per use).
  """
  residuals, param_vars, producers = _residual_vars(cfg, batch)
  is_param = _param_view({id(v) for v in param_vars}, producers)
  seen, total = set(), 0
  for v in residuals:
    if isinstance(v, jex_core.Literal) or id(v) in seen or is_param(v):
      continue
    seen.add(id(v))
    total += math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize
  return total


def saved_activation_bytes_per_device(cfg: Config, *, mesh: Mesh) -> int:
  """Per-device bytes the sharded train step's forward pass saves for its backward pass, as XLA
  lays them out on `mesh` (pipeline stages included): the residuals of `jax.vjp` of the run's
  loss on one accumulation micro-batch (train.batch_size / train.grad_accum rows), returned by a
  compiled program whose output shardings give each one's shard; parameters left out."""
  trainer = make_trainer(cfg, mesh=mesh)
  loss = functools.partial(objective(cfg), trainer.graphdef)
  params = trainer.abstract_state().params
  rows = cfg.train.batch_size // cfg.train.grad_accum
  tokens = jax.ShapeDtypeStruct((rows, cfg.train.seq_len + 1), jnp.int32)

  def residuals(params, tokens_BT1):
    _, vjp_fn = jax.vjp(lambda p: loss(p, {"tokens": tokens_BT1})[0], params)
    return jax.tree.leaves(vjp_fn)

  jaxpr = jax.make_jaxpr(residuals)(params, tokens).jaxpr
  producers = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  is_param = _param_view({id(v) for v in jaxpr.invars[: len(jax.tree.leaves(params))]}, producers)
  in_shardings = (trainer.state_shardings.params, shd.batch_sharding(mesh))
  compiled = jax.jit(residuals, in_shardings=in_shardings).lower(params, tokens).compile()
  seen, total = set(), 0
  for v, out, sharding in zip(jaxpr.outvars, compiled.out_info, compiled.output_shardings):
    if isinstance(v, jex_core.Literal) or id(v) in seen or is_param(v):
      continue
    seen.add(id(v))
    total += math.prod(sharding.shard_shape(out.shape)) * np.dtype(out.dtype).itemsize
  return total


def compiled_train_step(cfg: Config, *, mesh: Mesh) -> str:
  """The train step's compiled program (HLO text) on `mesh`, from abstract inputs."""
  trainer = make_trainer(cfg, mesh=mesh)
  tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
  step = make_train_step(trainer)
  return step.lower(trainer.abstract_state(), {"tokens": tokens}).compile().as_text()


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", re.M | re.S)
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)")
_WHILE = re.compile(r"while\(.*?body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)")
# The collective-permutes jax.lax.ppermute lowers to (XLA adds others where it reshards).
_PERMUTE = re.compile(r"= (\(?[^=]*?\)?) collective-permute\(.*op_name=\"[^\"]*/ppermute\"")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _hlo_computations(hlo: str) -> tuple[dict[str, str], str]:
  """(computation name -> body text, the entry computation's name)."""
  bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(hlo)}
  entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
  return bodies, entry


def pipeline_loops(hlo: str) -> list[int]:
  """Trip counts of a compiled program's while loops whose bodies run a ppermute directly (the
  pipeline's iteration loops, forward and backward), in program order."""
  bodies, _ = _hlo_computations(hlo)
  loops = []
  for m in _WHILE.finditer(hlo):
    if _PERMUTE.search(bodies.get(m.group(1), "")):
      loops.append(int(m.group(2)))
  return loops


def collective_permute_bytes(hlo: str) -> int:
  """Bytes one device sends with ppermutes in one run of a compiled program: each op's
  per-device result shape, times the trip counts of the loops around it."""
  bodies, entry = _hlo_computations(hlo)
  itemsize = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "f64": 8, "pred": 1}

  @functools.cache
  def sent(name: str) -> int:
    text = bodies.get(name, "")
    total = 0
    for shape in _PERMUTE.findall(text):
      for dtype, dims in _ARRAY.findall(shape):
        total += itemsize[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    trips = {m.group(1): int(m.group(2)) for m in _WHILE.finditer(text)}
    for callee in set(_CALLS.findall(text)):
      total += trips.get(callee, 1) * sent(callee)
    return total

  return sent(entry)


def train_step_flops(cfg: Config, *, batch: int) -> float:
  """XLA's FLOP count of the compiled gradient of the run's loss.

  XLA's cost analysis counts a loop body once whatever its trip count, so the layers are unrolled.
  """
  model = nnx.eval_shape(
    lambda: Transformer(
      training_model_config(cfg.model, cfg.train.precision),
      rngs=nnx.Rngs(0),
      implementation=cfg.attention.implementation,
      remat=cfg.train.remat,
      remat_every=cfg.train.remat_every,
      unroll_layers=True,
    )
  )
  graphdef, params = nnx.split(model)
  loss = objective(cfg)
  tokens = jax.ShapeDtypeStruct((batch, cfg.train.seq_len + 1), jnp.int32)
  grad = jax.jit(jax.grad(lambda p, t: loss(graphdef, p, {"tokens": t})[0]))
  cost = grad.lower(params, tokens).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"])


def with_train(cfg: Config, **fields) -> Config:
  """`cfg` with some train fields replaced (policy, precision, sharding ...)."""
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **fields))
