"""The CPU runner (`atlas_jax.serving.cpu`): its weight layouts, probes, segments, compiler tiers
and shapes serve what `generate` does."""

import dataclasses
import logging
import re
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, CPUConfig, ModelConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.model.scan import is_unstacked
from atlas_jax.serving import runner as runner_module
from atlas_jax.serving import steps
from atlas_jax.serving.cpu import compile as cpu_compile
from atlas_jax.serving.cpu import probes
from atlas_jax.serving.cpu import runner as cpu_runner
from atlas_jax.serving.cpu.compile import ByRows, CPUCompile
from atlas_jax.serving.cpu.weights import OutMajor, layer_bytes
from atlas_jax.serving.engine import Engine, EngineConfig
from atlas_jax.serving.runner import Shape

from .conftest import TINY
from .test_engine import CONFIGS as RAGGED_CONFIGS
from .test_engine import WARM as RAGGED_WARM
from .test_engine import serve, workload

CONFIGS = {name: dataclasses.replace(c, runner="cpu") for name, c in RAGGED_CONFIGS.items()}
WARM = dataclasses.replace(RAGGED_WARM, runner="cpu")


def cpu_config(**cpu) -> EngineConfig:
  return dataclasses.replace(CONFIGS["roomy"], cpu=CPUConfig(**cpu))


@pytest.fixture(scope="module")
def reference(tiny_model):
  prompts, params = workload(0)
  return prompts, params, generate(tiny_model, prompts, params)


@pytest.mark.parametrize(
  "name", ["roomy", pytest.param("tight", marks=pytest.mark.slow)]
)  # the tight pool's preemption: the ragged runner's suite
def test_cpu_runner_equals_generate(tiny_model, reference, name):
  prompts, params, want = reference
  got, engine = serve(tiny_model, CONFIGS[name], prompts, params, "staggered")
  assert got == want
  assert type(engine.runner).__name__ == "CPUModelRunner"


def test_auto_picks_the_cpu_runner_on_a_cpu(tiny_model):
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS["roomy"], runner="auto"))
  assert isinstance(engine.runner, cpu_runner.CPUModelRunner)
  engine = Engine(tiny_model, dataclasses.replace(CONFIGS["roomy"], runner="ragged"))
  assert type(engine.runner) is runner_module.ModelRunner


def _held_out_major(engine) -> int:
  leaves = jax.tree.leaves(engine.runner.states[0], is_leaf=lambda x: isinstance(x, OutMajor))
  return sum(isinstance(x, OutMajor) for x in leaves)


@pytest.mark.parametrize(
  "layout, matmul",
  [
    pytest.param("in_major", "ynnpack", marks=pytest.mark.slow),
    pytest.param("out_major", "ynnpack", marks=pytest.mark.slow),
    pytest.param("in_major", "xla", marks=pytest.mark.slow),
    pytest.param("stacked", "ynnpack", marks=pytest.mark.slow),
    ("auto", "auto"),
  ],
)
def test_every_weight_layout_serves_what_generate_does(
  tiny_model, reference, layout, matmul, caplog
):
  """`cpu.weight_layout` and `cpu.matmul`: the layer stacks held as trained (the layer scan slices
  them) or one array per layer, the projections then as trained or transposed (7 a layer), the
  dots YNNPACK's or XLA's own, or as the start-up probe found faster, which it logs with its
  timings (and on one CPU device holds in-major projections stacked); the tokens are
  generate's."""
  prompts, params, want = reference
  config = cpu_config(weight_layout=layout, matmul=matmul)
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
    assert xla_rows == (probes.ALL_ROWS if matmul == "xla" else 0)
  assert held == (7 * tiny_model.cfg.n_layers if layout == "out_major" else 0)
  # "auto" (layout now the probe's): on one CPU device in-major projections stay stacked.
  stacked = layout == "stacked" or (matmul == "auto" and layout == "in_major")
  assert engine.runner.stacked == stacked
  assert is_unstacked(engine.runner.states[0]) == (not stacked)
  burst = engine.runner.programs.decode_burst
  assert isinstance(burst, ByRows) == (xla_rows > 0 or bool(engine.runner.ynn_reduce_rows))


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
    ({}, "in_major", "xla", (False, probes.ALL_ROWS)),
    ({}, "out_major", "ynnpack", (True, 0)),
  ],
)
def test_matmul_plan(timings, layout, matmul, plan):
  assert probes.matmul_plan(timings, layout, matmul) == plan


def test_auto_plan_is_probed_once_and_remembered(tiny_model, monkeypatch, tmp_path):
  """The probe times the projections once per machine and shapes: a second engine takes the
  first one's plan (a probe that flipped on near-equal timings would recompile every program),
  and with a compilation cache so does a later process, from the timings kept beside it."""
  timed = []

  def fake(mats, rows, kinds):
    timed.append(rows)
    return {k: 1.0 if k == ("in_major", "xla") else 2.0 for k in kinds}

  monkeypatch.setattr(probes, "_memory", {})
  monkeypatch.setattr(probes, "time_matmuls", fake)
  store = tmp_path / "atlas_jax_cpu_probes.json"  # where a compilation cache's folder keeps it
  monkeypatch.setattr(probes, "_store", lambda: store)
  config = cpu_config(weight_layout="auto", matmul="auto")
  engines = [Engine(tiny_model, config) for _ in range(2)]
  assert timed == [1, 2, 4, 8]  # every decode bucket up to max_num_seqs, once
  assert [e.runner.xla_dots_rows for e in engines] == [8, 8]
  assert [_held_out_major(e) for e in engines] == [0, 0]
  assert store.exists()
  monkeypatch.setattr(probes, "_memory", {})  # a new process: the file's timings, no probe
  assert Engine(tiny_model, config).runner.xla_dots_rows == 8 and timed == [1, 2, 4, 8]


def test_auto_keeps_small_layers_stacked(tiny_model, monkeypatch):
  """`weight_layout="auto"` on one CPU device with in-major projections: layers of at most
  `runner.STACKED_LAYER_BYTES` stay stacked (the layer scan slices them), larger ones are held
  one array per layer; a layer's bytes are its parameters'."""
  cfg = tiny_model.cfg
  D, H = cfg.d_model, cfg.d_model // cfg.n_heads
  params = 2 * D * cfg.n_heads * H + 2 * D * cfg.n_kv_heads * H + 3 * D * cfg.ffn_dim + 2 * D
  assert layer_bytes(nnx.state(tiny_model)) == 4 * params
  monkeypatch.setattr(probes, "_memory", {})
  in_major_faster = lambda mats, rows, kinds: {k: 1.0 + (k[0] == "out_major") for k in kinds}
  monkeypatch.setattr(probes, "time_matmuls", in_major_faster)
  config = cpu_config(weight_layout="auto", matmul="ynnpack")
  engine = Engine(tiny_model, config)
  assert engine.runner.stacked and not is_unstacked(engine.runner.states[0])
  monkeypatch.setattr(cpu_runner, "STACKED_LAYER_BYTES", 4 * params - 1)
  engine = Engine(tiny_model, config)
  assert not engine.runner.stacked and is_unstacked(engine.runner.states[0])


def test_cpu_settings_are_checked(tiny_model):
  with pytest.raises(
    ConfigError,
    match="serve.engine.cpu.weight_layout='sideways' is not allowed: must be one of auto, "
    "stacked, in_major, out_major",
  ):
    CPUConfig(weight_layout="sideways")
  for layout in ("out_major", "stacked"):
    config = EngineConfig(
      runner="cpu", n_blocks=16, tensor_parallel_size=2, cpu=CPUConfig(weight_layout=layout)
    )
    with pytest.raises(
      ConfigError,
      match=f"serve.engine.cpu.weight_layout='{layout}' is not allowed on a mesh of 1 x 2 "
      "devices: a mesh holds its layers one array each",
    ):
      Engine(tiny_model, config)
  with pytest.raises(ConfigError, match="cpu.matmul='blas' is not allowed: must be one of"):
    CPUConfig(matmul="blas")
  with pytest.raises(
    ConfigError,
    match="serve.engine.cpu.reductions='blas' is not allowed: must be one of auto, xla, ynnpack",
  ):
    CPUConfig(reductions="blas")
  config = EngineConfig(
    runner="cpu", n_blocks=16, tensor_parallel_size=2, cpu=CPUConfig(matmul="xla")
  )
  with pytest.raises(
    ConfigError, match="serve.engine.cpu.matmul='xla' is not allowed on a mesh of 1 x 2 devices"
  ):
    Engine(tiny_model, config)
  with pytest.raises(ConfigError, match="serve.engine.runner='gpu' is not allowed"):
    EngineConfig(runner="gpu")


def test_old_engine_fields_move_into_the_cpu_section():
  """Run folders and --set overrides written with the CPU fields on the engine still load."""
  from atlas_jax.config import read_config

  data = read_config(None, ["serve.engine.weight_layout=stacked", "serve.engine.cpu_matmul=xla"])
  assert data["serve"]["engine"]["cpu"] == {"weight_layout": "stacked", "matmul": "xla"}


def test_prompts_run_as_segments_and_pad_less(tiny_model):
  """On CPU a step's prompts are cut into 16-token segments (`ModelRunner.segments`): three
  prompts of 40, 3 and 17 tokens are 6 segments, 8 x 16 = 128 token slots, where rows padded to
  the longest prompt take 4 x 64 = 256; the tokens are those of padded rows and of `generate`."""
  prompts = [list(range(40)), [5, 6, 7], list(range(3, 20))]
  params = SamplingParams(max_new_tokens=6)
  config = EngineConfig(
    runner="cpu",
    n_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    prefill_chunk=64,
  )
  got = {}
  for segment in (16, None):
    engine = Engine(tiny_model, config)
    engine.runner.segment = segment  # None: padded rows, as where attention is dense
    shapes = []
    program = engine.programs.forward_sample

    def spy(states, pools, x, program=program, shapes=shapes):
      shapes.append(x.tokens_RT.shape)
      return program(states, pools, x)

    engine.programs = dataclasses.replace(engine.programs, forward_sample=spy)
    got[segment] = engine.generate(prompts, params)
    assert shapes[0] == ((8, 16) if segment else (4, 64))
  assert got[16] == got[None] == generate(tiny_model, prompts, params)


@pytest.mark.parametrize(
  "prompt_len, calls",
  [(40, [("step", (4, 16))]), (32, [("step", (2, 16)), ("burst", (1, 1))])],
)
def test_decode_rows_ride_in_the_segments_padding(tiny_model, prompt_len, calls):
  """A step that prefills a new prompt while a request decodes: 40 tokens are 3 segments,
  bucketed to 4, so the decoding row takes the fourth and the step is one call; 32 tokens are 2
  segments, bucket 2, where a third would grow the bucket, so the decode row runs on its own,
  in the burst program for one iteration (`CPUModelRunner.decode`). Either way each request's
  tokens are `generate`'s."""
  config = EngineConfig(
    runner="cpu",
    n_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    prefill_chunk=64,
  )
  engine = Engine(tiny_model, config)
  shapes = []

  def spy(kind, program):
    def call(states, pools, x, *static):
      shapes.append((kind, x.tokens_RT.shape))
      return program(states, pools, x, *static)

    return call

  progs = engine.programs
  engine.programs = dataclasses.replace(
    progs,
    forward_sample=spy("step", progs.forward_sample),
    decode_burst=spy("burst", progs.decode_burst),
  )
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


def test_cpu_step_programs_hand_ynnpack_only_their_dots(tiny_model):
  """On CPU the step programs compile with `steps.CPU_COMPILER_OPTIONS`: every YNNPACK call of
  the compiled decode step is a dot (XLA's default also hands it reductions and elementwise
  work, which cost more there at a decode step's sizes), and no reduction is split."""
  assert (
    cpu_compile.compiler_options() == cpu_compile.CPU_COMPILER_OPTIONS
  )  # this XLA knows the option
  engine = Engine(tiny_model, cpu_config(matmul="ynnpack"))
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
  # `cpu.matmul="xla"`: the same step with XLA's own dots, no YNNPACK call left.
  engine = Engine(tiny_model, cpu_config(matmul="xla"))
  assert "__ynn_fusion" not in _compiled_step(engine.runner, x)[0]


def _decode_inputs(engine, n_rows: int):
  """A one-token step's inputs for the first `n_rows` running requests."""
  rows = [engine.scheduler.row(req, 1) for req in engine.running[:n_rows]]
  return engine.runner.decode_record(rows, penalties=False)[0]


def _compiled_step(runner, x) -> tuple[str, dict[str, str], list[str]]:
  """The compiled one-token step for inputs `x`: its HLO text, its computations' bodies by
  name, and the computations its YNNPACK calls run."""
  program = runner.programs.forward_sample.lower(runner.states, runner.pools, runner.on_devices(x))
  hlo = program.compile().as_text()
  bodies = dict(re.findall(r"^(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, flags=re.M | re.S))
  return hlo, bodies, re.findall(r"calls=(%[\w.\-]+)[^\n]*__ynn_fusion", hlo)


@pytest.mark.slow
def test_ynnpack_reductions_at_a_few_rows_serve_what_generate_does(tiny_model, reference):
  """`cpu.reductions="ynnpack"`: a step of up to `cpu_compile.YNN_REDUCE_ROWS` token rows
  compiles with YNNPACK's reductions (a YNNPACK call that reduces, the paged attention's scores),
  a larger step with its dots alone; the tokens are generate's."""
  prompts, params, want = reference
  config = cpu_config(matmul="ynnpack", reductions="ynnpack")
  got, engine = serve(tiny_model, config, prompts, params, "staggered")
  assert got == want
  runner = engine.runner
  assert runner.ynn_reduce_rows == (1, 2, 4) and cpu_compile.YNN_REDUCE_ROWS == 4
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
  """`cpu.reductions="auto"`: the probe's timings decide the 4-row decode step (1.1x faster
  with YNNPACK's reductions, or not), the engine logs them; `steps.programs` then picks XLA's
  dots up to their rows, YNNPACK's reductions at exactly the rows chosen, and YNNPACK's dots
  alone in between and above."""
  assert probes.reduce_plan({4: {"xla": 1.2, "ynnpack": 1.0}}) == (4,)
  assert probes.reduce_plan({4: {"xla": 1.05, "ynnpack": 1.0}}) == ()
  assert probes.reduce_plan({2: {"xla": 1.0, "ynnpack": 1.0}, 4: {"xla": 3, "ynnpack": 1}}) == (4,)
  graphdef = nnx.split(tiny_model)[0]
  burst = steps.programs(graphdef, compile=CPUCompile(1, (4,))).decode_burst
  assert [rows for rows, _ in burst.tiers] == [1, 3, 4]
  xla, many, reduced = (burst.pick(SimpleNamespace(tokens_RT=np.zeros((n, 1)))) for n in (1, 2, 4))
  assert len({id(xla), id(many), id(reduced)}) == 3 and many is burst.many
  assert burst.pick(SimpleNamespace(tokens_RT=np.zeros((8, 1)))) is many
  assert not isinstance(steps.programs(graphdef).decode_burst, ByRows)  # no tiers
  config = cpu_config(matmul="ynnpack", reductions="auto")
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
  plain = Engine(tiny_model, cpu_config(matmul="ynnpack", reductions="xla"))
  assert plain.runner.ynn_reduce_rows == ()


def test_warmup_levels_list_every_shape():
  model = build(ModelConfig(**{**TINY, "vocab_size": 44}, n_kv_heads=2), rngs=nnx.Rngs(6))
  engine = Engine(model, WARM)
  # One width: the context and the longest burst past it (offline, 8 steps). XLA's paged loop
  # walks each row's pages up to the longest length held, whatever the table's width.
  assert engine.runner.widths() == [34]
  shapes, deferred = engine.warmup_shapes()
  # On CPU prompts run as 16-token segments: two rows of a 32-token chunk are 4 segments at
  # most, and every prefill, past a cached prefix too, is one of 3 shapes.
  assert engine.runner.segment == 16
  prefills = [Shape("prefill", B, 16, 34) for B in (1, 2, 4)]
  # One burst program per shape, 8 iterations at most (online bursts run 4 of them); a decode
  # step is its burst run for one iteration, so no decode program of its own.
  bursts = [Shape("burst", B, 8, 34) for B in (1, 2)]
  # The first of each kind first (what the first requests run), then the rest in order.
  assert shapes == [prefills[0], bursts[0], *prefills[1:], *bursts[1:]]
  assert engine.warmup_shapes("all") == (shapes, deferred)
  engine.runner.segment = None  # prompt rows padded to their chunk, as with a drafter
  shapes, deferred = engine.warmup_shapes()
  prefills = [Shape("prefill", B, T, 34) for B in (1, 2) for T in (16, 32)]
  assert shapes == [prefills[0], bursts[0], *prefills[1:], *bursts[1:]]
  assert engine.warmup_shapes("all") == (shapes, deferred)
  # With bursts off, decode steps are programs of their own.
  unburst = Engine(model, dataclasses.replace(WARM, decode_burst=1))
  decodes = [Shape("decode", B, 1, 34) for B in (1, 2)]
  assert [s for s in unburst.warmup_shapes()[0] if s.kind != "prefill"] == decodes
  assert engine.warmup_shapes("none") == ([], ["every step shape", *deferred])
  allowed = "must be one of none, default, all"
  with pytest.raises(ValueError, match=f"serve.engine.warmup='some' is not allowed: {allowed}"):
    dataclasses.replace(WARM, warmup="some")


def warm_in_threads(engine: Engine, shapes) -> None:
  """`runner.warmup` on two threads, checked: every shape compiled once, in the pool's threads
  (a burst fed from the device runs the executable of one fed from the host); on the main
  thread only the chained bursts' inputs (`runner_module._carried`, one per batch bucket not seen
  before); one progress line per shape, counted in order."""
  seen, compiles = [], []

  def compiled_in(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(threading.current_thread() is threading.main_thread())

  carried = runner_module._carried._cache_size()
  jax.monitoring.register_event_duration_secs_listener(compiled_in)
  try:
    engine.runner.warmup(shapes, lambda i, n, shape: seen.append(f"{i}/{n} {shape}"), threads=2)
  finally:
    jax.monitoring.unregister_event_duration_listener(compiled_in)
  new_carried = runner_module._carried._cache_size() - carried
  assert sorted(compiles) == [False] * len(shapes) + [True] * new_carried
  n = len(shapes)
  assert [s.split(" ", 1)[0] for s in seen] == [f"{i}/{n}" for i in range(1, n + 1)]
  labels = sorted(map(str, shapes))
  assert sorted(s.split(" ", 1)[1] for s in seen) == labels


def test_warmup_compiles_on_two_threads():
  # A model of its own: its step programs share no compiled shapes with other tests'.
  model = build(ModelConfig(**{**TINY, "vocab_size": 51}, n_kv_heads=2), rngs=nnx.Rngs(5))
  engine = Engine(model, WARM)
  every, _ = engine.warmup_shapes()
  shapes = [s for s in every if s.kind == "prefill"][:3]
  assert [s.kind for s in shapes] == ["prefill"] * 3
  shapes.append(next(s for s in every if s.kind == "burst" and s.b == 2))
  warm_in_threads(engine, shapes)
  progs = engine.programs
  compiled = (progs.forward_sample._cache_size(), progs.decode_burst._cache_size())
  assert compiled == (3, 2)  # the burst's two call signatures: fed from the host and the device


@pytest.mark.parametrize(
  "burst, n_compiled",
  [
    # (the shape lists themselves: test_warmup_levels_list_every_shape, in the default suite)
    pytest.param(1, (5, 0), marks=pytest.mark.slow),
    # each burst twice: fed from the host, and chained on the device; decode steps run bursts
    pytest.param(4, (3, 4), marks=pytest.mark.slow),
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
  assert engine.runner.shapes_met == set(shapes)
  assert compiled() == n_compiled  # and nothing compiled on the way
