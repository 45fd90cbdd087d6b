"""A train.py run as a Hugging Face folder (`python -m atlas_jax.hf export`).

The folder holds what transformers and serve.py read: config.json (with the special token ids)
and model.safetensors (`atlas_jax.hf.save`), the tokenizer files, the chat template and
generation_config.json. A run that fine-tuned a Hugging Face folder exports that folder's own
tokenizer files, template and generation defaults; a run's own BPE exports as a
`PreTrainedTokenizerFast` with its special tokens, the run's sampling defaults and, for chats, the
plain "role: content" transcript serve.py rendered it with, written as a template; a byte-level
run exports no tokenizer file (serve.py reads such a folder as bytes).

Every family `atlas_jax.hf.save` writes exports (Llama, Mistral, Qwen2/3, the mixture-of-experts
families, DeepSeek's MLA). LoRA adapters are merged into the weights they adapt
(`--adapters merged`, the default), or kept apart (`--adapters separate`, grouped-query attention
families): the folder then holds the base model unchanged and `adapter/` holds the adapters as
PEFT writes them (`adapter_config.json`, `adapter_model.safetensors`), which
`peft.PeftModel.from_pretrained` loads onto it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from atlas_jax import hf
from atlas_jax.config import Config
from atlas_jax.hf.tokenizer import run_tokenizer
from atlas_jax.model import build
from atlas_jax.model.lora import LoRA, merged_params
from atlas_jax.model.transformer import layer_stacks
from atlas_jax.training import checkpoint

# What a model folder holds besides its weights that a run keeps with it and exports again.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "generation_config.json",
)
# The plain transcript serve.py renders chats with when a model has no template
# (`atlas_jax.serving.chat.PlainChatTemplate`), as a template transformers renders the same.
PLAIN_TEMPLATE = (
  "{% for message in messages %}{{ message['role'] }}: "
  "{{ message['content'] if message['content'] is defined else '' }}\n{% endfor %}"
  "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Our adapted weights -> the module names of the GQA families (Llama, Mistral, Qwen, Mixtral,
# OLMoE alike), for PEFT.
_PEFT_NAMES = {
  ("attn", "wq"): "self_attn.q_proj",
  ("attn", "wk"): "self_attn.k_proj",
  ("attn", "wv"): "self_attn.v_proj",
  ("attn", "wo"): "self_attn.o_proj",
  ("mlp", "w_gate"): "mlp.gate_proj",
  ("mlp", "w_up"): "mlp.up_proj",
  ("mlp", "w_down"): "mlp.down_proj",
}
ADAPTER_MODES = ("merged", "separate")


class ExportError(ValueError):
  """A run that cannot be exported as asked."""


def _model(cfg: Config, params: dict) -> nnx.Module:
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build(cfg.model, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def _special_ids(tokenizer) -> dict[str, Any]:
  """config.json's token ids: the tokenizer's, as serve.py reads them (the eos ids of the source
  folder's files, several where it has several)."""
  ids: dict[str, Any] = {}
  if tokenizer.bos_id >= 0:
    ids["bos_token_id"] = tokenizer.bos_id
  eos = list(tokenizer.eos_ids)
  if eos:
    ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
  if tokenizer.pad_id >= 0:
    ids["pad_token_id"] = tokenizer.pad_id
  return ids


def _tokenizer_files(run: Path, out: Path, cfg: Config, tokenizer) -> list[str]:
  """Copies the run's tokenizer files, or writes what transformers needs for its own BPE."""
  written = []
  for name in TOKENIZER_FILES:
    if (run / name).is_file():
      shutil.copyfile(run / name, out / name)
      written.append(name)
  if "tokenizer.json" in written and "tokenizer_config.json" not in written:
    token = lambda i: tokenizer.decode([i], skip_special_tokens=False) if i >= 0 else None
    settings = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": token(tokenizer.bos_id),
      "eos_token": token(tokenizer.eos_id),
      "pad_token": token(tokenizer.pad_id),
      "model_max_length": cfg.model.max_seq_len,
      "chat_template": PLAIN_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    written.append("tokenizer_config.json")
  if "generation_config.json" not in written:
    s = cfg.serve.sampling  # the run's sampling defaults, as serve.py applied them to the run
    generation: dict[str, Any] = {
      **_special_ids(tokenizer),
      "max_new_tokens": s.max_new_tokens,
    }
    if s.temperature > 0:
      generation.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
      if s.top_k:
        generation["top_k"] = s.top_k
    generation.pop("pad_token_id", None)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    written.append("generation_config.json")
  return written


def _peft_adapter(trained: nnx.Module, cfg: Config, base: Path) -> tuple[dict, dict]:
  """(tensors, adapter_config.json) of the adapters in PEFT's layout: lora_A [r, in] and
  lora_B [out, r] per module and layer."""
  lo = cfg.train.lora
  # Each stack's index -> the layer it is (dense and MoE layers are stacked apart).
  layers = {where: i for i, where in enumerate(layer_stacks(cfg.model))}
  tensors, modules = {}, set()
  for path, node in nnx.iter_graph(trained):
    if not isinstance(node, LoRA):
      continue
    *parent, name = path
    key = (parent[-1], name.removesuffix("_lora"))
    if parent[0] not in ("blocks", "dense_blocks") or key not in _PEFT_NAMES:
      raise ExportError(
        f"--adapters separate: the adapter {'/'.join(map(str, path))} has no PEFT module name "
        "(grouped-query attention families only, no MTP heads); export with --adapters merged"
      )
    module = _PEFT_NAMES[key]
    modules.add(module.split(".")[-1])
    a, b = np.asarray(node.a[...], np.float32), np.asarray(node.b[...], np.float32)
    A = a.shape[-1]
    for j in range(a.shape[0]):
      prefix = f"base_model.model.model.layers.{layers[parent[0], j]}.{module}"
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, A).T)
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[j].reshape(A, -1).T)
  config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": str(base.absolute()),
    "r": lo.rank,
    "lora_alpha": lo.alpha,
    "lora_dropout": 0.0,
    "target_modules": sorted(modules),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "inference_mode": True,
  }
  return tensors, config


def export(run: str | Path, out: str | Path, *, adapters: str = "merged") -> list[str]:
  """Writes run `run`'s newest intact step as a Hugging Face folder `out`; returns its files.

  Raises:
    ExportError, ValueError or HFLoadError naming what cannot be exported.
  """
  run, out = Path(run), Path(out)
  if adapters not in ADAPTER_MODES:
    raise ExportError(f"--adapters={adapters!r} is not allowed: one of {ADAPTER_MODES}")
  if not checkpoint.is_checkpoint(run):
    raise ExportError(f"--checkpoint={str(run)!r} is not a train.py run directory (no config.yaml)")
  trained, cfg = checkpoint.load_trained(run)
  if adapters == "separate" and cfg.train.lora is None:
    raise ExportError(f"--adapters separate: the run {run} has no LoRA adapters (train.lora)")
  if adapters == "merged":
    params = merged_params(trained)
  else:  # the base weights alone, as the run began; the adapters checked before any write
    params = _drop_adapters(nnx.to_pure_dict(nnx.state(trained)))
    peft_tensors, peft_config = _peft_adapter(trained, cfg, out)
  out.mkdir(parents=True, exist_ok=True)
  hf.save(_model(cfg, params), out)
  tokenizer = run_tokenizer(run, cfg.model.vocab_size)
  config = json.loads((out / "config.json").read_text())
  config.update(_special_ids(tokenizer))
  (out / "config.json").write_text(json.dumps(config, indent=2))
  files = ["config.json", "model.safetensors", *_tokenizer_files(run, out, cfg, tokenizer)]
  if adapters == "separate":
    (out / "adapter").mkdir(exist_ok=True)
    hf.save_tensors(peft_tensors, out / "adapter/adapter_model.safetensors")
    (out / "adapter/adapter_config.json").write_text(json.dumps(peft_config, indent=2))
    files += ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
  return files


def _drop_adapters(params: dict) -> dict:
  return {
    k: _drop_adapters(v) if isinstance(v, dict) else v
    for k, v in params.items()
    if not k.endswith("_lora")
  }
