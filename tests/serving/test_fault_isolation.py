"""One request's failure inside a batched step fails that request only; the rest are unchanged."""

import dataclasses

import jax
import numpy as np
import pytest

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError

POISON_SEED = 13  # a request with this seed makes the jitted step raise
CONFIG = EngineConfig(
  runner="ragged",
  n_blocks=64,
  block_size=4,
  max_num_seqs=8,
  max_num_batched_tokens=96,
  prefill_chunk=32,
)


def poison(engine, mode: str):
  """Makes every model call holding a row with POISON_SEED fail. "before-run": it raises before
  running (the pool intact); "pool-lost": it raises after consuming the donated pool, as a
  failure on the device would; "on-device": only decode bursts fail, when their draws are read
  (mixed steps run). Returns the batch size of every call."""
  original = engine.programs
  calls = []

  def guard(program, burst):
    def call(state, pool, x, *args):
      seeds = np.asarray(x.seed_B)
      calls.append(len(seeds))
      if POISON_SEED not in seeds.tolist():
        return program(state, pool, x, *args)
      if mode == "on-device":
        if not burst:
          return program(state, pool, x, *args)
        pool, *outs = program(state, pool, x, *args)
        for x in jax.tree.leaves((pool, outs)):
          x.delete()  # as if the burst had failed on the device
        return (pool, *outs)
      if mode != "before-run":
        for x in jax.tree.leaves(pool):
          x.delete()
      raise RuntimeError("injected fault")

    return call

  engine.programs = dataclasses.replace(
    original,
    forward_sample=guard(original.forward_sample, burst=False),
    decode_burst=guard(original.decode_burst, burst=True),
  )
  return calls


def run(engine, requests):
  for rid, prompt, params in requests:
    engine.add_request(rid, prompt, params)
  got = {rid: [] for rid, _, _ in requests}
  ends = {}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id] += out.new_token_ids
      if out.finished:
        ends[out.request_id] = (out.finish_reason, out.error)
  return got, ends


def workload():
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 40, int(n)).tolist() for n in (9, 23, 17, 30, 5)]
  params = [
    SamplingParams(max_new_tokens=8, temperature=float(i % 2), seed=100 + i) for i in range(5)
  ]
  # The poisoned request shares its prompt with request 1, and is admitted just before it in
  # the same step: request 1 reads the prefix blocks the poisoned row was to write.
  bad = SamplingParams(max_new_tokens=8, seed=POISON_SEED)
  requests = [(0, prompts[0], params[0]), ("bad", prompts[1], bad)]
  requests += [(i, prompts[i], params[i]) for i in range(1, 5)]
  return prompts, params, requests


@pytest.mark.parametrize("mode", ["before-run", "pool-lost"])
def test_a_failing_request_fails_alone(tiny_model, mode):
  prompts, params, requests = workload()
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, CONFIG)
  calls = poison(engine, mode)
  got, ends = run(engine, requests)
  assert ends.pop("bad") == ("error", "the model step failed: RuntimeError: injected fault")
  assert got.pop("bad") == []
  assert [got[i] for i in range(5)] == want
  assert all(reason == "length" for reason, _ in ends.values())
  assert max(calls) > 1  # the poisoned row was batched with others, then isolated
  if mode != "before-run":
    assert engine.n_preemptions > 0  # the lost pool was rebuilt and the running recomputed
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks
  # Its prompt was never computed: the prefix cache must not serve its blocks to a later request.
  again = engine.generate([prompts[1]], params[1])
  assert again == [want[1]]


def test_a_burst_failing_on_the_device_is_recomputed(tiny_model):
  # The fault strikes only in decode bursts, which take the pool: the engine rebuilds it and
  # recomputes, and the rows of the failed burst run in mixed steps, where nothing fails.
  prompts, params, requests = workload()
  bad = requests[1][2]
  want = generate(tiny_model, [*prompts, prompts[1]], [*params, bad])
  engine = Engine(tiny_model, CONFIG)
  poison(engine, "on-device")
  got, ends = run(engine, requests)
  assert [got[i] for i in range(5)] + [got["bad"]] == want
  assert all(reason == "length" and error is None for reason, error in ends.values())
  assert engine.n_bursts > 0 and engine.n_preemptions > 0
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks


def test_a_failing_detokenizer_fails_its_request_only(tiny_model):
  prompts = [[1, 2, 3], [4, 5, 6, 7]]
  want = generate(tiny_model, prompts, SamplingParams(max_new_tokens=6))
  bad = want[1][2]  # the detokenizer fails on request 1's third token

  def detokenize(ids):
    if bad in ids:
      raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    return "".join(chr(97 + t % 26) for t in ids)

  assert bad not in want[0] and bad not in want[1][:2]  # the fault hits request 1 only
  engine = Engine(tiny_model, CONFIG, detokenize=detokenize)
  got, ends = run(engine, [(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(prompts)])
  assert got[0] == want[0] and ends[0] == ("length", None)
  assert ends[1][0] == "error" and "UnicodeDecodeError" in ends[1][1]
  assert len(got[1]) <= 2 and got[1] == want[1][: len(got[1])]


@pytest.mark.parametrize(
  "prompt, params, match",
  [
    ([1, 2.5], None, r"prompt token ids must be integers in \[0, 40\)"),
    ([1, True], None, "must be integers"),
    ("hello", None, "not text"),
    ([1, 2**40], None, r"prompt token id 1099511627776 is not allowed"),
    ([1, 2], {"top_k": 5}, "params=.* must be a SamplingParams"),
  ],
)
def test_add_request_checks_every_field(tiny_model, prompt, params, match):
  engine = Engine(tiny_model, CONFIG)
  with pytest.raises(RequestError, match=match):
    engine.add_request("r", prompt, params)
  assert not engine.has_unfinished()
