"""The engine serves what `generate` would, whatever the arrivals, batching or preemption."""

import dataclasses
import logging
import re

import numpy as np
import pytest

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError


def workload(seed, n=10, vocab=40):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(1, 40, n)]
  params = [
    SamplingParams(
      max_new_tokens=int(rng.integers(1, 20)),
      temperature=float(i % 2),
      top_k=int(i % 3) * 5,
      seed=100 + i,
    )
    for i in range(n)
  ]
  return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_model):
  prompts, params = workload(0)
  return prompts, params, generate(tiny_model, prompts, params)


CONFIGS = {
  "roomy": EngineConfig(
    runner="ragged",
    n_blocks=128,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    prefill_chunk=32,
  ),
  # 16 blocks of 4 (64 slots) cannot hold 4 running sequences of up to 58 tokens each: forces
  # preemption and recompute.
  "tight": EngineConfig(
    runner="ragged",
    n_blocks=16,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=24,
    prefill_chunk=8,
  ),
}


def serve(model, config, prompts, params, order):
  """Runs the engine over the workload in an arrival order; the new tokens per prompt."""
  engine = Engine(model, config)
  idx = list(range(len(prompts)))
  if order == "reversed":
    idx = idx[::-1]
  got = {i: [] for i in idx}
  pending = list(idx)
  while pending or engine.has_unfinished():
    # Staggered: one new arrival every other step, into a running batch.
    take = 1 if order == "staggered" and engine.n_steps % 2 == 0 else len(pending)
    for i in pending[:take]:
      engine.add_request(i, prompts[i], params[i])
    pending = pending[take:]
    for out in engine.step():
      got[out.request_id].extend(out.new_token_ids)
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks
  return [got[i] for i in range(len(prompts))], engine


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("order", ["fifo", "reversed", "staggered"])
def test_engine_equals_generate(tiny_model, reference, name, order):
  prompts, params, want = reference
  got, engine = serve(tiny_model, CONFIGS[name], prompts, params, order)
  assert got == want
  if name == "tight":
    assert engine.n_preemptions > 0
  else:
    assert engine.n_bursts > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offline_bursts_serve_what_generate_does(tiny_model, reference, name):
  """`Engine.generate` runs offline (no arrival can wait for a burst): its bursts run up to
  `offline_burst` steps, 16 here against 8 online; the tokens are generate's, in the tight pool
  (which preempts, and holds fewer long reservations) too."""
  prompts, params, want = reference
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS[name], offline_burst=16))
  lengths = []
  burst = engine.runner.burst
  engine.runner.burst = lambda rows, n, *args, **kw: (
    lengths.append(n) or burst(rows, n, *args, **kw)
  )
  assert engine.generate(prompts, params) == want
  assert not engine.offline  # back online once generate returns
  assert max(lengths) > 8, lengths  # longer than online bursts (cut to what rows need)


def test_a_burst_stops_at_the_last_token_a_row_needs(tiny_model):
  """No burst runs a step past every row's max_tokens: 4 rows of 70 new tokens compute their
  3-token prompts and 69 decode steps each (the prefill draws the first token), in bursts of
  32, 32 and 5 offline, 8 x 8 and 5 online; not one step more."""
  prompts = [[1 + i, 2, 3] for i in range(4)]
  params = SamplingParams(max_new_tokens=70, ignore_eos=True)
  want = generate(tiny_model, prompts, params)
  config = dataclasses.replace(CONFIGS["roomy"], decode_burst=8, offline_burst=32)
  for offline, bursts in ((True, [32, 32, 5]), (False, [8] * 8 + [5])):
    engine = Engine(tiny_model, config)
    lengths = []
    burst = engine.runner.burst
    engine.runner.burst = lambda rows, n, *a, burst=burst, lengths=lengths, **kw: (
      lengths.append(n) or burst(rows, n, *a, **kw)
    )
    if offline:
      got = engine.generate(prompts, params)
    else:
      for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
      got = [[] for _ in prompts]
      while engine.has_unfinished():
        for out in engine.step():
          got[out.request_id] += out.new_token_ids
    assert got == want
    assert lengths == bursts
    assert engine.n_computed_tokens == 4 * 3 + 4 * 69


@pytest.fixture(scope="module")
def mla_reference(mla_model):
  prompts, params = workload(0)
  return prompts, params, generate(mla_model, prompts, params)


@pytest.mark.parametrize("name, order", [("tight", "reversed"), ("roomy", "staggered")])
def test_mla_engine_equals_generate(mla_model, mla_reference, name, order):
  """MLA models are served over a paged latent pool: same tokens as `generate` (greedy and
  seeded sampling), in two arrival orders, with preemption in the tight pool."""
  prompts, params, want = mla_reference
  # One batch bucket (the GQA sweep above covers every bucket): each program compiles once.
  config = dataclasses.replace(CONFIGS[name], min_batch_bucket=CONFIGS[name].max_num_seqs)
  got, engine = serve(mla_model, config, prompts, params, order)
  assert got == want
  if name == "tight":
    assert engine.n_preemptions > 0


def test_logprobs_and_stop_tokens_match_generate(tiny_model):
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  free = generate(tiny_model, prompts, SamplingParams(max_new_tokens=12))
  params = [
    SamplingParams(max_new_tokens=12, stop_token_ids=(free[0][5],), logprobs=2),
    SamplingParams(max_new_tokens=12, temperature=0.7, seed=9, logprobs=0),
  ]
  want, want_lp = generate(tiny_model, prompts, params, return_logprobs=True)
  assert want[0] == free[0][: free[0].index(free[0][5]) + 1]
  engine = Engine(tiny_model, CONFIGS["roomy"])
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(i, p, sp)
  got, lps, tops, reasons = {0: [], 1: []}, {0: [], 1: []}, {0: [], 1: []}, {}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id] += out.new_token_ids
      lps[out.request_id] += out.new_logprobs
      tops[out.request_id] += out.new_top_logprobs
      if out.finished:
        reasons[out.request_id] = out.finish_reason
  assert [got[0], got[1]] == want
  np.testing.assert_allclose(lps[0] + lps[1], want_lp[0] + want_lp[1], atol=1e-4)
  assert reasons == {0: "stop", 1: "length"}
  assert all(len(t) == 2 for t in tops[0]) and all(len(t) == 0 for t in tops[1])
  # Greedy picks the most likely token: it heads the top list with the same logprob.
  assert all(t[0][0] == g and abs(t[0][1] - lp) < 1e-5 for t, g, lp in zip(tops[0], got[0], lps[0]))


def test_prefix_cache_reuses_blocks_and_keeps_outputs(any_model):
  prompt = list(np.random.default_rng(1).integers(0, 40, 30))
  engine = Engine(any_model, CONFIGS["roomy"])
  first = engine.generate([prompt], SamplingParams(max_new_tokens=5))
  again = engine.generate([prompt, prompt[:21] + [3]], SamplingParams(max_new_tokens=5))
  assert again[0] == first[0]
  assert again[1] == generate(any_model, [prompt[:21] + [3]], SamplingParams(max_new_tokens=5))[0]
  # 7 of the first prompt's full blocks (the 8th holds its last token, always recomputed) + 5.
  assert engine.allocator.stats().prefix_hit_tokens == 4 * (7 + 5)


def test_oversized_requests_are_rejected_and_the_engine_keeps_serving(tiny_model):
  engine = Engine(
    tiny_model,
    EngineConfig(
      runner="ragged",
      n_blocks=6,
      block_size=4,
      max_num_seqs=2,
      max_num_batched_tokens=8,
      prefill_chunk=8,
    ),
  )
  with pytest.raises(RequestError, match="needs 7 KV blocks of 4 tokens; the pool holds 6"):
    engine.add_request("big", [1] * 20, SamplingParams(max_new_tokens=8))
  with pytest.raises(RequestError, match="exceeds the context length 128"):
    engine.add_request("long", [1] * 100, SamplingParams(max_new_tokens=40))
  with pytest.raises(RequestError, match=r"in \[0, 40\)"):
    engine.add_request("bad", [1, 40])
  # Two requests that each fit alone but not together: served one after the other.
  prompts = [[1] * 14, [2] * 14]
  got = engine.generate(prompts, SamplingParams(max_new_tokens=9))
  assert got == generate(tiny_model, prompts, SamplingParams(max_new_tokens=9))


def test_abort_frees_blocks(tiny_model):
  engine = Engine(tiny_model, CONFIGS["roomy"])
  engine.add_request("a", list(range(30)), SamplingParams(max_new_tokens=50))
  engine.add_request("b", [1, 2], SamplingParams(max_new_tokens=3))
  for _ in range(3):
    engine.step()
  assert engine.allocator.stats().n_used > 0
  engine.abort("a")
  outs = engine.step()
  assert [(o.request_id, o.finish_reason) for o in outs if o.request_id == "a"] == [("a", "abort")]
  while engine.has_unfinished():
    engine.step()
  assert engine.allocator.stats().n_used == 0 and engine.n_running == 0


@pytest.mark.parametrize("at", [3, 8, 15], ids=["first_burst", "across_bursts", "later"])
def test_stop_strings_cut_the_text(tiny_model, at):
  """A stop string ends the request where it first appears in the text, even when its
  characters come from two bursts (output tokens 1-8 and 9-16 are drawn by one burst each)."""
  detok = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)
  free = generate(tiny_model, [[5, 6]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
  stop = detok(free[at : at + 2])
  engine = Engine(tiny_model, CONFIGS["roomy"], detokenize=detok)
  engine.add_request("s", [5, 6], SamplingParams(max_new_tokens=24, stop=(stop,)))
  text, tokens, reason = "", [], None
  while engine.has_unfinished():
    for out in engine.step():
      text += out.text
      tokens += out.new_token_ids
      reason = out.finish_reason or reason
  full = detok(free)
  cut = full.find(stop)
  assert reason == "stop" and text == full[:cut]
  assert tokens == free[: cut + 2]  # through the token that completes the stop string
  assert engine.n_bursts > 0 or cut + 2 <= 1


def test_steady_state_never_recompiles(tiny_model):
  engine = Engine(
    tiny_model,
    EngineConfig(
      runner="ragged",
      n_blocks=48,
      block_size=4,
      max_num_seqs=4,
      max_num_batched_tokens=24,
      prefill_chunk=16,
    ),
  )
  rng = np.random.default_rng(3)
  count = 0
  before = engine.programs.forward_sample._cache_size()
  bursts_before = engine.programs.decode_burst._cache_size()

  def run(steps):
    nonlocal count
    for _ in range(steps):
      if engine.n_waiting < 2:
        sp = SamplingParams(
          max_new_tokens=int(rng.integers(1, 12)), temperature=float(rng.integers(0, 2)), seed=count
        )
        engine.add_request(count, rng.integers(0, 40, int(rng.integers(1, 40))).tolist(), sp)
        count += 1
      engine.step()

  run(150)  # warm-up: visits the (batch, chunk, block-table width) buckets
  compiled = engine.programs.forward_sample._cache_size()
  bursts = engine.programs.decode_burst._cache_size()
  run(200)
  assert engine.programs.forward_sample._cache_size() == compiled
  assert engine.programs.decode_burst._cache_size() == bursts
  # A handful of shapes: prefill row buckets x chunk buckets (16 only here) x table widths (64
  # tokens only here), decode row buckets; bursts: one per row bucket.
  assert compiled - before <= 4 + 3
  assert bursts - bursts_before <= 3


@pytest.mark.parametrize("prompt_len", [30, 29], ids=["shared_partial_block", "block_aligned"])
def test_n_completions_compute_the_prompt_once(any_model, prompt_len):
  """add_requests: n completions equal n independent ones, but the prompt runs once and only the
  shared partial block is copied (copy-on-write), once per extra completion."""
  prompt = np.random.default_rng(2).integers(0, 40, prompt_len).tolist()
  params = [SamplingParams(max_new_tokens=9, temperature=1.0, seed=s) for s in range(4)]
  want = generate(any_model, [prompt] * 4, params)
  # Single decode steps, so every computed token counts exactly (bursts overrun stops).
  engine = Engine(any_model, dataclasses.replace(CONFIGS["roomy"], decode_burst=1))
  engine.add_requests(["a", "b", "c", "d"], prompt, params)
  got = {rid: [] for rid in "abcd"}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id] += out.new_token_ids
  assert [got[r] for r in "abcd"] == want
  # The prompt once, the last prompt token again per extra completion, then the decode steps.
  assert engine.n_computed_tokens == prompt_len + 3 + sum(len(w) - 1 for w in want)
  Z = CONFIGS["roomy"].block_size
  assert engine.allocator.stats().n_copies == (3 if (prompt_len - 1) % Z else 0)
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks


def test_n_completions_survive_preemption_and_a_leader_abort(tiny_model):
  prompts, params = workload(1, n=6)
  group = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (7, 8, 9)]
  long_prompt = list(range(3, 38))
  want_group = generate(tiny_model, [long_prompt] * 3, group)
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, CONFIGS["tight"])
  engine.add_requests(["g0", "g1", "g2"], long_prompt, group)
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(i, p, sp)
  got = {rid: [] for rid in ["g0", "g1", "g2", *range(6)]}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id] += out.new_token_ids
  assert [got[i] for i in range(6)] == want
  assert [got[r] for r in ("g0", "g1", "g2")] == want_group
  assert engine.n_preemptions > 0

  # The leader aborted before its prompt is computed: its siblings compute it themselves.
  engine = Engine(tiny_model, CONFIGS["tight"])
  engine.add_requests(["h0", "h1", "h2"], long_prompt, group)
  engine.step()
  engine.abort("h0")
  got = {"h1": [], "h2": []}
  reasons = {}
  while engine.has_unfinished():
    for out in engine.step():
      if out.request_id in got:
        got[out.request_id] += out.new_token_ids
      reasons[out.request_id] = out.finish_reason
  assert [got["h1"], got["h2"]] == want_group[1:] and reasons["h0"] == "abort"
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks


def test_add_requests_is_all_or_nothing(tiny_model):
  engine = Engine(tiny_model, CONFIGS["roomy"])
  with pytest.raises(RequestError, match="max_tokens 200"):
    engine.add_requests(
      ["ok", "bad"], [1, 2, 3], [SamplingParams(), SamplingParams(max_new_tokens=200)]
    )
  with pytest.raises(RequestError, match="duplicate request ids"):
    engine.add_requests(["x", "x"], [1, 2], [SamplingParams(), SamplingParams()])
  assert not engine.has_unfinished() and engine.n_waiting == 0


def test_chained_bursts_and_an_abort_in_flight(tiny_model):
  """Bursts run back to back, each fed on the device by the previous one's last draws before
  the host reads them; a request aborted while a burst runs ends alone, its blocks freed."""
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 40, 6).tolist() for _ in range(4)]
  params = [
    SamplingParams(max_new_tokens=45, temperature=float(i % 2), seed=i, repetition_penalty=1.3)
    for i in range(4)
  ]
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, CONFIGS["roomy"])
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(i, p, sp)
  got = {i: [] for i in range(4)}
  reasons = {}
  while engine.has_unfinished():
    if engine._inflight is not None and 2 not in reasons and len(got[2]) >= 9:
      engine.abort(2)
    for out in engine.step():
      got[out.request_id] += out.new_token_ids
      if out.finished:
        reasons[out.request_id] = out.finish_reason
  assert engine.n_chained > 0
  assert [got[i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
  assert reasons[2] == "abort" and got[2] == want[2][: len(got[2])]
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks


def test_min_batch_bucket_pads_every_step_and_changes_no_output(tiny_model):
  prompts, params = workload(9, n=3)
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS["roomy"], min_batch_bucket=8))
  rows = []
  for name in ("forward_sample", "decode_burst"):
    program = getattr(engine.programs, name)

    def spy(states, pools, x, *args, program=program):
      rows.append(x.lengths_B.shape[0])  # sequence slots
      return program(states, pools, x, *args)

    engine.programs = dataclasses.replace(engine.programs, **{name: spy})
  assert engine.generate(prompts, params) == want
  assert rows and set(rows) == {8}  # 3 requests, then fewer: always 8 rows
  with pytest.raises(ValueError, match="min_batch_bucket=3 is not allowed: must be a power of two"):
    dataclasses.replace(CONFIGS["roomy"], min_batch_bucket=3)


WARM = EngineConfig(
  runner="ragged",
  n_blocks=96,
  block_size=4,
  max_num_seqs=2,
  max_model_len=128,
  prefill_chunk=32,
  decode_burst=4,
  offline_burst=8,
)


def test_several_eos_ids_each_stop(tiny_model):
  free = generate(tiny_model, [[1, 2, 3]], SamplingParams(max_new_tokens=12))[0]
  eos = [free[7], free[4]]
  want = free[: min(free.index(e) for e in eos) + 1]
  assert generate(tiny_model, [[1, 2, 3]], SamplingParams(max_new_tokens=12), eos_id=eos)[0] == want
  engine = Engine(tiny_model, CONFIGS["roomy"], eos_id=eos)
  assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12)) == [want]


def test_each_finished_request_is_logged_once(tiny_model, caplog):
  engine = Engine(tiny_model, CONFIGS["roomy"])
  with caplog.at_level(logging.INFO, logger="atlas_jax.serving"):
    engine.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=4))
    engine.add_request("b", [4, 5], SamplingParams(max_new_tokens=30))
    engine.step()
    engine.abort("b")
    while engine.has_unfinished():
      engine.step()
  lines = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("request "))
  assert len(lines) == 2
  time = r"first token \d+\.\d{3} s, total \d+\.\d{3} s"
  assert re.fullmatch(rf"request a: length, 3 prompt \+ 4 output tokens, {time}", lines[0])
  assert re.fullmatch(rf"request b: abort, 2 prompt \+ \d+ output tokens, {time}", lines[1])
