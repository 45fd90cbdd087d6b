"""Hugging Face import and export, one module per family.

    model = atlas_jax.hf.load("path/to/folder")          # config.json + *.safetensors
    logits_BTV = model(tokens_BT)                          # matches transformers' logits
    tokenizer = atlas_jax.hf.load_tokenizer("path/to/folder")
    atlas_jax.hf.save(model, "path/to/out")              # transformers loads it back

Families (model_type -> module): llama, mistral, qwen2, qwen3 (`llama`); mixtral (`mixtral`);
qwen2_moe, qwen3_moe (`qwen_moe`); olmoe (`olmoe`); deepseek_v2, deepseek_v3 (`deepseek`); phi3
(`phi3`: Phi-3, Phi-4); glm4_moe (`glm4_moe`: GLM-4.5, GLM-4.6). Each
maps config.json onto a `ModelConfig` (`config_from_hf`), describes its stored tensors
(`spec`, a table `atlas_jax.hf.weights` reads both ways) and writes config.json back
(`config_to_hf`); the checks every family needs (config fields, tensor names and shapes, the
model's own shapes) are written once, in `common` and `weights`. Weights are read with safetensors
straight into jax arrays (single file or sharded with an index), converted from torch's
[out, in] layouts into ours, and stacked over layers.

FP8 folders (config.json's `quant_method: fp8`, per-tensor or block scales) keep their
projections' e4m3 codes and scales as the model's quantized weights where its layout holds their
blocks, dequantizing the rest (`fp8`); `gguf_file` (a llama.cpp GGUF file, mapped onto the same
names and config.json fields, so the families' tables check it as they do a folder) loads
dequantized.

Beside the families, for fine-tuning: `init_from` (a folder's or a run's weights placed shard by
shard into a run's parameter shardings, train.init_from), `export` (a train.py run as a folder of
any family `save` writes, LoRA adapters merged or kept apart for PEFT; the CLI
`python -m atlas_jax.hf export`) and `tokenizer` (a folder's tokenizer with the special tokens
its files declare, and a run's).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from safetensors.numpy import save_file

from atlas_jax.config import ModelConfig
from atlas_jax.hf import (
  deepseek,
  fp8,
  gemma,
  gguf_file,
  glm4_moe,
  gpt_oss,
  llama,
  mixtral,
  mxfp4,
  olmo2,
  olmoe,
  phi3,
  qwen_moe,
  smollm3,
)
from atlas_jax.hf.common import REQUIRED, HFLoadError, field, llama_scoring, read_json
from atlas_jax.hf.weights import (
  build_model,
  check_tensor_shapes,
  params_from_tensors,
  read_safetensors,
  tensor_names,
  tensors_from_params,
)
from atlas_jax.model import Transformer

log = logging.getLogger(__name__)

FAMILIES = {
  t: module
  for module in (
    llama,
    mixtral,
    qwen_moe,
    olmoe,
    deepseek,
    glm4_moe,
    gemma,
    olmo2,
    smollm3,
    phi3,
    gpt_oss,
  )
  for t in module.MODEL_TYPES
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

__all__ = [
  "FAMILIES",
  "REQUIRED",
  "SUPPORTED_MODEL_TYPES",
  "HFLoadError",
  "build_model",
  "check_tensor_shapes",
  "config_from_hf",
  "config_to_hf",
  "field",
  "folder_config",
  "load",
  "load_config",
  "load_tokenizer",
  "read_safetensors",
  "save",
  "tensor_names",
  "tensor_shapes",
]


def _family(hf: Mapping[str, Any]):
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise HFLoadError(
      f"model_type={model_type!r} (architectures={hf.get('architectures')}) is not supported; "
      f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
  return FAMILIES[model_type]


def config_from_hf(
  hf: Mapping[str, Any], *, dtype: str = "float32", names: set[str] | None = None
) -> ModelConfig:
  """Maps a transformers config.json dict onto a ModelConfig, rejecting what we cannot run.

  `names`: the checkpoint's tensor names, where they decide the config (DeepSeek's stored MTP
  modules); None reads config.json alone.
  """
  return _family(hf).config_from_hf(hf, dtype=dtype, names=names)


def load_config(path: str | Path, *, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a folder's config.json, or a GGUF file's metadata (no weights read)."""
  if gguf_file.is_gguf(path):
    return config_from_hf(gguf_file.file_config(path), dtype=dtype)
  return config_from_hf(read_json(Path(path) / "config.json"), dtype=dtype)


def folder_config(path: str | Path, *, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig `load` gives a folder, from config.json and the safetensors headers alone
  (the stored names decide DeepSeek's MTP heads), or a GGUF file's metadata; no weight is read."""
  if gguf_file.is_gguf(path):
    return load_config(path, dtype=dtype)
  hf_config = read_json(Path(path) / "config.json")
  config_from_hf(hf_config, dtype=dtype)  # reject unsupported configs before the files
  return config_from_hf(hf_config, dtype=dtype, names=tensor_names(path))


def tensor_shapes(hf: Mapping[str, Any], names: set[str] | None = None) -> dict[str, tuple]:
  """Every tensor a checkpoint with this config.json holds -> its shape (torch's layout)."""
  family = _family(hf)
  cfg = family.config_from_hf(hf, names=names)
  return {n: shape for n, (shape, _) in family.spec(cfg, hf, names).shapes().items()}


FP8_WEIGHTS = ("keep", "dequantize")
FP8_ACTIVATIONS = (None, "static", "dynamic", "none")
GGUF_WEIGHTS = ("keep", "dequantize")


def load(
  path: str | Path,
  *,
  dtype: str = "float32",
  implementation: str | None = None,
  fp8_weights: str = "keep",
  fp8_activations: str | None = None,
  gguf_weights: str = "keep",
) -> Transformer:
  """Loads a Hugging Face folder (config.json + *.safetensors) or a GGUF file into a Transformer.

  FP8 folders' projections are kept as they ship where the model's layout holds their scales'
  blocks (`fp8_weights`), every other FP8 tensor, MXFP4 folders (`quant_method: mxfp4`) and
  GGUF's quantized tensors are dequantized at load, exactly, to `dtype` (`fp8`, `mxfp4`,
  `gguf_file`).

  Args:
    path: a local folder saved by transformers' `save_pretrained` (or downloaded from the Hub),
      or a llama.cpp GGUF file (architectures llama, which holds Mistral's too, qwen2, qwen3).
    dtype: parameter and compute dtype, "float32", "bfloat16" or "float16" (routers stay
      float32).
    implementation: attention implementation passed to `atlas_jax.kernels.attention`.
    fp8_weights: an FP8 folder's projections "keep" their e4m3 codes and scales on the device
      where the model's layout can hold the scales' blocks (`fp8`), or all are "dequantize"d.
    fp8_activations: with kept FP8 weights, "dynamic" multiplies them by activations quantized
      to e4m3 per token (W8A8), "static" by activations quantized with the folder's static
      input scales (activation_scheme "static"), "none" dequantizes the weights in the step
      (weight-only); None picks by the default backend: W8A8 where it has FP8 matmuls (cuda,
      tpu), static when the folder has input scales.
    gguf_weights: a GGUF file's Q8_0, Q4_0 and Q6_K projections "keep" their int8/int4 codes
      and per-32 (Q6_K: per-16) scales on the device (exact: `gguf_file.read_kept`), or all
      are "dequantize"d.

  Returns:
    The model; its ModelConfig is `model.cfg`.
  """
  if fp8_weights not in FP8_WEIGHTS:
    raise HFLoadError(f"fp8_weights={fp8_weights!r} is not one of {FP8_WEIGHTS}")
  if fp8_activations not in FP8_ACTIVATIONS:
    raise HFLoadError(f"fp8_activations={fp8_activations!r} is not one of {FP8_ACTIVATIONS}")
  if gguf_weights not in GGUF_WEIGHTS:
    raise HFLoadError(f"gguf_weights={gguf_weights!r} is not one of {GGUF_WEIGHTS}")
  folder = Path(path)
  scales = None
  if gguf_file.is_gguf(folder):
    r = gguf_file.reader(folder)
    hf_config = gguf_file.config(r)
    family = _family(hf_config)
    family.config_from_hf(hf_config, dtype=dtype)  # reject unsupported configs before the weights
    if gguf_weights == "keep":
      tensors, scales, report = gguf_file.read_kept(r, hf_config, jnp.dtype(dtype))
      log.info(
        "%s: GGUF projections kept quantized (weight-only, one float32 scale per 32 inputs, 16 "
        "for Q6_K): %s; dequantized to %s at load: %s (embeddings, LM head, norms, types with "
        "an offset or minimum, Q4_1/Q5_0/Q5_1/Q2_K..Q5_K, and layers' types that differ)",
        folder,
        report["kept"] or "none",
        dtype,
        report["dequantized"] or "none",
      )
    else:
      tensors = gguf_file.read_tensors(r, hf_config, jnp.dtype(dtype))
      log.info("%s: GGUF tensors dequantized to %s at load", folder, dtype)
  elif not folder.is_dir():
    raise HFLoadError(f"{folder} is not a folder or a GGUF file")
  else:
    hf_config = read_json(folder / "config.json")
    family = _family(hf_config)
    family.config_from_hf(hf_config, dtype=dtype)  # reject unsupported configs before the weights
    tensors = read_safetensors(folder)
    if mxfp4.applies(hf_config):  # gpt-oss's released experts
      tensors = mxfp4.dequantize_tensors(tensors, dtype=dtype, where=folder)
    elif fp8_weights == "keep":
      tensors, scales = fp8.split_scales(tensors, hf_config, where=folder)
      if scales is not None:
        scales = fp8.resolve_activations(scales, fp8_activations, jax.default_backend())
    else:
      tensors = fp8.dequantize_tensors(tensors, hf_config, dtype=dtype, where=folder)
  names = set(tensors)
  cfg = family.config_from_hf(hf_config, dtype=dtype, names=names)
  params = params_from_tensors(tensors, family.spec(cfg, hf_config, names), cfg, scales=scales)
  ops = None
  if scales is not None and not gguf_file.is_gguf(folder):
    ops = fp8.log_kept(scales, folder, dtype=dtype)
  return build_model(cfg, params, implementation=implementation, ops=ops)


def load_tokenizer(path: str | Path):
  """The `tokenizers.Tokenizer` saved beside the weights as tokenizer.json."""
  from tokenizers import Tokenizer

  file = Path(path) / "tokenizer.json"
  if not file.is_file():
    raise HFLoadError(f"{Path(path)}: no tokenizer.json")
  try:
    return Tokenizer.from_file(str(file))
  except Exception as e:  # the tokenizers library raises a bare Exception
    raise HFLoadError(f"{file}: not a readable tokenizer ({e})") from e


# ---------------------------------------------------------------------------------------------
# Export: our model -> a folder transformers can load.

# Tried in order: the first family whose `model_type(cfg)` names a model type writes the folder.
# The families after `_PATTERNED` hold only blocks of Llama's layout (`_llama_blocks`).
_PATTERNED = (gpt_oss, gemma, olmo2, smollm3)
_EXPORTERS = (*_PATTERNED, deepseek, glm4_moe, olmoe, qwen_moe, mixtral, phi3, llama)


def _llama_blocks(cfg: ModelConfig) -> bool:
  """Pre-norm SwiGLU blocks, every layer's attention alike, nothing capped or rescaled."""
  return (
    cfg.pre_norms
    and not cfg.post_norms
    and cfg.layer_types is None
    and not cfg.nope_layers
    and llama_scoring(cfg)
  )


def _exporter(cfg: ModelConfig):
  for module in _EXPORTERS:
    if module not in _PATTERNED and not _llama_blocks(cfg):
      continue
    kind = module.model_type(cfg)
    if kind is not None:
      return module, kind
  raise HFLoadError(
    "no Hugging Face family holds this model config (supported: "
    f"{', '.join(SUPPORTED_MODEL_TYPES)}): {cfg}"
  )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json of the family that holds `cfg`."""
  return _exporter(cfg)[0].config_to_hf(cfg)


def save(model: Transformer, path: str | Path) -> None:
  """Writes config.json and model.safetensors in Hugging Face's layout (round-trips with load and
  with transformers): the experts per expert, as the published checkpoints store them."""
  cfg = model.cfg
  family, _ = _exporter(cfg)
  hf_config = family.config_to_hf(cfg)
  tensors = tensors_from_params(model, family.spec(cfg, hf_config, None))
  folder = Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  save_tensors(tensors, folder / "model.safetensors")
  (folder / "config.json").write_text(json.dumps(hf_config, indent=2))


def save_tensors(tensors: dict, path: str | Path) -> None:
  """A safetensors file with the permissions of any file written here (0644 under the usual
  umask): safetensors' writer makes it readable by its owner only."""
  save_file(tensors, str(path), metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)
