"""Guided requests in the engine: outputs parse and validate across seeds on a model over a real
(byte-level BPE) vocabulary, no bursts while one runs, preemption changes nothing, neighbours'
outputs are unchanged; under speculation (a draft model, the target itself, MTP heads) greedy
outputs equal plain guided greedy outputs and sampled ones still validate."""

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig, MTPConfig
from atlas_jax.data.tokenizer import train_bpe
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.decoding.guided import GrammarCompiler, spec_from_request
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError

from .conftest import TINY

SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 5},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    "ok": {"type": "boolean"},
  },
  "required": ["name", "age"],
}
CHOICES = ["yes", "no", "nope", "maybe"]
REGEX = r"[a-c]{1,3}-[0-9]{1,4}"


@pytest.fixture(scope="module")
def setup():
  corpus = ['{"name": "ab", "age": 7, "ok": true, "pets": ["cat"]}\n' * 20, "yes no nope" * 20]
  tok = train_bpe(corpus + ["def f(x):\n  return x\n" * 20], 300)
  shape = {**TINY, "vocab_size": tok.vocab_size, "max_seq_len": 256}
  cfg = ModelConfig(**shape, n_kv_heads=2, init_std=0.3)
  model = build(cfg, rngs=nnx.Rngs(0))
  compiler = GrammarCompiler(tok, vocab_size=cfg.vocab_size)
  grammars = {
    "schema": compiler.compile(spec_from_request(guided_json=SCHEMA)),
    "choice": compiler.compile(spec_from_request(guided_choice=CHOICES)),
    "regex": compiler.compile(spec_from_request(guided_regex=REGEX)),
  }
  return tok, model, grammars


def _engine(model, tok, draft=None, **kw):
  cfg = dict(
    n_blocks=96, block_size=8, max_num_seqs=8, max_num_batched_tokens=64, min_batch_bucket=8
  )
  config = EngineConfig(runner="ragged", **(cfg | kw))
  return Engine(model, config, draft=draft, eos_id=tok.eos_id, detokenize=tok.decode)


def _run(engine, requests):
  """{id: (tokens, finish_reason)} for requests [(id, prompt ids, params)]."""
  for rid, prompt, params in requests:
    engine.add_request(rid, prompt, params)
  got = {rid: ([], None) for rid, _, _ in requests}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id][0].extend(out.new_token_ids)
      if out.finished:
        got[out.request_id] = (got[out.request_id][0], out.finish_reason)
  return got


def _requests(tok, grammars, seeds, max_new_tokens=96):
  reqs = []
  for seed in seeds:
    for kind, g in grammars.items():
      params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, guided=g)
      reqs.append(((kind, seed), tok.encode(f"{kind} {seed}: "), params))
  return reqs


def _check(tok, kind, tokens, reason):
  assert reason == "stop", (kind, tok.decode(tokens))
  text = tok.decode([t for t in tokens if t != tok.eos_id])
  if kind == "schema":
    jsonschema.validate(json.loads(text), SCHEMA)
  elif kind == "choice":
    assert text in CHOICES
  else:
    assert re.fullmatch(REGEX, text), text


def test_guided_outputs_parse_and_validate_across_seeds(setup):
  tok, model, grammars = setup
  engine = _engine(model, tok)
  burst = engine.programs.decode_burst
  guided_in_bursts = []

  def spy(*args):
    guided_in_bursts.extend(r.id for r in engine.running if r.matcher is not None)
    return burst(*args)

  engine.programs = dataclasses.replace(engine.programs, decode_burst=spy)
  plain = ("plain", tok.encode("x = "), SamplingParams(max_new_tokens=24, temperature=1.0, seed=3))
  got = _run(engine, _requests(tok, grammars, range(5)) + [plain])
  for (kind, _), (tokens, reason) in ((k, v) for k, v in got.items() if k != "plain"):
    _check(tok, kind, tokens, reason)
  assert guided_in_bursts == []  # no burst while a guided request runs
  # The unguided neighbour draws exactly what it draws alone (with bursts).
  alone = _engine(model, tok)
  assert _run(alone, [plain])["plain"] == got["plain"]
  assert alone.n_bursts > 0


def test_a_complete_output_stops_without_eos(setup):
  tok, model, grammars = setup
  engine = _engine(model, tok)
  reqs = [
    (
      s,
      tok.encode("answer: "),
      SamplingParams(max_new_tokens=16, seed=s, guided=grammars["choice"]),
    )
    for s in range(6)
  ]
  for tokens, reason in _run(engine, reqs).values():
    text = tok.decode(tokens)
    assert reason == "stop" and text in CHOICES
    # Where nothing may follow ("yes", "maybe", "nope") the request ends without drawing eos.
    assert (tokens[-1] == tok.eos_id) == (text == "no")


def test_preemption_changes_no_guided_output(setup):
  tok, model, grammars = setup
  reqs = _requests(tok, {"schema": grammars["schema"]}, range(4), max_new_tokens=64)
  roomy = _run(_engine(model, tok), reqs)
  small = _engine(model, tok, n_blocks=10, max_num_seqs=4)
  tight = _run(small, [(("again",) + rid, p, sp) for rid, p, sp in reqs])
  assert small.n_preemptions > 0
  for rid, _, _ in reqs:
    assert tight[("again",) + rid] == roomy[rid]
    _check(tok, "schema", *roomy[rid])


def test_guided_params_need_the_models_vocabulary_and_the_engine(setup):
  tok, model, grammars = setup
  other = GrammarCompiler(tok, vocab_size=tok.vocab_size + 32)
  params = SamplingParams(guided=other.compile(spec_from_request(guided_choice=["a"])))
  with pytest.raises(RequestError, match="compiled for"):
    _engine(model, tok).add_request("r", [1, 2], params)
  with pytest.raises(ValueError, match="served by the Engine"):
    generate(model, [[1, 2]], SamplingParams(guided=grammars["choice"]))


def _greedy(reqs):
  return [(rid, p, dataclasses.replace(sp, temperature=0.0)) for rid, p, sp in reqs]


@pytest.mark.slow  # guided speculation stays in the default suite, sampled, below
def test_guided_rows_speculate_and_keep_their_greedy_tokens(setup):
  """A draft model whose drafts the grammar often refuses, and the target as its own draft,
  whose first draft per round is drawn under the same mask as the target's token, so it is
  always accepted: both emit exactly the plain guided greedy tokens. The second runs with
  guided_speculative_max_batch=2: no round has more rows."""
  tok, model, grammars = setup
  small = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
  draft = build(dataclasses.replace(model.cfg, **small), rngs=nnx.Rngs(5))
  reqs = _greedy(_requests(tok, grammars, range(1), max_new_tokens=48))
  want = _run(_engine(model, tok), reqs)
  for d, limit in ((draft, 4), (model, 2)):
    engine = _engine(
      model, tok, draft=d, num_speculative_tokens=3, guided_speculative_max_batch=limit
    )
    batches = []
    draft_half = engine.programs.speculative_draft

    def spy(states, pools, rows, k, draft_half=draft_half, batches=batches):
      batches.append(int((np.asarray(rows.lengths_B) >= 0).sum()))
      return draft_half(states, pools, rows, k)

    engine.programs = dataclasses.replace(engine.programs, speculative_draft=spy)
    assert _run(engine, reqs) == want
    assert engine.n_spec_rounds == len(batches) > 0 and engine.n_bursts == 0
    assert max(batches) == min(limit, len(reqs))
    assert 0 < engine.n_accepted < engine.n_drafted
    if d is model:
      assert engine.n_accepted >= engine.n_spec_row_rounds  # every first draft
  for rid, _, _ in reqs:
    _check(tok, rid[0], *want[rid])


@pytest.mark.slow
def test_sampled_guided_speculation_validates_across_seeds(setup):
  """MTP self-speculation on the same vocabulary: every sampled output parses and validates, and
  an unguided neighbour in the same rounds draws what it draws alone (every decode step is a
  round in both runs, so it uses the same keys): its neighbours' masks do not reach it."""
  tok, model, grammars = setup
  cfg = dataclasses.replace(model.cfg, mtp=MTPConfig("parallel", 2))
  mtp = build(cfg, rngs=nnx.Rngs(1))
  plain = ("plain", tok.encode("x = "), SamplingParams(max_new_tokens=24, temperature=1.0, seed=3))
  kw = dict(draft="mtp", num_speculative_tokens=2, guided_speculative_max_batch=8)
  engine = _engine(mtp, tok, **kw)
  got = _run(engine, _requests(tok, grammars, range(2), max_new_tokens=48) + [plain])
  for (kind, _), (tokens, reason) in ((k, v) for k, v in got.items() if k != "plain"):
    _check(tok, kind, tokens, reason)
  assert engine.n_spec_rounds > 0 and engine.n_accepted > 0
  assert engine.n_steps == engine.n_spec_rounds + 1  # one prefill step, then rounds only
  alone = _engine(mtp, tok, **kw)
  assert _run(alone, [plain])["plain"] == got["plain"]
