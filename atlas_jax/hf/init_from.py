"""Pretrained weights (train.init_from) laid out straight into a run's parameter shardings.

A Hugging Face folder is read and converted on the host (safetensors -> our layouts, on the CPU
backend), and each device is then handed only its own shards of each parameter
(`jax.make_array_from_callback`): no device ever holds a whole unsharded parameter, whatever the
mesh. A train.py run directory is restored by orbax straight into the shardings; a LoRA run's
adapters are merged into their weights under jit, shard by shard.

The result is a pure dict of the base model's parameters (no adapters), for `Trainer.init`, which
draws the adapters and the optimizer's zero state around it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax import hf, quant
from atlas_jax.config import ConfigError, ModelConfig
from atlas_jax.model import lora
from atlas_jax.training import checkpoint
from atlas_jax.training import sharding as shd
from atlas_jax.training.step import Trainer, quantize_base

# Model fields a fine-tuning config may set whatever the source says (`atlas_jax.sources`): the
# compute and storage dtypes (train.precision decides the training ones), the init scale (the
# weights are loaded) and the MTP loss weight (a training objective, not the heads).
MAY_DIFFER = ("dtype", "param_dtype", "init_std", "mtp.loss_weight")


def comparable(cfg: ModelConfig) -> ModelConfig:
  """`cfg` with the fields that may differ from a source's (`MAY_DIFFER`) at their defaults."""
  default = ModelConfig()
  mtp = None if cfg.mtp is None else dataclasses.replace(cfg.mtp, loss_weight=0.0)
  keep = {name: getattr(default, name) for name in MAY_DIFFER if "." not in name}
  return dataclasses.replace(cfg, **keep, mtp=mtp)


def base_targets(trainer: Trainer, *, quantized: bool = False) -> tuple[dict, dict]:
  """(abstract base variables, their shardings) as pure dicts: the run's model less its
  adapters (the routers' selection biases included). A QLoRA run's quantized projections
  (train.base_quantization) as float32 arrays laid out as their values are (the run quantizes
  them as it initialises), or with `quantized` as the QArrays it holds."""
  _, abstract = nnx.split_state(trainer.abstract_state().params, lora.LoRAParam, ...)
  _, shardings = nnx.split_state(trainer.state_shardings.params, lora.LoRAParam, ...)
  abstract, shardings = nnx.to_pure_dict(abstract), nnx.to_pure_dict(shardings)
  if quantized:
    return abstract, shardings
  floats = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32) if quant.is_quantized(a) else a
  values = lambda s: s.qvalue if quant.is_quantized(s) else s
  return (
    jax.tree.map(floats, abstract, is_leaf=quant.is_quantized),
    jax.tree.map(values, shardings, is_leaf=quant.is_quantized),
  )


def _check_same_model(source: ModelConfig, run: ModelConfig, path: str) -> None:
  """The source's weights are for the run's model (the fields that may differ aside)."""
  if comparable(source) != comparable(run):
    raise ConfigError(
      f"train.init_from={path!r} holds another model than the run's (changed since the run "
      f"began?): {source} vs {run}"
    )


def place(host: dict, abstract: dict, shardings: dict) -> dict:
  """Host arrays (a pure dict) as global arrays laid out with `shardings`, each device given
  only its own slices.

  Raises:
    ConfigError naming a parameter that is missing or has another shape.
  """
  flat_host = dict(jax.tree_util.tree_leaves_with_path(host))

  def one(path, want, sharding):
    name = ".".join(str(getattr(k, "key", k)) for k in path)
    if path not in flat_host:
      raise ConfigError(f"train.init_from: the source has no parameter {name}")
    value = np.asarray(flat_host[path])
    if value.shape != tuple(want.shape):
      raise ConfigError(
        f"train.init_from: parameter {name} has shape {value.shape} in the source; the run's "
        f"model needs {tuple(want.shape)}"
      )
    value = value.astype(want.dtype, copy=False)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return jax.tree_util.tree_map_with_path(one, abstract, shardings)


def _from_hf(path: Path, trainer: Trainer, abstract: dict, shardings: dict) -> dict:
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    model = hf.load(path)
    _check_same_model(model.cfg, trainer.cfg.model, str(path))
    if trainer.cfg.train.base_quantization is not None:
      # QLoRA: the projections quantized here, on the host, so each device receives only its
      # shards of the 8- or 4-bit values and scales and never holds the float base.
      quantize_base(trainer.cfg, model)
      abstract, shardings = base_targets(trainer, quantized=True)
  host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  del model
  return place(host, abstract, shardings)


def _from_run(path: Path, trainer: Trainer, abstract: dict, shardings: dict) -> dict:
  src = checkpoint.load_config(path / "config.yaml")
  _check_same_model(src.model, trainer.cfg.model, str(path))
  graphdef, src_abstract = checkpoint.abstract_params(src)
  rules = shd.strategy_rules(trainer.cfg.train.sharding)["params"]
  src_shardings = shd.tree_shardings(src_abstract, trainer.mesh, rules)
  params = checkpoint.restore_params(path, src_abstract, src_shardings)
  if src.train.lora is None:
    return params

  def merge(params):
    state = nnx.state(nnx.merge(graphdef, src_abstract))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    quant.dequantize_model(model)  # a QLoRA run's base: its adapters fold into the dequantized
    return lora.merged_params(model)

  return jax.jit(merge, out_shardings=shardings)(params)


def base_params(path: str | Path, trainer: Trainer) -> dict:
  """The source's weights for `trainer`'s model, laid out in its parameter shardings."""
  path = Path(path)
  abstract, shardings = base_targets(trainer)
  if checkpoint.is_checkpoint(path):
    return _from_run(path, trainer, abstract, shardings)
  return _from_hf(path, trainer, abstract, shardings)
