"""What a model folder says about serving it beyond its weights: its tokenizer and special
tokens, its chat template, generation_config.json's sampling defaults and its dtype. A GGUF file
holds its tokenizer, special tokens and chat template in its metadata (`atlas_jax.hf.gguf_file`).

Special tokens follow transformers:
* the eos ids come from generation_config.json's `eos_token_id` (an id or a list:
  Llama-3-Instruct ends on <|end_of_text|> and <|eot_id|>), else config.json's, else
  tokenizer_config.json's `eos_token`: the first file that names them wins.
* a BOS is added where the tokenizer's post-processor (tokenizer.json) adds one, which is what
  transformers' default encoding does (it does not consult `add_bos_token` beside it).
A folder with none of these files (a train.py run's own BPE, with <s> and </s>) falls back to the
usual names (`atlas_jax.data.tokenizer.HFTokenizer`).

Sampling defaults follow vLLM's `--generation-config auto`: generation_config.json's
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as the
default `max_tokens`) become request defaults. As in transformers, the sampling ones count only
with `do_sample: true` (without it, transformers decodes greedily).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_jax.hf import gguf_file
from atlas_jax.hf.tokenizer import eos_ids, load_tokenizer, read_json, token_text
from atlas_jax.serving.chat import ChatTemplate

__all__ = [
  "chat_template",
  "checkpoint_dtype",
  "eos_ids",
  "generation_defaults",
  "load_tokenizer",
  "read_json",
]

# Special tokens a chat template may read, as transformers passes them.
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
# generation_config.json fields that become request defaults, by their API names.
GENERATION_FIELDS = {
  "temperature": "temperature",
  "top_p": "top_p",
  "top_k": "top_k",
  "min_p": "min_p",
  "repetition_penalty": "repetition_penalty",
  "max_new_tokens": "max_tokens",
}


def chat_template(folder: str | Path, tokenizer, override: str | None = None):
  """The chat template to serve: `override` (a file, or the template itself, as vLLM's
  `--chat-template` takes), else the folder's (tokenizer_config.json's `chat_template`, or
  chat_template.jinja, or a GGUF file's `tokenizer.chat_template`); None when there is none."""
  folder = Path(folder)
  if override is None and gguf_file.is_gguf(folder):
    parts = gguf_file.tokenizer_parts(folder)
    if parts["chat_template"] is None:
      return None
    where = f"{folder} tokenizer.chat_template"
    return ChatTemplate(parts["chat_template"], special_tokens=parts["special_tokens"], where=where)
  config = read_json(folder / "tokenizer_config.json")
  settings = config or {}
  if override is not None:
    path = Path(override)
    if path.is_file():
      source, where = path.read_text(encoding="utf-8"), f"--chat-template={override}"
    elif "{{" in override or "{%" in override:
      source, where = override, "--chat-template"
    else:
      raise ValueError(
        f"--chat-template={override!r}: no such file, and not a template (no '{{{{' or '{{%')"
      )
  else:
    source, where = (
      settings.get("chat_template"),
      f"{folder / 'tokenizer_config.json'} chat_template",
    )
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    if source is None and (folder / "chat_template.jinja").is_file():
      where = str(folder / "chat_template.jinja")
      source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(source, str):
      return None
  if config is not None:  # the special tokens transformers hands a template
    special = {k: t for k in TEMPLATE_TOKENS if (t := token_text(config.get(k)))}
  else:  # a run's own tokenizer
    special = {k: v for k in ("bos_token", "eos_token") if (v := getattr(tokenizer, k, None))}
  return ChatTemplate(source, special_tokens=special, where=where)


def generation_defaults(folder: str | Path) -> tuple[dict[str, Any], str]:
  """({API field: value} from generation_config.json, the file) ({} when it has none)."""
  path = Path(folder) / "generation_config.json"
  data = read_json(path) or {}
  out = {}
  for name, api_name in GENERATION_FIELDS.items():
    value = data.get(name)
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int | float):
      raise ValueError(f"{path} field '{name}'={value!r} is not allowed: must be a number")
    if data.get("do_sample") is True or name in ("repetition_penalty", "max_new_tokens"):
      out[api_name] = int(value) if name in ("top_k", "max_new_tokens") else float(value)
  return out, str(path)


def checkpoint_dtype(folder: str | Path) -> str | None:
  """config.json's `dtype` (`torch_dtype` before transformers v5), or None."""
  data = read_json(Path(folder) / "config.json") or {}
  value = data.get("dtype", data.get("torch_dtype"))
  return value if isinstance(value, str) else None
