"""Incremental detokenisation: the pieces add up to the full decode, characters are never split,
and the work per token is bounded."""

import numpy as np
import pytest

from atlas_jax.data.tokenizer import ByteTokenizer, train_bpe
from atlas_jax.decoding import SamplingParams
from atlas_jax.serving.detokenize import IncrementalDetokenizer
from atlas_jax.serving.engine import Engine, EngineConfig

TEXTS = [
  "def café(x):\n    return 'naïve' + x  # ünïcödé ok",
  "émoji 🙂 and CJK 漢字 mixed with ascii",
  "plain text, nothing special at all",
]


class CountingDecode:
  """A tokenizer's decode that counts the tokens it is asked to decode."""

  def __init__(self, decode):
    self.decode, self.tokens = decode, 0

  def __call__(self, ids):
    self.tokens += len(ids)
    return self.decode(ids)


def stream(decode, ids):
  detok = IncrementalDetokenizer(decode)
  pieces = [detok.push(t) for t in ids]
  pieces.append(detok.flush())
  return pieces


@pytest.fixture(scope="module")
def bpe():
  return train_bpe(TEXTS * 20, vocab_size=300)


@pytest.mark.parametrize("which", ["byte", "bpe"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_and_never_split_a_character(which, text, bpe):
  tok = ByteTokenizer() if which == "byte" else bpe
  ids = tok.encode(text)
  pieces = stream(tok.decode, ids)
  assert "".join(pieces) == tok.decode(ids) == text
  # Valid UTF-8 in, so no piece may carry half a character (a replacement character).
  assert not any("\ufffd" in p for p in pieces)
  if which == "byte":
    # A character's bytes are emitted together, with the token that completes it.
    assert [p for p in pieces if p] == [c for c in text]


def test_work_per_token_is_bounded():
  tok = ByteTokenizer()
  ids = tok.encode("naïve café 🙂 " * 200)
  decode = CountingDecode(tok.decode)
  stream(decode, ids)
  # Windows of a few tokens, decoded twice per token: linear in the stream, not quadratic.
  assert decode.tokens <= 10 * len(ids)


def test_invalid_bytes_still_add_up():
  tok = ByteTokenizer()
  ids = [0xC3, 0x41, 0xE2, 0x82, 0x41, 0xA9, 0xF0]  # truncated sequences and a lone continuation
  pieces = stream(tok.decode, ids)
  assert "".join(pieces) == tok.decode(ids)


def test_engine_streams_whole_characters(tiny_model):
  """Random tokens as UTF-8 lead, continuation and ASCII bytes: whatever the model draws, the
  streamed pieces add up to the decode of the whole output and split no valid character."""

  def decode(ids):
    table = {**{t: bytes([97 + t]) for t in range(20)}, **dict.fromkeys(range(20, 30), b"\xc3")}
    table.update(dict.fromkeys(range(30, 40), b"\xa9"))
    return b"".join(table[int(t)] for t in ids).decode("utf-8", errors="replace")

  engine = Engine(
    tiny_model,
    EngineConfig(
      runner="ragged", n_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64
    ),
    detokenize=decode,
  )
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 40, 5).tolist() for _ in range(4)]
  for i, p in enumerate(prompts):
    engine.add_request(i, p, SamplingParams(max_new_tokens=40, temperature=1.0, seed=i))
  text = {i: "" for i in range(4)}
  tokens = {i: [] for i in range(4)}
  while engine.has_unfinished():
    for out in engine.step():
      text[out.request_id] += out.text
      tokens[out.request_id] += out.new_token_ids
  for i in range(4):
    assert text[i] == decode(tokens[i])
  assert any("é" in t for t in text.values())  # the draws did form two-byte characters
