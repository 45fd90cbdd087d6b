"""Checkpoints with orbax: the whole train state, the data position and the config.

Layout of a run directory:
    config.yaml         the full Config of the run
    tokenizer.json      when the run used a BPE tokenizer
    <step>/             orbax checkpoints: state (params, optimizer, step, loss scale) and meta
                        (step, data iterator state)

Saves are asynchronous (training continues while the previous step is written) and only the last
train.keep_checkpoints are kept. Restoring takes target shardings, so a run saved on one mesh
resumes on another.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from atlas_jax.config import Config, dump_config, load_config
from atlas_jax.data.tokenizer import Tokenizer, load_tokenizer
from atlas_jax.model import build


def manager(directory: str | Path, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    Path(directory).absolute(),
    options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
  )


def write_run_files(
  directory: str | Path, cfg: Config, tokenizer_file: str | Path | None = None
) -> None:
  """The run's config.yaml, and its tokenizer.json unless byte-level (`tokenizer_file`: where a
  "bpe:N" tokenizer was trained; default the data.tokenizer path)."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.yaml").write_text(dump_config(cfg))
  if cfg.data.tokenizer != "byte":
    src = Path(cfg.data.tokenizer if tokenizer_file is None else tokenizer_file)
    src = src / "tokenizer.json" if src.is_dir() else src
    if src.resolve() != (directory / "tokenizer.json").resolve():
      shutil.copy(src, directory / "tokenizer.json")


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
  """Starts an asynchronous save of `state` (a TrainState) and `meta` (JSON) at `step`."""
  mngr.save(
    step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
  )


def restore(
  mngr: ocp.CheckpointManager, abstract_state: Any, shardings: Any, step: int | None = None
) -> tuple[Any, dict[str, Any]]:
  """(state, meta) of `step` (default latest), laid out with `shardings` (any mesh)."""
  step = mngr.latest_step() if step is None else step
  target = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
  )
  restored = mngr.restore(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
  )
  return restored["state"], restored["meta"]


def is_checkpoint(directory: str | Path) -> bool:
  return (Path(directory) / "config.yaml").is_file()


def load_model(
  directory: str | Path, *, step: int | None = None, implementation: str | None = None
) -> tuple[nnx.Module, Config, Tokenizer]:
  """The trained model (latest step by default), its config and its tokenizer, for inference.

  The model computes in the config's model.dtype with the float32 master weights cast to it.
  """
  directory = Path(directory)
  if not is_checkpoint(directory):
    raise ValueError(f"{directory}: not a training run directory (no config.yaml)")
  cfg = load_config(directory / "config.yaml")
  mngr = manager(directory)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"{directory}: holds no checkpoint step")
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: build(cfg.model, rngs=nnx.Rngs(0), implementation=implementation))
  )
  # Only the parameters subtree of the train state is read (no optimizer state), onto one device.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = {
    "params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
  }
  restore_args = jax.tree.map(
    lambda x: ocp.ArrayRestoreArgs(sharding=device, dtype=x.dtype), target
  )
  restored = mngr.restore(
    step,
    args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    ),
  )
  params = restored["state"]["params"]
  nnx.replace_by_pure_dict(
    abstract, nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  )
  tok_file = directory / "tokenizer.json"
  tokenizer = load_tokenizer(str(tok_file) if tok_file.is_file() else "byte")
  return nnx.merge(graphdef, abstract), cfg, tokenizer


def single_device_mesh() -> Mesh:
  return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
