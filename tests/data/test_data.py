"""Tokenisers round-trip; the stdlib corpus is reproducible; the eval split is stable."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.config import ConfigError, DataConfig
from atlas_jax.data.corpus import iter_documents, stdlib_files
from atlas_jax.data.dataset import tokenize_corpus
from atlas_jax.data.pipeline import eval_shortfall, token_files, tokenizer_for
from atlas_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe


@given(st.text())
@settings(max_examples=50, deadline=None)
def test_byte_tokenizer_round_trips_any_text(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text


def test_bpe_trains_offline_and_round_trips(tmp_path):
  texts = [p.read_text() for p in stdlib_files()[:20]]
  tok = train_bpe(texts, vocab_size=512)
  assert tok.vocab_size == 512
  sample = "def f(x):\n    return x + 1  # ünïcode\n"
  ids = tok.encode(sample)
  assert len(ids) < len(sample.encode())  # merges compress
  assert tok.decode(ids) == sample
  tok.save(tmp_path / "tokenizer.json")
  again = load_tokenizer(str(tmp_path))
  assert again.encode(sample) == ids and again.eos_id == tok.eos_id


def test_stdlib_corpus_is_ordered_and_excludes_tests():
  files = stdlib_files()
  assert len(files) > 100
  rel = [f.relative_to(files[0].parents[0]).as_posix() for f in files]
  assert rel == sorted(rel)
  assert not any("/test/" in f"/{r}" or "site-packages" in r for r in rel)
  names = [n for n, _ in zip((n for n, _ in iter_documents("stdlib")), range(5))]
  assert names == [n for n, _ in zip((n for n, _ in iter_documents("stdlib")), range(5))]


def test_split_is_deterministic_and_disjoint(tmp_path):
  for i in range(40):
    (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} " * 20)
  tok = ByteTokenizer()
  train_a, eval_a = tokenize_corpus(str(tmp_path), tok, eval_fraction=0.25)
  train_b, eval_b = tokenize_corpus(str(tmp_path), tok, eval_fraction=0.25)
  np.testing.assert_array_equal(train_a.tokens, train_b.tokens)
  np.testing.assert_array_equal(eval_a.tokens, eval_b.tokens)
  assert len(eval_a.doc_starts) + len(train_a.doc_starts) == 40
  assert 0 < len(eval_a.doc_starts) < 40
  assert (train_a.tokens == tok.eos_id).sum() == len(train_a.doc_starts)


def test_jsonl_source(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text('{"text": "hello world"}\n\n{"text": "second document here"}\n')
  train, _ = tokenize_corpus(str(path), ByteTokenizer(), eval_fraction=0.0)
  assert len(train) == len("hello world") + len("second document here") + 2


@pytest.mark.parametrize(
  "lines, match",
  [
    (['{"text": "ok"}', '{"text": 7}'], r"data.jsonl:2: field 'text' must be a string, got int 7"),
    (['{"text": "ok"}', "", '{"text": "a", oops}'], r"data.jsonl:3: not valid JSON \(.* column"),
    (['{"text": "ok"}', "[1, 2]"], r"data.jsonl:2: expected a JSON object, got list"),
    (['{"txt": "ok"}'], r"data.jsonl:1: the object has no 'text' field \(fields: \['txt'\]\)"),
  ],
)
def test_jsonl_errors_name_the_file_line_and_field(tmp_path, lines, match):
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=match):
    tokenize_corpus(str(path), ByteTokenizer(), eval_fraction=0.0)


def test_jsonl_bytes_that_are_not_utf8_name_the_line(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
  with pytest.raises(ValueError, match=r"data.jsonl:2: not UTF-8 text"):
    tokenize_corpus(str(path), ByteTokenizer(), eval_fraction=0.0)


def test_token_cache_follows_the_content(tmp_path):
  path = tmp_path / "data.jsonl"
  cfg = DataConfig(source=str(path), eval_fraction=0.0)
  tok = ByteTokenizer()
  said = []
  read = lambda: np.asarray(token_files(cfg, tok, tmp_path / "cache", log=said.append)["train"][0])
  path.write_text('{"text": "first version"}\n')
  first = read()
  path.write_text('{"text": "other version"}\n')  # same size, changed: tokenised again
  os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
  second = read()
  assert tok.decode(first[:-1]) == "first version"
  assert tok.decode(second[:-1]) == "other version"
  assert len(said) == 1 and "changed since it was tokenised" in said[0]
  # Touched, not changed: the hash matches, the tokens are reused (the token file is not
  # rewritten).
  token_file = next((tmp_path / "cache").glob("*/train_tokens.npy"))
  written = token_file.stat().st_mtime_ns
  os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
  np.testing.assert_array_equal(read(), second)
  assert token_file.stat().st_mtime_ns == written and len(said) == 1


def test_a_retrained_tokenizer_tokenises_again(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text('{"text": "def f(x): return x"}\n')
  tok_file = tmp_path / "tokenizer.json"
  cfg = DataConfig(source=str(path), tokenizer=str(tok_file), eval_fraction=0.0)
  runs = []
  files = stdlib_files()
  for texts in ([f.read_text() for f in files[:4]], [f.read_text() for f in files[4:8]]):
    tok = train_bpe(texts, vocab_size=300)
    assert tok.vocab_size == 300  # the same size: only the content tells them apart
    tok.save(tok_file)
    ids = np.asarray(token_files(cfg, tok, tmp_path / "cache")["train"][0])
    runs.append(ids)
    assert ids[:-1].tolist() == tok.encode("def f(x): return x")
  assert runs[0].tolist() != runs[1].tolist()


def test_an_eval_split_too_small_says_so():
  tokens, starts = np.zeros(100, np.int32), np.zeros(3, np.int64)
  note = eval_shortfall(tokens, starts, seq_len=32, batch_size=8, eval_fraction=0.1)
  assert "100 tokens in 3 documents" in note and "no eval loss" in note
  assert "train.batch_size * train.seq_len + 1 = 257" in note
  assert eval_shortfall(tokens, starts, seq_len=32, batch_size=3, eval_fraction=0.1) is None
  assert eval_shortfall(tokens[:0], starts, seq_len=32, batch_size=8, eval_fraction=0.0) is None


def test_bpe_spec_trains_on_the_train_split_once(tmp_path):
  path = tmp_path / "data.jsonl"
  lines = [
    json.dumps({"text": f"def handler_{i}(event):\n    return event.value\n"}) for i in range(60)
  ]
  path.write_text("\n".join(lines) + "\n")
  cfg = DataConfig(source=str(path), tokenizer="bpe:300", eval_fraction=0.2)
  first = tokenizer_for(cfg, tmp_path / "cache")
  assert isinstance(first, HFTokenizer) and first.vocab_size <= 300
  assert first.decode(first.encode("def handler_7(event):")) == "def handler_7(event):"
  (cached,) = (tmp_path / "cache").glob("bpe-300-*.json")
  again = tokenizer_for(cfg, tmp_path / "cache")  # read back, not trained again
  assert again.fingerprint() == first.fingerprint()
  cached.unlink()
  assert tokenizer_for(cfg, tmp_path / "cache").fingerprint() == first.fingerprint()  # same run
  # Eval documents are not seen: a corpus of only held-out documents trains on nothing.
  every = DataConfig(source=str(path), tokenizer="bpe:300", eval_fraction=0.999)
  assert tokenizer_for(every, tmp_path / "c2").vocab_size < first.vocab_size


@pytest.mark.parametrize("spec", ["bpe:", "bpe:abc", "bpe:100", "bpe:-5"])
def test_bpe_spec_is_checked(spec):
  with pytest.raises(ConfigError, match=rf"data.tokenizer='{spec}' is not allowed: bpe:N needs"):
    DataConfig(tokenizer=spec)
