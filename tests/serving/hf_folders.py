"""Tiny Hugging Face folders as real checkpoints ship them, built with transformers: random
weights, a BPE trained here with `tokenizers`, the special tokens, chat template and generation
config of four families.

* "llama": Llama-2-style tokenizer (SentencePiece-like, byte fallback) whose post-processor adds
  <s>; eos </s> in config.json; no chat template.
* "mistral": the same tokenizer, Mistral's [INST] template (it writes its own BOS), saved as
  chat_template.jinja.
* "qwen": byte-level BPE without a BOS, a ChatML template (with `{% break %}`) in
  tokenizer_config.json whose `eos_token` is <|endoftext|>; <|im_end|> is the eos in
  generation_config.json only, and the model always predicts it.
* "llama3": byte-level BPE whose post-processor adds <|begin_of_text|>, a Llama-3 header template
  (`strftime_now`), config.json's eos <|end_of_text|>, generation_config.json's two eos
  [<|end_of_text|>, <|eot_id|>] and sampling defaults (temperature 0.6, top_p 0.9).

In "llama", "mistral" and "llama3" the eos (<|eot_id|> in "llama3") is often, not always,
predicted: greedy completions stop after a few tokens, at a place that depends on the prompt.
"""

import json

import torch
import transformers
from tokenizers import (
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
  trainers,
)

from ..test_hf import build_hf

CORPUS = [
  "def foo(x):\n    return x + 1\n",
  "The quick brown fox jumps over the lazy dog.",
  "Hello, how are you today? I am fine, thank you.",
  "import os\nprint(os.getcwd())\n",
  "What is the capital of France? Paris is the capital of France.",
] * 40

MISTRAL_TEMPLATE = (
  "{{ bos_token }}{% for message in messages %}"
  "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
  "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
  "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
  "{% endfor %}"
)
CHATML_TEMPLATE = """{%- set ns = namespace(system=none) %}
{%- for message in messages %}
  {%- if message.role == 'system' %}
    {%- set ns.system = message.content %}
    {%- break %}
  {%- endif %}
{%- endfor %}
{%- set system = ns.system if ns.system is not none else 'You are helpful.' %}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- for message in messages %}
  {%- if message.role != 'system' %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
  {%- set system_message = messages[0]['content'] | trim %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
  {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2's pre-tokenizer (transformers rebuilds a qwen2 folder's tokenizer with it, as shipped).
QWEN_SPLIT = (
  r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
  r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIALS = {
  "llama": ["<unk>", "<s>", "</s>"],
  "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
  "llama3": [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
  ],
}


def train_tokenizer(kind: str) -> Tokenizer:
  specials = SPECIALS["llama" if kind == "mistral" else kind]
  if kind in ("llama", "mistral"):  # SentencePiece-style: U+2581 for spaces, <0xAB> bytes
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
      [
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
      ]
    )
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=specials + alphabet, show_progress=False
    )
  else:  # byte-level, as GPT-2, Llama 3 and Qwen
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == "qwen":
      tok.normalizer = normalizers.NFC()
      tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
          pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
      )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
      vocab_size=360,
      special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
    )
  tok.train_from_iterator(CORPUS, trainer)
  bos = {"llama": "<s>", "mistral": "<s>", "llama3": "<|begin_of_text|>"}.get(kind)
  if bos is not None:
    tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
  return tok


def _bias_towards(model, token: int, beta: float, *, always: bool) -> None:
  """Makes `token` likely (often the argmax) or, with `always`, the argmax everywhere.

  The eos row of the LM head gains beta times the mean final hidden state over random inputs
  (scaled by its squared norm); for `always`, a large constant value bias (Qwen2 has one) first
  makes every position's hidden state point the same way.
  """
  with torch.no_grad():
    if always:
      for layer in model.model.layers:
        layer.self_attn.v_proj.bias.fill_(20.0)
    V = model.config.vocab_size
    tokens = torch.randint(0, V, (8, 24), generator=torch.Generator().manual_seed(1))
    h = (
      model(tokens, output_hidden_states=True)
      .hidden_states[-1]
      .reshape(-1, model.config.hidden_size)
    )
    mean = h.mean(0)
    model.lm_head.weight[token] += beta * mean / mean.norm() ** 2


def build_folder(kind: str, folder) -> dict:
  """Writes the folder; returns {"eos": the id transformers stops on, ...} for the tests."""
  tok = train_tokenizer(kind)
  ids = {t: tok.token_to_id(t) for t in SPECIALS["llama" if kind == "mistral" else kind]}
  family = {"llama": "Llama", "mistral": "Mistral", "qwen": "Qwen2", "llama3": "Llama"}[kind]
  overrides = dict(
    vocab_size=tok.get_vocab_size(),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
  )
  if kind in ("llama", "mistral"):
    overrides.update(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    special = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    stop = ids["</s>"]
  elif kind == "qwen":
    overrides.update(bos_token_id=None, eos_token_id=ids["<|endoftext|>"])
    special = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    stop = ids["<|im_end|>"]
  else:
    overrides.update(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"])
    special = dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    stop = ids["<|eot_id|>"]
  if kind == "mistral":
    overrides["sliding_window"] = None
  model = build_hf(family, folder, std=0.3, **overrides)
  _bias_towards(model, stop, 30.0 if kind == "qwen" else 3.0, always=kind == "qwen")
  model.save_pretrained(folder)
  generation = {
    "bos_token_id": overrides["bos_token_id"],
    "eos_token_id": overrides["eos_token_id"],
  }
  if kind == "qwen":
    generation["eos_token_id"] = stop
  if kind == "llama3":
    generation.update(
      eos_token_id=[ids["<|end_of_text|>"], stop], do_sample=True, temperature=0.6, top_p=0.9
    )
  (folder / "generation_config.json").write_text(json.dumps(generation))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)
  fast.save_pretrained(folder)
  config_file = folder / "tokenizer_config.json"
  settings = json.loads(config_file.read_text())
  if kind == "qwen":
    settings["bos_token"] = None
    settings["chat_template"] = CHATML_TEMPLATE
  elif kind == "llama3":
    settings["chat_template"] = LLAMA3_TEMPLATE
  config_file.write_text(json.dumps(settings))
  if kind == "mistral":
    (folder / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
  return {"eos": stop, "ids": ids}
