"""Streamed requests and arrivals during bursts: what leaves each step, counted in steps."""

import dataclasses

import numpy as np
import pytest

from atlas_jax.config import ConfigError
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError

from .conftest import byte_model

ROOMY = EngineConfig(
  runner="ragged",
  n_blocks=128,
  block_size=4,
  max_num_seqs=8,
  max_num_batched_tokens=64,
  prefill_chunk=32,
)


def chunks_of(engine, rid, others=()):
  """Steps the engine to the end: (per step that gave `rid` tokens, how many; every request's
  tokens; (n_steps, n_bursts) when `rid` finished)."""
  sizes, got, at_end = [], {}, None
  while engine.has_unfinished():
    for out in engine.step():
      got.setdefault(out.request_id, []).extend(out.new_token_ids)
      if out.request_id == rid:
        if out.new_token_ids:
          sizes.append(len(out.new_token_ids))
        if out.finished:
          at_end = (engine.n_steps, engine.n_bursts)
  return sizes, got, at_end


@pytest.mark.parametrize("stream_bursts", [False, True])
def test_a_streamed_request_gets_one_token_a_step(tiny_model, stream_bursts):
  """While a streamed request runs, no burst runs (each step hands back its next token), unless
  `stream_bursts`; once it ends, the others burst again. The tokens are generate's either way."""
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=40, seed=2)]
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, dataclasses.replace(ROOMY, stream_bursts=stream_bursts))
  engine.add_request("streamed", prompts[0], params[0], stream=True)
  engine.add_request("plain", prompts[1], params[1])
  sizes, got, (n_steps, n_bursts) = chunks_of(engine, "streamed")
  assert [got["streamed"], got["plain"]] == want
  if stream_bursts:
    # The prefill step draws the first token; a burst of 8, then one cut at max_tokens. Three
    # bursts were dispatched by then: the third (the plain row alone) chained on the second.
    assert sizes == [1, 8, 1] and n_bursts == 3
  else:
    assert sizes == [1] * 10 and (n_steps, n_bursts) == (10, 0)  # one mixed step per token
  assert engine.n_bursts > n_bursts  # the plain request's last 30 tokens burst


def test_stream_and_stream_bursts_are_checked(tiny_model):
  engine = Engine(tiny_model, ROOMY)
  with pytest.raises(RequestError, match="stream='yes' is not allowed: must be true or false"):
    engine.add_request("a", [1, 2], SamplingParams(), stream="yes")
  with pytest.raises(
    ConfigError, match="serve.engine.stream_bursts=1 is not allowed: must be true or false"
  ):
    dataclasses.replace(ROOMY, stream_bursts=1)


def record(got, outputs):
  """Adds each output's tokens to its request's in `got`; the outputs."""
  for out in outputs:
    got.setdefault(out.request_id, []).extend(out.new_token_ids)
  return outputs


def run_until(engine, got, ready):
  """Steps the engine until `ready()` holds after a step."""
  while not ready():
    assert engine.has_unfinished()
    record(got, engine.step())


def finish(engine, got):
  while engine.has_unfinished():
    record(got, engine.step())


def test_an_arrival_during_chained_bursts_waits_for_the_burst_in_flight_only(tiny_model):
  """A request that arrives while chained bursts run stops the chain: the next step reads the
  burst in flight and dispatches none, and the step after prefills the arrival (its first token
  drawn there, a prompt within one chunk)."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 40, n).tolist() for n in (6, 9, 12)]
  params = [SamplingParams(max_new_tokens=60, seed=i, temperature=float(i % 2)) for i in range(3)]
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, ROOMY)
  engine.add_request(0, prompts[0], params[0])
  engine.add_request(1, prompts[1], params[1])
  got: dict = {}
  run_until(engine, got, lambda: engine.n_chained >= 2 and engine._inflight is not None)
  engine.add_request("late", prompts[2], params[2])
  n_bursts, n_steps = engine.n_bursts, engine.n_steps
  outputs = record(got, engine.step())  # reads the burst in flight, chains none
  assert {o.request_id: len(o.new_token_ids) for o in outputs} == {0: 8, 1: 8}
  assert engine.n_bursts == n_bursts and engine._inflight is None
  outputs = record(got, engine.step())  # a mixed step: the arrival's prefill, the others' next
  assert engine.n_steps == n_steps + 1 and engine.n_bursts == n_bursts
  assert {o.request_id: len(o.new_token_ids) for o in outputs} == {0: 1, 1: 1, "late": 1}
  finish(engine, got)
  assert [got[0], got[1], got["late"]] == want


def test_an_arrival_that_cannot_be_admitted_lets_the_chain_go_on(tiny_model):
  """Chaining goes on past an arrival the pool cannot take yet (a seat is free, blocks are not),
  and for one the batch has no seat for; each is served once there is room, as generate."""
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 40, n).tolist() for n in (6, 6, 64)]
  params = [SamplingParams(max_new_tokens=60, seed=i) for i in range(2)]
  params.append(SamplingParams(max_new_tokens=4, seed=2))
  want = generate(tiny_model, prompts, params)
  # 48 blocks of 4: the arrival's first chunk (64 tokens, 16 blocks) fits only once the two
  # running requests (22 blocks each at most, reservations included) have freed theirs.
  config = dataclasses.replace(ROOMY, n_blocks=48, prefill_chunk=64, max_num_batched_tokens=64)
  engine = Engine(tiny_model, config)
  engine.add_request(0, prompts[0], params[0])
  engine.add_request(1, prompts[1], params[1])
  got: dict = {}
  run_until(
    engine, got, lambda: engine._inflight is not None and engine.allocator.n_available <= 16
  )
  engine.add_request("late", prompts[2], params[2])
  n_chained = engine.n_chained
  record(got, engine.step())
  assert engine.n_chained == n_chained + 1  # chained on: the arrival could not be admitted
  assert engine.n_waiting == 1
  finish(engine, got)
  assert [got[0], got[1], got["late"]] == want

  # No seat: two running fill max_num_seqs=2, so the chain goes on for an arrival.
  engine = Engine(tiny_model, dataclasses.replace(ROOMY, max_num_seqs=2))
  engine.add_request(0, prompts[0], params[0])
  engine.add_request(1, prompts[1], params[1])
  got = {}
  run_until(engine, got, lambda: engine._inflight is not None)
  engine.add_request("late", prompts[2][:20], params[2])
  n_chained = engine.n_chained
  record(got, engine.step())
  assert engine.n_chained == n_chained + 1 and engine.n_waiting == 1
  finish(engine, got)
  assert [got[0], got[1]] == want[:2]
  assert got["late"] == generate(tiny_model, [prompts[2][:20]], [params[2]])[0]


def test_a_bursts_text_per_token_is_what_single_steps_let_out():
  """A burst's output carries each token's own text: exactly what steps of one token each would
  have sent, held-back half characters and possible stop strings included."""
  model, tok = byte_model(1)
  prompts = [tok.encode(p) for p in ("def f(x):", "import ", "ab")]
  params = [
    SamplingParams(max_new_tokens=30, temperature=1.0, seed=s, stop=("xyz", "q")) for s in range(3)
  ]

  def texts(decode_burst):
    engine = Engine(
      model,
      dataclasses.replace(ROOMY, decode_burst=decode_burst),
      eos_id=tok.eos_id,
      detokenize=tok.decode,
    )
    for i, (p, sp) in enumerate(zip(prompts, params)):
      engine.add_request(i, p, sp)
    got = {i: [] for i in range(3)}
    while engine.has_unfinished():
      for out in engine.step():
        assert len(out.new_texts) == len(out.new_token_ids)
        assert "".join(out.new_texts) == out.text
        got[out.request_id] += out.new_texts
    return got, engine.n_bursts

  bursts, n_bursts = texts(8)
  singles, no_bursts = texts(1)
  assert n_bursts > 0 and no_bursts == 0
  assert bursts == singles
