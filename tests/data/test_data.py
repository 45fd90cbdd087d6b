"""Tokenisers round-trip; the stdlib corpus is reproducible; the eval split is stable."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.data.corpus import iter_documents, stdlib_files
from atlas_jax.data.dataset import tokenize_corpus
from atlas_jax.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe


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


def test_bpe_spec_trains_on_the_training_documents_once(tmp_path):
  import pytest

  from atlas_jax.config import ConfigError, DataConfig
  from atlas_jax.data.tokenizer import corpus_bpe

  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(30):
    (docs / f"m{i:02d}.py").write_text(f"def handler_{i}(request):\n    return request * {i}\n")
  tok = load_tokenizer("bpe:300", source=str(docs), eval_fraction=0.2, cache_dir=tmp_path / "c")
  assert tok.vocab_size == 300
  sample = "def handler_7(request):\n    return request * 7\n"
  assert tok.decode(tok.encode(sample)) == sample
  path = corpus_bpe(str(docs), 300, tmp_path / "c", eval_fraction=0.2)
  stamp = path.stat().st_mtime_ns
  again = load_tokenizer("bpe:300", source=str(docs), eval_fraction=0.2, cache_dir=tmp_path / "c")
  assert path.stat().st_mtime_ns == stamp  # read from the cache, not retrained
  assert again.encode(sample) == tok.encode(sample)
  with pytest.raises(ConfigError, match=r"data\.tokenizer='bpe:12' .*N >= 259"):
    DataConfig(tokenizer="bpe:12")
