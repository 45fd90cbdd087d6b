"""Checkpoints with orbax: parameters, optimizer state and step, beside the run's config.

Layout of a run directory:
    config.yaml         the full Config of the run
    tokenizer.json      when the run used a BPE tokenizer
    <step>/             orbax checkpoints (params, opt_state, meta)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from atlas_jax.config import Config, dump_config, load_config
from atlas_jax.data.tokenizer import Tokenizer, load_tokenizer
from atlas_jax.model.transformer import Transformer


def manager(directory: str | Path, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    Path(directory).absolute(),
    options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
  )


def write_run_files(directory: str | Path, cfg: Config) -> None:
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.yaml").write_text(dump_config(cfg))
  if cfg.data.tokenizer != "byte":
    src = Path(cfg.data.tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    if src.resolve() != (directory / "tokenizer.json").resolve():
      shutil.copy(src, directory / "tokenizer.json")


def save(mngr: ocp.CheckpointManager, step: int, params, opt_state, meta: dict[str, Any]) -> None:
  mngr.save(
    step,
    args=ocp.args.Composite(
      params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
      opt_state=ocp.args.StandardSave(opt_state),
      meta=ocp.args.JsonSave(meta),
    ),
  )


def is_checkpoint(directory: str | Path) -> bool:
  return (Path(directory) / "config.yaml").is_file()


def load_model(
  directory: str | Path, *, step: int | None = None, implementation: str | None = None
) -> tuple[Transformer, Config, Tokenizer]:
  """The trained model (latest step by default), its config and its tokenizer."""
  directory = Path(directory)
  if not is_checkpoint(directory):
    raise ValueError(f"{directory}: not a training run directory (no config.yaml)")
  cfg = load_config(directory / "config.yaml")
  mngr = manager(directory)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"{directory}: holds no checkpoint step")
  abstract = nnx.eval_shape(
    lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), implementation=implementation)
  )
  graphdef, state = nnx.split(abstract)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
  restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  nnx.replace_by_pure_dict(state, restored["params"])
  tok_file = directory / "tokenizer.json"
  tokenizer = load_tokenizer(str(tok_file) if tok_file.is_file() else "byte")
  return nnx.merge(graphdef, state), cfg, tokenizer
