"""What a model folder says about serving it beyond its weights: its tokenizer and special
tokens, its chat template, generation_config.json's sampling defaults and its dtype.

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

import json
from pathlib import Path
from typing import Any

from atlas_jax import hf
from atlas_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from atlas_jax.serving.chat import ChatTemplate

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


def read_json(path: Path) -> dict[str, Any] | None:
  """A JSON object file, or None when there is none; ValueError naming it when malformed."""
  if not path.is_file():
    return None
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _ids(value, where: str) -> tuple[int, ...] | None:
  """An `eos_token_id` field: an id or a list of ids (None: absent)."""
  if value is None:
    return None
  ids = value if isinstance(value, list) else [value]
  if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"{where}={value!r} is not allowed: must be a token id or a list of them")
  return tuple(ids)


def eos_ids(folder: Path, tokenizer_config: dict | None, token_to_id) -> tuple[int, ...] | None:
  """The folder's eos ids in transformers' order of precedence (None: no file names any)."""
  for name in ("generation_config.json", "config.json"):
    data = read_json(folder / name) or {}
    ids = _ids(data.get("eos_token_id"), f"{folder / name} eos_token_id")
    if ids is not None:
      return ids
  eos = _token_text((tokenizer_config or {}).get("eos_token"))
  if eos is not None and token_to_id(eos) is not None:
    return (token_to_id(eos),)
  return None


def load_tokenizer(folder: str | Path, vocab_size: int):
  """The tokenizer of a Hugging Face folder, with its special tokens as its files declare them
  (a byte-level model of 259 tokens without tokenizer.json: `ByteTokenizer`)."""
  folder = Path(folder)
  if not (folder / "tokenizer.json").is_file():
    if vocab_size != ByteTokenizer.vocab_size:
      raise ValueError(f"{folder}: no tokenizer.json beside the weights")
    return ByteTokenizer()
  raw = hf.load_tokenizer(folder)
  settings = read_json(folder / "tokenizer_config.json")
  names = {}
  if settings is not None:  # it declares them: an absent or null token is none
    names = {k: _token_text(settings.get(f"{k}_token")) or "" for k in ("bos", "eos", "pad")}
  return HFTokenizer(raw, **names, eos_ids=eos_ids(folder, settings, raw.token_to_id))


def chat_template(folder: str | Path, tokenizer, override: str | None = None):
  """The chat template to serve: `override` (a file, or the template itself, as vLLM's
  `--chat-template` takes), else the folder's (tokenizer_config.json's `chat_template`, or
  chat_template.jinja); None when there is none."""
  folder = Path(folder)
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
    special = {k: t for k in TEMPLATE_TOKENS if (t := _token_text(config.get(k)))}
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
