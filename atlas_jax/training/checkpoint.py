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

import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from atlas_jax import quant
from atlas_jax.config import Config, dump_config, load_config
from atlas_jax.data.tokenizer import Tokenizer, load_tokenizer
from atlas_jax.model import build, lora
from atlas_jax.training.pipeline import reorder_layers
from atlas_jax.training.precision import training_model_config
from atlas_jax.training.sharding import AXES

if TYPE_CHECKING:
  import orbax.checkpoint as ocp

T = TypeVar("T")


def _orbax():
  """orbax.checkpoint, imported where a run's steps are read or written: a server of a Hugging
  Face folder never does, and the import (with tensorstore's library) stays resident, about 25 MB
  of a process. Its import adds a plain stderr handler to the root logger; one added now, after
  the program set up its logging, is taken out again, or each record would print twice."""
  root = logging.getLogger()
  before = list(root.handlers)
  import orbax.checkpoint

  for h in list(root.handlers):
    if h not in before and type(h) is logging.StreamHandler and before:
      root.removeHandler(h)
  return orbax.checkpoint


def manager(
  directory: str | Path, *, max_to_keep: int = 3, asynchronous: bool = True
) -> ocp.CheckpointManager:
  """Orbax's manager of a run's steps; `asynchronous`: `save` returns at once and writes while
  the run goes on (`train.async_checkpointing`)."""
  ocp = _orbax()
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, create=True, enable_async_checkpointing=asynchronous
  )
  return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def write_run_files(directory: str | Path, cfg: Config, tokenizer: Tokenizer | None = None) -> None:
  """config.yaml, and tokenizer.json unless the tokenizer is bytes (serve.py reads both)."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.yaml").write_text(dump_config(cfg))
  if tokenizer is not None and hasattr(tokenizer, "save"):
    tmp = directory / ".tokenizer.tmp.json"
    tokenizer.save(tmp)
    tmp.replace(directory / "tokenizer.json")
  elif cfg.data.tokenizer != "byte" and not cfg.data.tokenizer.startswith("bpe:"):
    src = Path(cfg.data.tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    if src.resolve() != (directory / "tokenizer.json").resolve():
      shutil.copy(src, directory / "tokenizer.json")


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
  """Saves `state` (a TrainState) and `meta` (JSON) at `step`: starts the save, or makes it
  whole, as the manager is asynchronous or not."""
  ocp = _orbax()
  mngr.save(
    step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
  )


class CheckpointError(ValueError):
  """A checkpoint step that cannot be restored (damaged files, or none intact)."""


# The JSON files orbax writes in a step directory; a damaged one is named in the error.
_JSON_FILES = ("meta/metadata", "state/_METADATA", "state/_sharding", "_CHECKPOINT_METADATA")


def _damage(step_dir: Path, error: BaseException) -> str:
  """Which file of a step directory is damaged, as far as can be told, and the error."""
  for name in _JSON_FILES:
    file = step_dir / name
    if not file.is_file():
      continue
    try:
      json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return f"{file} is not valid JSON ({e})"
  detail = " ".join(str(error).split()).split(" See full TensorStore details")[0]
  detail = detail[:300] + ("..." if len(detail) > 300 else "")
  return f"{type(error).__name__}: {detail}"


def restore(
  mngr: ocp.CheckpointManager, abstract_state: Any, shardings: Any, step: int | None = None
) -> tuple[Any, dict[str, Any]]:
  """(state, meta) of `step` (default latest), laid out with `shardings` (any mesh).

  Raises:
    CheckpointError naming the step and, where it can tell, the damaged file.
  """
  ocp = _orbax()
  step = mngr.latest_step() if step is None else step
  target = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
  )
  try:
    restored = mngr.restore(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
    )
    meta = restored["meta"]
    if not isinstance(meta, dict) or not isinstance(meta.get("data_index"), int):
      raise ValueError(f"meta {meta!r} lacks an integer 'data_index'")
  except Exception as e:
    step_dir = Path(mngr.directory) / str(step)
    raise CheckpointError(
      f"checkpoint step {step} in {mngr.directory} cannot be restored: {_damage(step_dir, e)}"
    ) from e
  return restored["state"], meta


def newest_intact(
  steps: list[int],
  load: Callable[[int], T],
  *,
  fallback: bool,
  warn: Callable[[str], None],
  hint: str = "",
) -> tuple[int, T, list[int]]:
  """Loads the newest step that loads: (step, what `load` returned, the newer damaged steps).

  Without `fallback`, a damaged newest step raises its CheckpointError (with `hint` appended).
  When no step loads, the error lists every step's.
  """
  errors = []
  for i, step in enumerate(sorted(steps, reverse=True)):
    try:
      return step, load(step), [s for s, _ in errors]
    except CheckpointError as e:
      errors.append((step, e))
      if not fallback:
        raise CheckpointError(f"{e}{hint}") from e
      older = sorted(steps, reverse=True)[i + 1 : i + 2]
      warn(f"warning: {e}" + (f"; trying step {older[0]}" if older else ""))
  raise CheckpointError(
    "no checkpoint step could be restored: " + "; ".join(str(e) for _, e in errors)
  )


def set_aside(directory: str | Path, steps: list[int]) -> list[Path]:
  """Renames damaged step folders to `<step>.corrupt` (kept for a look, out of orbax's sight,
  so the resumed run can save those steps again)."""
  moved = []
  for step in steps:
    src = Path(directory) / str(step)
    dst = src.with_name(f"{step}.corrupt")
    n = 1
    while dst.exists():
      dst, n = src.with_name(f"{step}.corrupt{n}"), n + 1
    src.rename(dst)
    moved.append(dst)
  return moved


def is_checkpoint(directory: str | Path) -> bool:
  return (Path(directory) / "config.yaml").is_file()


def abstract_params(cfg: Config, *, implementation: str | None = None):
  """(graphdef, abstract params) of a run's model as its checkpoints store it: float32 master
  weights, with the run's LoRA adapters (and a QLoRA run's base projections as QArrays)."""

  def model():
    model = build(
      training_model_config(cfg.model, cfg.train.precision),
      rngs=nnx.Rngs(0),
      implementation=implementation,
      lora=cfg.train.lora,
    )
    if cfg.train.base_quantization is not None:
      group = cfg.train.base_quantization_group_size
      fmt = cfg.train.base_quantization
      quant.quantize_model(model, fmt, group_size=group, field="train.base_quantization")
    return model

  return nnx.split(nnx.eval_shape(model))


def restore_params(
  directory: str | Path, abstract: Any, shardings: Any, *, step: int | None = None
):
  """The parameters of a run's newest intact step (or `step`), read straight into `shardings`
  (a tree like `abstract`, an nnx.State, which a run stored in a circular pipeline's layer order
  is filled in with to move its layers back), in depth order; the optimizer state is not read.

  Raises:
    ValueError for a directory with no step; CheckpointError when none can be restored.
  """
  ocp = _orbax()
  directory = Path(directory)
  mngr = manager(directory)
  leaf = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  target = {"params": jax.tree.map(leaf, abstract, shardings)}
  restore_args = jax.tree.map(
    lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), target
  )

  def load(step: int):
    try:
      return mngr.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=True
          ),
          meta=ocp.args.JsonRestore(),
        ),
      )
    except Exception as e:
      raise CheckpointError(
        f"checkpoint step {step} in {directory} cannot be restored: "
        f"{_damage(directory / str(step), e)}"
      ) from e

  steps = list(mngr.all_steps()) if step is None else [step]
  if not steps:
    raise ValueError(f"{directory}: holds no checkpoint step")
  warn = lambda message: print(message, file=sys.stderr)
  _, restored, _ = newest_intact(steps, load, fallback=step is None, warn=warn)
  params = restored["state"]["params"]
  params = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  layout = tuple(restored["meta"].get("layer_layout", (1, 1)))
  if layout[1] == 1:  # stored in depth order
    return params
  # A circular pipeline's run stores its layers stage by stage: back to depth order.
  nnx.replace_by_pure_dict(abstract, params)
  return nnx.to_pure_dict(reorder_layers(abstract, layout, (1, 1)))


def load_trained(
  directory: str | Path, *, step: int | None = None, implementation: str | None = None
) -> tuple[nnx.Module, Config]:
  """The model as trained (float32 master weights, LoRA adapters kept apart; a QLoRA run's
  base dequantized, the weights its adapters were trained over) and its config, from the
  newest intact step (or `step`), on one device."""
  directory = Path(directory)
  if not is_checkpoint(directory):
    raise ValueError(f"{directory}: not a training run directory (no config.yaml)")
  cfg = load_config(directory / "config.yaml")
  graphdef, abstract = abstract_params(cfg, implementation=implementation)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  shardings = jax.tree.map(lambda _: device, abstract)
  nnx.replace_by_pure_dict(abstract, restore_params(directory, abstract, shardings, step=step))
  model = nnx.merge(graphdef, abstract)
  quant.dequantize_model(model)
  return model, cfg


def load_model(
  directory: str | Path, *, step: int | None = None, implementation: str | None = None
) -> tuple[nnx.Module, Config, Tokenizer]:
  """The trained model (latest step by default), its config and its tokenizer, for inference.

  The model computes in the config's model.dtype with the float32 master weights cast to it; a
  LoRA run's adapters are merged into the weights they adapt.
  """
  directory = Path(directory)
  trained, cfg = load_trained(directory, step=step, implementation=implementation)
  model = nnx.eval_shape(lambda: build(cfg.model, rngs=nnx.Rngs(0), implementation=implementation))
  graphdef, state = nnx.split(model)
  params = lora.merged_params(trained)  # the parameters alone where there is no adapter
  # The inference model's own parameter dtype (the master weights are float32).
  cast = lambda x, want: jax.numpy.asarray(x, want.dtype)
  nnx.replace_by_pure_dict(state, jax.tree.map(cast, params, nnx.to_pure_dict(state)))
  # The run's own BPE, or bytes; a fine-tune of a Hugging Face folder keeps that folder's
  # tokenizer files too, whose special tokens `atlas_jax.sources.tokenizer` reads.
  tok_file = directory / "tokenizer.json"
  tokenizer = load_tokenizer(str(tok_file) if tok_file.is_file() else "byte")
  return nnx.merge(graphdef, state), cfg, tokenizer


def single_device_mesh() -> Mesh:
  return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(AXES)), AXES)
