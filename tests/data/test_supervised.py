"""Supervised examples: chats tokenised as serve.py and transformers tokenise them, the loss mask
on exactly the answers through packing, the masked loss blind to prompt targets (plain, chunked
and MTP), and each bad line named by file, line and field."""

import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

transformers = pytest.importorskip("transformers")

from atlas_jax import sources  # noqa: E402
from atlas_jax.config import ModelConfig, MTPConfig  # noqa: E402
from atlas_jax.data import supervised  # noqa: E402
from atlas_jax.data.tokenizer import ByteTokenizer  # noqa: E402
from atlas_jax.model import build  # noqa: E402
from atlas_jax.serving.engine import EngineConfig  # noqa: E402
from atlas_jax.training import mtp  # noqa: E402
from atlas_jax.training.loss import chunked_cross_entropy, cross_entropy  # noqa: E402

from ..serving.conftest import serving  # noqa: E402
from ..serving.hf_folders import build_folder  # noqa: E402

CHAT = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "What is the capital of France?"},
  {"role": "assistant", "content": "Paris."},
  {"role": "user", "content": "And of Italy?"},
  {"role": "assistant", "content": [{"type": "text", "text": "Rome."}]},
]


@pytest.fixture(scope="module", params=["qwen", "llama3"])
def folder(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  build_folder(request.param, path)
  tok = sources.tokenizer(path, 10**6)
  return path, tok, sources.chat_template(path, tok)


def test_chat_tokens_are_what_serving_and_transformers_give(folder):
  path, tok, template = folder
  ids, mask = supervised.encode_chat(tok, template, CHAT, "chat.jsonl:1")
  hf_tok = transformers.AutoTokenizer.from_pretrained(path)
  plain = [dict(m, content=supervised_text(m)) for m in CHAT]
  assert ids == hf_tok.apply_chat_template(plain, tokenize=True, return_dict=False)
  small = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=256)
  model = build(ModelConfig(vocab_size=tok.vocab_size, **small), rngs=nnx.Rngs(0))
  config = EngineConfig(n_blocks=16, max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk=64)
  runs = []
  with serving(model, tok, config, model_name="m", chat_template=template) as (url, _, _):
    for i in (2, 4):  # each assistant message: the request serve.py would get before it
      request = httpx.post(url + "/tokenize", json={"messages": CHAT[:i]}, timeout=60).json()
      prompt = hf_tok.apply_chat_template(
        plain[:i], add_generation_prompt=True, tokenize=True, return_dict=False
      )
      assert request["tokens"] == prompt == ids[: len(prompt)]
      assert sum(mask[: len(prompt)]) == sum(runs)  # earlier answers only, no prompt
      n = _run(mask, len(prompt))  # the answer: the tokens right after the request's
      text = tok.decode(ids[len(prompt) : len(prompt) + n], skip_special_tokens=False)
      # The message, then the template's end of turn: the stop the served model must learn.
      assert text.startswith(plain[i]["content"])
      assert any(e in text for e in ("<|im_end|>", "<|eot_id|>"))
      runs.append(n)
  assert sum(mask) == sum(runs)  # nothing else counts


def supervised_text(m):
  c = m["content"]
  return c if isinstance(c, str) else "\n".join(p["text"] for p in c)


def _run(mask, start):
  n = 0
  while start + n < len(mask) and mask[start + n]:
    n += 1
  return n


def write(path, lines):
  path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
  return path


def test_the_mask_covers_the_answers_through_packing(tmp_path):
  tok = ByteTokenizer()
  lines = [{"prompt": f"q{i}=", "completion": f"a{i}"} for i in range(5)]
  lines.append({"prompt": "x" * 40, "completion": "never"})  # longer than a row: cut
  data = write(tmp_path / "c.jsonl", lines)
  train, _ = supervised.tokenize_examples(data, "completion", tok, None, eval_fraction=0.0)
  rows = supervised.PackedExamples(train, seq_len=15, pad_id=tok.pad_id)
  assert rows.packing.cut == 1 and rows.packing.cut_empty == 1
  assert "1 longer than train.seq_len + 1 = 16 were cut" in rows.packing.describe(15)
  seen = []
  for r in (rows[i] for i in range(len(rows))):
    counted = r["loss_mask"] > 0  # position t counts when it predicts an answer token
    seen.append("".join(chr(x) if x < 256 else "|" for x in r["tokens"][1:][counted]))
  # Exactly each completion and its eos, nothing of a prompt or of the padding.
  assert "".join(seen) == "".join(f"a{i}|" for i in range(5))


TINY = dict(vocab_size=259, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


@pytest.mark.parametrize("kind", ["plain", "chunked", "mtp"])
def test_prompt_targets_leave_the_gradient_unchanged(tmp_path, kind):
  """Replacing the target of every prompt position leaves the masked loss's gradient bitwise
  unchanged; replacing one answer token's target changes it. (The inputs stay: a prompt token
  also conditions the answer after it, as it must.)"""
  tok = ByteTokenizer()
  data = write(
    tmp_path / "c.jsonl", [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(6)]
  )
  train, _ = supervised.tokenize_examples(data, "completion", tok, None, eval_fraction=0.0)
  row = supervised.PackedExamples(train, seq_len=31, pad_id=tok.pad_id)[0]
  batch = {k: jnp.asarray(v)[None] for k, v in row.items()}
  mask = batch["loss_mask"]
  inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
  cfg = ModelConfig(**TINY, mtp=MTPConfig(n_predict=2) if kind == "mtp" else None)
  graphdef, params = nnx.split(build(cfg, rngs=nnx.Rngs(0)))
  kw = dict(positions_BT=batch["positions"], segment_ids_BT=batch["segment_ids"])

  def loss(params, targets):
    model = nnx.merge(graphdef, params)
    if kind == "plain":
      return cross_entropy(model(inputs, **kw), targets, mask)[0]
    h = model.hidden_states(inputs, **kw) if kind == "chunked" else None
    if kind == "chunked":
      return chunked_cross_entropy(h, targets, mask, chunk=8, **model.output_head())[0]
    # Every MTP head's targets and mask, shifted from the same next-token ones.
    _, mtp_J = model.forward_mtp(inputs, **kw)
    total = 0.0
    for j in range(1, 3):
      t_j, m_j = mtp.shifted_targets(targets, mask, batch["segment_ids"], j)
      total += cross_entropy(mtp_J[j - 1], t_j, m_j)[0]
    return total

  prompt = np.asarray(mask[0]) == 0
  swapped = jnp.where(jnp.asarray(prompt)[None], (targets + 7) % 256, targets)
  grad = jax.jit(jax.grad(loss))
  grads_of = lambda t: jax.tree.leaves(grad(params, t))
  base = grads_of(targets)
  for a, b in zip(base, grads_of(swapped)):
    np.testing.assert_array_equal(a, b)
  first_answer = int(np.flatnonzero(~prompt)[0])
  changed = targets.at[0, first_answer].add(1)
  assert any(not np.array_equal(a, b) for a, b in zip(base, grads_of(changed)))


@pytest.mark.parametrize(
  "fmt, line, names",
  [
    ("completion", {"prompt": "a"}, ["c.jsonl:2", "'completion'", "fields: ['prompt']"]),
    ("completion", {"prompt": 3, "completion": "b"}, ["c.jsonl:2", "'prompt'", "int"]),
    ("chat", {"text": "x"}, ["c.jsonl:2", "'messages'"]),
    ("chat", {"messages": []}, ["c.jsonl:2", "'messages'", "non-empty"]),
    ("chat", {"messages": [{"role": "user"}]}, ["c.jsonl:2", "'messages.0.content'"]),
    ("chat", {"messages": [{"content": "hi"}]}, ["c.jsonl:2", "'messages.0.role'"]),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, ["c.jsonl:2", "'assistant'"]),
    (
      "chat",
      {"messages": [{"role": "assistant", "content": [{"type": "image"}]}]},
      ["c.jsonl:2", "messages.0.content.0", "'image'"],
    ),
    ("chat", "[1, 2]", ["c.jsonl:2", "JSON object"]),
  ],
)
def test_a_bad_line_is_named_by_file_line_and_field(tmp_path, fmt, line, names):
  good = {"prompt": "a", "completion": "b"} if fmt == "completion" else {"messages": CHAT}
  data = write(tmp_path / "c.jsonl", [good, line])
  with pytest.raises(ValueError) as e:
    supervised.tokenize_examples(
      data, fmt, ByteTokenizer(), sources.chat_template(None, None), eval_fraction=0.0
    )
  for name in names:
    assert name in str(e.value), (name, str(e.value))
