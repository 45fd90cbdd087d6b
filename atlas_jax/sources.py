"""Where a fine-tune starts (train.init_from): a Hugging Face folder or a train.py run directory.

    cfg = sources.load_config("configs/finetune.yaml", ["train.init_from=path/to/hf_folder"])

The source gives the run its model config (read from its files alone: config.json and the
safetensors headers, or the run's config.yaml; no weight is read and no device is touched), its
tokenizer with the special tokens its files declare, and its chat template. The config's own
model section may be left out; a field it does give must agree with the source, except the
fields that say how the model runs rather than what it computes (`MAY_DIFFER`).
The weights themselves are placed by `atlas_jax.hf.init_from`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from atlas_jax import hf
from atlas_jax.config import Config, ConfigError, ModelConfig, TrainConfig, build, read_config
from atlas_jax.config import load_config as load_plain
from atlas_jax.data.tokenizer import Tokenizer
from atlas_jax.hf.export import TOKENIZER_FILES
from atlas_jax.hf.init_from import MAY_DIFFER
from atlas_jax.hf.tokenizer import run_tokenizer
from atlas_jax.serving import model_files
from atlas_jax.serving.chat import ChatTemplate, PlainChatTemplate
from atlas_jax.training import checkpoint


def is_hf_folder(path: str | Path) -> bool:
  return (Path(path) / "config.json").is_file()


def model_config(path: str | Path) -> ModelConfig:
  """The model config of a source, from its files alone.

  Raises:
    ConfigError naming train.init_from when the path is neither kind of source; HFLoadError for
    a Hugging Face folder that cannot be imported.
  """
  path = Path(path)
  if checkpoint.is_checkpoint(path):
    return load_plain(path / "config.yaml").model
  if is_hf_folder(path):
    return hf.folder_config(path)
  raise ConfigError(
    f"train.init_from={str(path)!r} is not allowed: expected a Hugging Face folder (config.json "
    "and *.safetensors) or a train.py run directory (config.yaml and its checkpoints)"
    + ("" if path.exists() else "; it does not exist")
  )


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_leaves(value, (*prefix, key)))
    else:
      out[(*prefix, key)] = value
  return out


def _get(obj: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    if obj is None:
      return None
    obj = getattr(obj, key)
  return obj


def _resolved_model(given: Mapping[str, Any], source: ModelConfig, init_from: str) -> ModelConfig:
  """The source's model, with the fields of `given` that may differ applied.

  Raises:
    ConfigError naming the first given field that disagrees with the source, and both values.
  """
  merged = dataclasses.asdict(source)
  leaves = _leaves(given)
  for path, value in leaves.items():
    node = merged
    for key in path[:-1]:
      if not isinstance(node.get(key), dict):
        node[key] = {}
      node = node[key]
    node[path[-1]] = value
  candidate = build(ModelConfig, merged, prefix="model")  # checks the given values' types
  for path, value in leaves.items():
    name = ".".join(path)
    # A field that may differ, in a section the source has (not MTP weights it lacks).
    if name in MAY_DIFFER and _get(source, path[:-1]) is not None:
      continue
    want = _get(source, path)
    if _get(candidate, path) != want:
      raise ConfigError(
        f"model.{name}={value!r} disagrees with train.init_from={init_from!r}, whose model has "
        f"{name}={want!r}: the model comes from train.init_from; leave model.{name} out of the "
        f"config (or set it to {want!r})"
      )
  return candidate


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
  """`atlas_jax.config.load_config`, with the model taken from train.init_from when set.

  A resumed run whose source is gone takes the model its own config.yaml recorded.
  """
  data = read_config(path, overrides)
  train = data.get("train")
  init_from = train.get("init_from") if isinstance(train, Mapping) else None
  if init_from is None:
    return build(Config, data)
  if not isinstance(init_from, str):
    raise ConfigError(f"train.init_from={init_from!r} is not allowed: expected a path (a string)")
  section = data.get("data")
  tokenizer = section.get("tokenizer", "byte") if isinstance(section, Mapping) else "byte"
  if tokenizer != "byte":
    raise ConfigError(
      f"data.tokenizer={tokenizer!r} is not allowed with train.init_from={init_from!r}: the "
      "tokenizer comes from the source; leave data.tokenizer out"
    )
  given = data.get("model") or {}
  if not isinstance(given, Mapping):
    raise ConfigError(f"model={given!r} is not allowed: expected a mapping of model fields")
  run_dir = Path(train.get("checkpoint_dir", TrainConfig.checkpoint_dir))
  recorded = load_plain(run_dir / "config.yaml") if checkpoint.is_checkpoint(run_dir) else None
  if not Path(init_from).exists() and recorded and recorded.train.init_from == init_from:
    source = recorded.model
  else:
    source = model_config(init_from)
  data["model"] = _resolved_model(given, source, init_from)
  return build(Config, data)


def tokenizer(path: str | Path, vocab_size: int) -> Tokenizer:
  """A source's tokenizer, with the special tokens and eos ids its files declare
  (`atlas_jax.hf.tokenizer.run_tokenizer`)."""
  return run_tokenizer(path, vocab_size)


def chat_template(path: str | Path | None, tokenizer: Tokenizer) -> ChatTemplate:
  """The chat template serve.py renders a folder's requests with: its own, or the plain
  "role: content" transcript when it has none (or there is no folder)."""
  template = None if path is None else model_files.chat_template(path, tokenizer)
  return PlainChatTemplate() if template is None else template


def copy_files(source: str | Path, run_dir: str | Path) -> list[str]:
  """Copies a source's tokenizer files into a run directory (serve.py reads them there); the
  eos ids a Hugging Face config.json declares are kept in generation_config.json. Returns the
  names copied."""
  source, run_dir = Path(source), Path(run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  copied = []
  for name in TOKENIZER_FILES:
    if (source / name).is_file() and (source / name).resolve() != (run_dir / name).resolve():
      shutil.copyfile(source / name, run_dir / name)
      copied.append(name)
  config = model_files.read_json(source / "config.json") or {}
  ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
  if ids and "generation_config.json" not in copied:
    (run_dir / "generation_config.json").write_text(json.dumps(ids, indent=2))
    copied.append("generation_config.json")
  return copied
