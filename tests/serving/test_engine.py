"""The engine serves what `generate` would, whatever the arrivals, batching or preemption."""

import dataclasses
import logging
import re
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, ModelConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.model.scan import OutMajor, is_unstacked
from atlas_jax.serving import runner, steps
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError

from .conftest import TINY


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
    n_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=32
  ),
  # 16 blocks of 4 (64 slots) cannot hold 4 running sequences of up to 58 tokens each: forces
  # preemption and recompute.
  "tight": EngineConfig(
    n_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk=8
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


def _held_out_major(engine) -> int:
  leaves = jax.tree.leaves(engine.runner.states[0], is_leaf=lambda x: isinstance(x, OutMajor))
  return sum(isinstance(x, OutMajor) for x in leaves)


@pytest.mark.parametrize(
  "layout, matmul",
  [
    ("in_major", "ynnpack"),
    ("out_major", "ynnpack"),
    ("in_major", "xla"),
    ("stacked", "ynnpack"),
    ("auto", "auto"),
  ],
)
def test_every_weight_layout_serves_what_generate_does(
  tiny_model, reference, layout, matmul, caplog
):
  """`weight_layout` and `cpu_matmul`: the layer stacks held as trained (the layer scan slices
  them) or one array per layer, the projections then as trained or transposed (7 a layer), the
  dots YNNPACK's or XLA's own, or as the start-up probe found faster, which it logs with its
  timings (and on one CPU device holds in-major projections stacked); the tokens are
  generate's."""
  prompts, params, want = reference
  config = dataclasses.replace(CONFIGS["roomy"], weight_layout=layout, cpu_matmul=matmul)
  with caplog.at_level(logging.INFO, logger="atlas_jax.serving"):
    got, engine = serve(tiny_model, config, prompts, params, "staggered")
  assert got == want
  held, xla_rows = _held_out_major(engine), engine.runner.xla_dots_rows
  if layout == "auto":
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    m = re.fullmatch(
      r"weights: projections held (\S+), dots (YNNPACK's|XLA's up to (\d+) rows, YNNPACK's above) "
      r"\((\d+) of them, \d+ MB; ms at 1/2/4/8 rows: .*\)",
      said[0],
    )
    assert m is not None and int(m[4]) == 7 * tiny_model.cfg.n_layers, said
    layout = m[1].replace("-", "_")
    assert xla_rows == int(m[3] or 0)
  else:
    assert xla_rows == (runner.ALL_ROWS if matmul == "xla" else 0)
  assert held == (7 * tiny_model.cfg.n_layers if layout == "out_major" else 0)
  # "auto" (layout now the probe's): on one CPU device in-major projections stay stacked.
  stacked = layout == "stacked" or (matmul == "auto" and layout == "in_major")
  assert engine.runner.stacked == stacked
  assert is_unstacked(engine.runner.states[0]) == (not stacked)
  burst = engine.runner.programs.decode_burst
  assert isinstance(burst, steps.ByRows) == (xla_rows > 0 or bool(engine.runner.ynn_reduce_rows))


def _timings(in_ynn, out_ynn, in_xla):
  """Probe timings per row count 1, 2, 4, 8 from three columns (None: not timed)."""
  cols = {("in_major", "ynnpack"): in_ynn, ("out_major", "ynnpack"): out_ynn}
  cols[("in_major", "xla")] = in_xla
  return {
    rows: {k: v[i] for k, v in cols.items() if v is not None and v[i] is not None}
    for i, rows in enumerate((1, 2, 4, 8))
  }


@pytest.mark.parametrize(
  "timings, layout, matmul, plan",
  [
    # XLA's dots faster up to 4 rows, then not: in-major, XLA's up to 4.
    (_timings([4, 4, 5, 8], [4, 4, 5, 8], [2, 2, 3, 9]), "auto", "auto", (False, 4)),
    # Never past the first row count they lose at, a later win notwithstanding.
    (_timings([4, 4, 5, 8], [9, 9, 9, 9], [2, 5, 3, 5]), "auto", "auto", (False, 1)),
    # Even (within 5%) at one row, faster at 2 and 4: up to 4.
    (_timings([4, 4, 5, 8], [9, 9, 9, 9], [4.1, 2, 3, 9]), "auto", "auto", (False, 4)),
    # 3% is noise, not a win, for the dots as for the layout.
    (_timings([4, 4, 4, 4], [4, 4, 4, 4], [3.9, 3.9, 3.9, 3.9]), "auto", "auto", (False, 0)),
    # Nor is the probe's 1.3x: inside the step such dots were the slower (runner.XLA_DOTS_WIN).
    (
      _timings([4.5, 4.5, 4.5, 4.5], [9, 9, 9, 9], [3.5, 3.5, 3.5, 3.5]),
      "auto",
      "auto",
      (False, 0),
    ),
    # A Zen 4 EPYC's probe, one start (ms at 1/2/4/8 rows), where XLA's dots made the step the
    # slower at every row count: YNNPACK's throughout (the 5% rule took XLA's up to 8 rows).
    (
      _timings([2.79, 5.36, 5.22, 5.35], [2.09, 5.12, 6.64, 6.90], [2.87, 3.86, 4.41, 5.08]),
      "auto",
      "auto",
      (False, 0),
    ),
    (_timings([10, 10, 10, 10], [9.7, 9.7, 9.7, 9.7], None), "auto", "ynnpack", (False, 0)),
    # Out-major 10% faster in all (each in-major row count at its faster dots): no XLA dots.
    (_timings([10, 10, 10, 10], [9, 9, 9, 9], [11, 11, 11, 11]), "auto", "auto", (True, 0)),
    # ... but not when XLA's dots make in-major the faster over the buckets.
    (_timings([10, 10, 10, 10], [9, 9, 9, 9], [5, 5, 11, 11]), "auto", "auto", (False, 2)),
    ({}, "in_major", "xla", (False, runner.ALL_ROWS)),
    ({}, "out_major", "ynnpack", (True, 0)),
  ],
)
def test_matmul_plan(timings, layout, matmul, plan):
  assert runner.matmul_plan(timings, layout, matmul) == plan


def test_auto_plan_is_probed_once(tiny_model, monkeypatch):
  """The probe times the projections once per process for a model's shapes and row counts: a
  second engine takes the first one's plan (a probe that flipped on near-equal timings would
  recompile every program)."""
  probes = []

  def fake(mats, rows, kinds):
    probes.append(rows)
    return {k: 1.0 if k == ("in_major", "xla") else 2.0 for k in kinds}

  monkeypatch.setattr(runner, "_probes", {})
  monkeypatch.setattr(runner, "time_matmuls", fake)
  config = dataclasses.replace(CONFIGS["roomy"], weight_layout="auto", cpu_matmul="auto")
  engines = [Engine(tiny_model, config) for _ in range(2)]
  assert probes == [1, 2, 4, 8]  # every decode bucket up to max_num_seqs, once
  assert [e.runner.xla_dots_rows for e in engines] == [8, 8]
  assert [_held_out_major(e) for e in engines] == [0, 0]


def test_auto_keeps_small_layers_stacked(tiny_model, monkeypatch):
  """`weight_layout="auto"` on one CPU device with in-major projections: layers of at most
  `runner.STACKED_LAYER_BYTES` stay stacked (the layer scan slices them), larger ones are held
  one array per layer; a layer's bytes are its parameters'."""
  cfg = tiny_model.cfg
  D, H = cfg.d_model, cfg.d_model // cfg.n_heads
  params = 2 * D * cfg.n_heads * H + 2 * D * cfg.n_kv_heads * H + 3 * D * cfg.ffn_dim + 2 * D
  assert runner.layer_bytes(nnx.state(tiny_model)) == 4 * params
  monkeypatch.setattr(runner, "_probes", {})
  in_major_faster = lambda mats, rows, kinds: {k: 1.0 + (k[0] == "out_major") for k in kinds}
  monkeypatch.setattr(runner, "time_matmuls", in_major_faster)
  config = dataclasses.replace(CONFIGS["roomy"], weight_layout="auto", cpu_matmul="ynnpack")
  engine = Engine(tiny_model, config)
  assert engine.runner.stacked and not is_unstacked(engine.runner.states[0])
  monkeypatch.setattr(runner, "STACKED_LAYER_BYTES", 4 * params - 1)
  engine = Engine(tiny_model, config)
  assert not engine.runner.stacked and is_unstacked(engine.runner.states[0])


def test_weight_layout_is_checked(tiny_model):
  with pytest.raises(
    ConfigError,
    match="weight_layout='sideways' is not allowed: must be one of auto, stacked, in_major, "
    "out_major",
  ):
    EngineConfig(weight_layout="sideways")
  for layout in ("out_major", "stacked"):
    config = EngineConfig(n_blocks=16, tensor_parallel_size=2, weight_layout=layout)
    with pytest.raises(
      ConfigError,
      match=f"serve.engine.weight_layout='{layout}' is not allowed on a mesh of 1 x 2 devices: "
      "a mesh holds its layers one array each",
    ):
      Engine(tiny_model, config)
  with pytest.raises(ConfigError, match="cpu_matmul='blas' is not allowed: must be one of"):
    EngineConfig(cpu_matmul="blas")
  with pytest.raises(
    ConfigError,
    match="serve.engine.cpu_reductions='blas' is not allowed: must be one of auto, xla, ynnpack",
  ):
    EngineConfig(cpu_reductions="blas")
  config = EngineConfig(n_blocks=16, tensor_parallel_size=2, cpu_matmul="xla")
  with pytest.raises(
    ConfigError, match="serve.engine.cpu_matmul='xla' is not allowed on a mesh of 1 x 2 devices"
  ):
    Engine(tiny_model, config)


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
      n_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk=8
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
      n_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk=16
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


def test_prompts_run_as_segments_and_pad_less(tiny_model):
  """On CPU a step's prompts are cut into 16-token segments (`ModelRunner.segments`): three
  prompts of 40, 3 and 17 tokens are 6 segments, 8 x 16 = 128 token slots, where rows padded to
  the longest prompt take 4 x 64 = 256; the tokens are those of padded rows and of `generate`."""
  prompts = [list(range(40)), [5, 6, 7], list(range(3, 20))]
  params = SamplingParams(max_new_tokens=6)
  config = EngineConfig(
    n_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=128, prefill_chunk=64
  )
  got = {}
  for segment in (16, None):
    engine = Engine(tiny_model, config)
    engine.runner.segment = segment  # None: padded rows, as where attention is dense
    shapes = []
    program = engine.programs.forward_sample

    def spy(states, pools, x, program=program, shapes=shapes):
      shapes.append(x.tokens_BT.shape)
      return program(states, pools, x)

    engine.programs = dataclasses.replace(engine.programs, forward_sample=spy)
    got[segment] = engine.generate(prompts, params)
    assert shapes[0] == ((8, 16) if segment else (4, 64))
  assert got[16] == got[None] == generate(tiny_model, prompts, params)


@pytest.mark.parametrize("prompt_len, calls", [(40, [(4, 16)]), (32, [(2, 16), (1, 1)])])
def test_decode_rows_ride_in_the_segments_padding(tiny_model, prompt_len, calls):
  """A step that prefills a new prompt while a request decodes: 40 tokens are 3 segments,
  bucketed to 4, so the decoding row takes the fourth and the step is one call; 32 tokens are 2
  segments, bucket 2, where a third would grow the bucket, so the decode row runs on its own.
  Either way each request's tokens are `generate`'s."""
  config = EngineConfig(
    n_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=128, prefill_chunk=64
  )
  engine = Engine(tiny_model, config)
  shapes = []
  program = engine.programs.forward_sample

  def spy(states, pools, x):
    shapes.append(x.tokens_BT.shape)
    return program(states, pools, x)

  engine.programs = dataclasses.replace(engine.programs, forward_sample=spy)
  prompts = {"a": [3, 1, 4, 1, 5], "b": [t % 37 for t in range(prompt_len)]}
  params = SamplingParams(max_new_tokens=6)
  got = {rid: [] for rid in prompts}
  collect = lambda: [got[o.request_id].extend(o.new_token_ids) for o in engine.step()]
  engine.add_request("a", prompts["a"], params, stream=True)  # streamed: single decode steps
  collect()  # a's prefill
  collect()  # a's first decode step
  engine.add_request("b", prompts["b"], params, stream=True)
  del shapes[:]
  collect()  # b's prefill beside a's decode
  assert shapes == calls
  while engine.has_unfinished():
    collect()
  for rid, prompt in prompts.items():
    assert got[rid] == generate(tiny_model, [prompt], params)[0], rid


def test_min_batch_bucket_pads_every_step_and_changes_no_output(tiny_model):
  prompts, params = workload(9, n=3)
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS["roomy"], min_batch_bucket=8))
  rows = []
  for name in ("forward_sample", "decode_burst"):
    program = getattr(engine.programs, name)

    def spy(states, pools, x, *args, program=program):
      rows.append(x.tokens_BT.shape[0])
      return program(states, pools, x, *args)

    engine.programs = dataclasses.replace(engine.programs, **{name: spy})
  assert engine.generate(prompts, params) == want
  assert rows and set(rows) == {8}  # 3 requests, then fewer: always 8 rows
  with pytest.raises(ValueError, match="min_batch_bucket=3 is not allowed: must be a power of two"):
    dataclasses.replace(CONFIGS["roomy"], min_batch_bucket=3)


WARM = EngineConfig(
  n_blocks=96,
  block_size=4,
  max_num_seqs=2,
  max_model_len=128,
  prefill_chunk=32,
  decode_burst=4,
  offline_burst=8,
)


def test_cpu_step_programs_hand_ynnpack_only_their_dots(tiny_model):
  """On CPU the step programs compile with `steps.CPU_COMPILER_OPTIONS`: every YNNPACK call of
  the compiled decode step is a dot (XLA's default also hands it reductions and elementwise
  work, which cost more there at a decode step's sizes), and no reduction is split."""
  assert steps.compiler_options() == steps.CPU_COMPILER_OPTIONS  # this XLA knows the option
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS["roomy"], cpu_matmul="ynnpack"))
  for i in range(8):  # 8 rows: matmuls, not the matrix-vector products of one
    engine.add_request(i, [1, 2, 3 + i], SamplingParams(max_new_tokens=4))
  engine.step()  # the prompts: the requests now decode
  x = _decode_inputs(engine, 8)
  hlo, bodies, called = _compiled_step(engine.runner, x)
  assert called, "no YNNPACK call at all: the matmuls should still be YNNPACK's"
  assert all(" dot(" in bodies[name] for name in called), called
  # No reduction split into strided windows of 32 (XLA's tree reduction rewriter is off): the
  # attention's scores are summed in the loop that multiplies them, never written out first.
  # (The sampler's cumulative sums are reduce-windows of stride 1.)
  assert re.search(r"reduce-window\(.*stride=", hlo) is None
  # `cpu_matmul="xla"`: the same step with XLA's own dots, no YNNPACK call left.
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS["roomy"], cpu_matmul="xla"))
  assert "__ynn_fusion" not in _compiled_step(engine.runner, x)[0]


def _decode_inputs(engine, n_rows: int):
  """A one-token step's inputs for the first `n_rows` running requests."""
  rows = [engine.scheduler.row(req, 1) for req in engine.running[:n_rows]]
  return engine.runner.inputs(rows, 1, penalties=False)[0]


def _compiled_step(runner, x) -> tuple[str, dict[str, str], list[str]]:
  """The compiled one-token step for inputs `x`: its HLO text, its computations' bodies by
  name, and the computations its YNNPACK calls run."""
  program = runner.programs.forward_sample.lower(runner.states, runner.pools, runner.on_devices(x))
  hlo = program.compile().as_text()
  bodies = dict(re.findall(r"^(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, flags=re.M | re.S))
  return hlo, bodies, re.findall(r"calls=(%[\w.\-]+)[^\n]*__ynn_fusion", hlo)


def test_ynnpack_reductions_at_a_few_rows_serve_what_generate_does(tiny_model, reference):
  """`cpu_reductions="ynnpack"`: a step of up to `steps.YNN_REDUCE_ROWS` token rows compiles with
  YNNPACK's reductions (a YNNPACK call that reduces, the paged attention's scores), a larger step
  with its dots alone; the tokens are generate's."""
  prompts, params, want = reference
  config = dataclasses.replace(CONFIGS["roomy"], cpu_matmul="ynnpack", cpu_reductions="ynnpack")
  got, engine = serve(tiny_model, config, prompts, params, "staggered")
  assert got == want
  runner = engine.runner
  assert runner.ynn_reduce_rows == (1, 2, 4) and steps.YNN_REDUCE_ROWS == 4
  for i in range(8):
    engine.add_request(("rows", i), [1, 2, 3 + i], SamplingParams(max_new_tokens=4))
  engine.step()  # the prompts: the requests now decode

  def reducing_calls(n_rows: int) -> list[str]:
    _, bodies, called = _compiled_step(runner, _decode_inputs(engine, n_rows))
    assert called, "no YNNPACK call at all: the matmuls should still be YNNPACK's"
    return [name for name in called if " reduce(" in bodies[name]]

  assert reducing_calls(4)
  assert not reducing_calls(8)


def test_reductions_plan_and_the_programs_it_picks(tiny_model, caplog):
  """`cpu_reductions="auto"`: the probe's timings decide the 4-row decode step (1.1x faster
  with YNNPACK's reductions, or not), the engine logs them; `steps.programs` then picks XLA's
  dots up to their rows, YNNPACK's reductions at exactly the rows chosen, and YNNPACK's dots
  alone in between and above."""
  assert runner.reduce_plan({4: {"xla": 1.2, "ynnpack": 1.0}}) == (4,)
  assert runner.reduce_plan({4: {"xla": 1.05, "ynnpack": 1.0}}) == ()
  assert runner.reduce_plan({2: {"xla": 1.0, "ynnpack": 1.0}, 4: {"xla": 3, "ynnpack": 1}}) == (4,)
  graphdef = nnx.split(tiny_model)[0]
  burst = steps.programs(graphdef, xla_dots_rows=1, ynn_reduce_rows=(4,)).decode_burst
  assert [rows for rows, _ in burst.tiers] == [1, 3, 4]
  xla, many, reduced = (burst.pick(SimpleNamespace(tokens_BT=np.zeros((n, 1)))) for n in (1, 2, 4))
  assert len({id(xla), id(many), id(reduced)}) == 3 and many is burst.many
  assert burst.pick(SimpleNamespace(tokens_BT=np.zeros((8, 1)))) is many
  assert not isinstance(steps.programs(graphdef).decode_burst, steps.ByRows)  # no tiers
  config = dataclasses.replace(CONFIGS["roomy"], cpu_matmul="ynnpack", cpu_reductions="auto")
  with caplog.at_level(logging.INFO, logger="atlas_jax.serving"):
    engine = Engine(tiny_model, config)
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode attention:")]
  m = re.fullmatch(
    r"decode attention: reductions (XLA's|YNNPACK's at 4 rows, XLA's elsewhere) "
    r"\(ms at 4 rows: xla [0-9.]+, ynnpack [0-9.]+\)",
    said[0],
  )
  assert m is not None, said
  assert engine.runner.ynn_reduce_rows == (() if m[1] == "XLA's" else (4,))
  plain = Engine(tiny_model, dataclasses.replace(config, cpu_reductions="xla"))
  assert plain.runner.ynn_reduce_rows == ()


def test_warmup_levels_list_every_shape():
  model = build(ModelConfig(**{**TINY, "vocab_size": 44}, n_kv_heads=2), rngs=nnx.Rngs(6))
  engine = Engine(model, WARM)
  # 64 tokens, doublings, the context and the longest burst past it (offline, 8 steps)
  assert engine.runner.widths() == [16, 32, 34]
  shapes, deferred = engine.warmup_shapes()
  widths = (16, 32, 34)
  # On CPU prompts run as 16-token segments over the widest table: two rows of a 32-token chunk
  # are 4 segments at most, and every prefill, past a cached prefix too, is one of 3 shapes.
  assert engine.runner.segment == 16
  assert shapes[:3] == [("prefill", B, 16, 34) for B in (1, 2, 4)]
  assert shapes[3:9] == [("decode", B, 1, M) for B in (1, 2) for M in widths]
  # One burst program per shape, 8 iterations at most (online bursts run 4 of them)
  assert shapes[9:] == [("burst", B, 8, M) for B in (1, 2) for M in widths]
  assert engine.warmup_shapes("all") == (shapes, deferred)
  assert not any(d.startswith("prefills over a context") for d in deferred)
  engine.runner.segment = None  # prompt rows padded to their chunk, as where attention is dense
  shapes, deferred = engine.warmup_shapes()
  assert shapes[:4] == [("prefill", B, T, 16) for B in (1, 2) for T in (16, 32)]
  assert shapes[4:10] == [("decode", B, 1, M) for B in (1, 2) for M in widths]
  assert shapes[10:] == [("burst", B, 8, M) for B in (1, 2) for M in widths]
  assert deferred[0].startswith("prefills over a context already in the pool")
  every, _ = engine.warmup_shapes("all")
  prefills = [("prefill", B, T, M) for B in (1, 2) for T in (16, 32) for M in widths]
  assert every == prefills + shapes[4:]
  assert engine.warmup_shapes("none") == ([], ["every step shape", *deferred[1:]])
  allowed = "must be one of none, default, all"
  with pytest.raises(ValueError, match=f"serve.engine.warmup='some' is not allowed: {allowed}"):
    dataclasses.replace(WARM, warmup="some")


def warm_in_threads(engine: Engine, shapes) -> None:
  """`runner.warmup` on two threads, checked: every shape compiled once, in the pool's threads
  (a burst fed from the device runs the executable of one fed from the host); on the main
  thread only the chained bursts' inputs (`runner._carried`, one per batch bucket not seen
  before); one progress line per shape, counted in order."""
  seen, compiles = [], []

  def compiled_in(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(threading.current_thread() is threading.main_thread())

  carried = runner._carried._cache_size()
  jax.monitoring.register_event_duration_secs_listener(compiled_in)
  try:
    engine.runner.warmup(shapes, lambda i, n, shape: seen.append(f"{i}/{n} {shape}"), threads=2)
  finally:
    jax.monitoring.unregister_event_duration_listener(compiled_in)
  new_carried = runner._carried._cache_size() - carried
  assert sorted(compiles) == [False] * len(shapes) + [True] * new_carried
  n = len(shapes)
  assert [s.split(" ", 1)[0] for s in seen] == [f"{i}/{n}" for i in range(1, n + 1)]
  labels = sorted(f"{k} B={b} T={T} M={M}" for k, b, T, M in shapes)
  assert sorted(s.split(" ", 1)[1] for s in seen) == labels


def test_warmup_compiles_on_two_threads():
  # A model of its own: its step programs share no compiled shapes with other tests'.
  model = build(ModelConfig(**{**TINY, "vocab_size": 51}, n_kv_heads=2), rngs=nnx.Rngs(5))
  engine = Engine(model, WARM)
  every, _ = engine.warmup_shapes()
  shapes = [every[0], *(s for s in every if s[0] != "prefill" and s[1] == 2)][:3]
  assert [s[0] for s in shapes] == ["prefill", "decode", "decode"]
  shapes.append(next(s for s in every if s[0] == "burst" and s[1] == 2))
  warm_in_threads(engine, shapes)
  progs = engine.programs
  compiled = (progs.forward_sample._cache_size(), progs.decode_burst._cache_size())
  assert compiled == (3, 2)  # the burst's two call signatures: fed from the host and the device


@pytest.mark.parametrize(
  "burst, n_compiled",
  [
    # (the shape lists themselves: test_warmup_levels_list_every_shape, in the default suite)
    pytest.param(1, (9, 0), marks=pytest.mark.slow),
    # each burst twice: fed from the host, and chained on the device
    pytest.param(4, (9, 12), marks=pytest.mark.slow),
  ],
)
def test_after_warmup_nothing_compiles(burst, n_compiled):
  # A model of its own: its step programs share no compiled shapes with other tests'.
  model = build(ModelConfig(**{**TINY, "vocab_size": 42 + burst}, n_kv_heads=2), rngs=nnx.Rngs(5))
  engine = Engine(model, dataclasses.replace(WARM, decode_burst=burst))
  shapes, _ = engine.warmup_shapes()
  progs = engine.programs
  compiled = lambda: (progs.forward_sample._cache_size(), progs.decode_burst._cache_size())
  assert compiled() == (0, 0)
  warm_in_threads(engine, shapes)
  assert compiled() == n_compiled
  # Short and chunk-long prompts, alone and together, streamed (decode steps) and not (bursts),
  # each with a context through every block-table width to the end of the context.
  short, long = [1, 2, 3], [4, 5, 6, 7, 8] * 5
  groups = [[short, short[::-1]], [long], [short], [long[::-1], [9, 9]], [[7] * 25, [8] * 25]]
  for stream in (False, True):
    for group in groups:
      for i, p in enumerate(group):
        whole = SamplingParams(max_new_tokens=128 - len(p))
        engine.add_request((stream, len(engine.runner.shapes_met), i), p, whole, stream=stream)
      while engine.has_unfinished():
        engine.step()
  # Met: all but decode steps over the widest table, which holds a burst's draws past the end of
  # a context (a decode step reserves its own token only).
  assert engine.runner.shapes_met == set(shapes) - {("decode", B, 1, 34) for B in (1, 2)}
  assert compiled() == n_compiled  # and nothing compiled on the way


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
