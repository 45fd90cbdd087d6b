"""The ragged runner (the accelerator path) on CPU: one model call per engine step, padding of at
most one bucket's rounding, a known and bounded set of compiled shapes that a varied workload
never grows, the Pallas kernels (interpret mode) serving what `generate` does, and every step
program lowered for `cuda` and `tpu` with the kernels it would run there and no dense copy of a
sequence's pages."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig, MoEConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.serving.batch import pow2
from atlas_jax.serving.engine import Engine, EngineConfig
from atlas_jax.serving.runner import MIN_STEP_TOKENS, Shape

from .conftest import TINY
from .test_engine import workload

CONFIG = EngineConfig(
  runner="ragged",
  n_blocks=96,
  block_size=4,
  max_num_seqs=4,
  max_num_batched_tokens=64,
  prefill_chunk=32,
  max_model_len=96,
  decode_burst=4,
  offline_burst=8,
)


def spy_steps(engine) -> list:
  """The records every `forward_sample` call of the engine takes, in order."""
  calls = []
  program = engine.programs.forward_sample

  def spy(states, pools, x, program=program):
    calls.append(x)
    return program(states, pools, x)

  engine.programs = dataclasses.replace(engine.programs, forward_sample=spy)
  return calls


def test_one_model_call_per_step_and_one_bucket_of_padding(tiny_model):
  """Mixed steps (prompt chunks beside decode tokens, streamed so no burst hides them): each
  engine step is one model call, whose tokens per replica are the next power of two (at least
  `MIN_STEP_TOKENS`) of its real ones; the tokens are `generate`'s."""
  prompts, params = workload(4, n=8)
  want = generate(tiny_model, prompts, params)
  engine = Engine(tiny_model, CONFIG)
  calls = spy_steps(engine)
  got = {i: [] for i in range(len(prompts))}
  pending = list(range(len(prompts)))
  steps = 0
  while pending or engine.has_unfinished():
    if pending:  # one arrival per step, into a running batch
      i = pending.pop(0)
      engine.add_request(i, prompts[i], params[i], stream=True)
    before = len(calls)
    bursts = engine.n_bursts
    for out in engine.step():
      got[out.request_id] += out.new_token_ids
    if engine.n_bursts == bursts and len(calls) > before:
      steps += 1
      assert len(calls) == before + 1  # one call: every row's tokens at once
  assert [got[i] for i in range(len(prompts))] == want
  mixed = [x for x in calls if (np.asarray(x.query_len_B) > 1).any()]
  assert steps == len(calls) and len(mixed) > 3
  assert any((np.asarray(x.query_len_B) == 1).any() for x in mixed)  # decode rows rode along
  for x in calls:
    n = int(np.asarray(x.query_len_B).sum())
    assert x.tokens_RT.shape == (1, pow2(n, MIN_STEP_TOKENS))


def test_the_shapes_are_known_and_a_varied_workload_compiles_nothing_after_warmup():
  """The compiled shapes for these limits: a step per (token bucket, table width), a burst per
  (batch bucket, width); the first two compile at once and the rest in the background; after
  the warm-up, 200 requests of every prompt length, sampling mode and arrival pattern compile
  nothing more."""
  # A model of its own: its programs share no compiled shapes with other tests'.
  model = build(ModelConfig(**{**TINY, "vocab_size": 47}, n_kv_heads=2), rngs=nnx.Rngs(3))
  engine = Engine(model, CONFIG)
  shapes, _ = engine.warmup_shapes()
  widths = engine.runner.widths()
  assert widths == [16, 26]  # 64 tokens, then the context and the longest burst past it
  tokens = (16, 32, 64)  # to the budget of 64
  steps = [Shape("step", min(T, 8), T, M) for M in widths for T in tokens]
  bursts = [Shape("burst", 8, 8, M) for M in widths]  # one batch bucket: 4 rows pad to 8
  # The first of each kind first: what the first requests run, compiled before a server answers.
  assert shapes == [steps[0], bursts[0], *steps[1:], *bursts[1:]]
  compiles = []
  listener = lambda event, seconds, **kw: (
    compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
  )
  # One warm-up serves both checks (each compiles every shape of a model of its own).
  seen = []
  thread = engine.warmup(lambda i, n, shape: seen.append((i, n)), first=2)
  assert thread is not None and seen[:2] == [(1, 8), (2, 8)]
  assert engine.runner.wait_compiled(timeout=300)
  assert [i for i, _ in seen] == list(range(1, 9))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    rng = np.random.default_rng(0)
    for i in range(200):
      n = int(rng.integers(1, 60))
      sp = SamplingParams(
        max_new_tokens=int(rng.integers(1, 96 - n)) if i % 10 == 0 else int(rng.integers(1, 12)),
        temperature=float(i % 2),
        top_p=0.9 if i % 5 == 0 else 1.0,
        seed=i,
      )
      engine.add_request(i, rng.integers(0, 47, n).tolist(), sp, stream=i % 3 == 0)
      if i % 7 == 0:  # arrivals in small groups, into running batches
        for _ in range(int(rng.integers(1, 4))):
          engine.step()
    while engine.has_unfinished():
      engine.step()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  assert engine.runner.shapes_met <= set(shapes)


@pytest.fixture(scope="module")
def pallas_model():
  cfg = ModelConfig(**TINY, n_kv_heads=2, init_std=0.3)
  return build(cfg, rngs=nnx.Rngs(0), implementation="pallas")


def test_the_pallas_kernels_serve_what_generate_does(pallas_model):
  """The ragged kernel in interpret mode, in every program: mixed steps, bursts."""
  prompts, params = workload(2, n=4)
  want = generate(pallas_model, prompts, params)
  config = dataclasses.replace(CONFIG, max_num_batched_tokens=32, prefill_chunk=16)
  assert Engine(pallas_model, config).generate(prompts, params) == want


def _lowered(engine, platform: str) -> dict[str, str]:
  """Each step program of the engine lowered for `platform`: the mixed step, the burst and
  (with a draft) the speculative round, over a decoding request's records."""
  r = engine.runner
  if not engine.running:
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8))
    engine.step()  # the prompt: the request now decodes
  rows = [engine.scheduler.row(engine.running[0], 1)]
  step, _ = r.step_record(rows)
  decode, _ = r.decode_record(rows, penalties=False)
  lower = lambda f, *args: f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  out = {
    "step": lower(r.programs.forward_sample, r.states, r.pools, step),
    "burst": lower(r.programs.decode_burst, r.states, r.pools, decode, 4, np.int32(2)),
  }
  if r.programs.speculative_round is not None:
    out["round"] = lower(r.programs.speculative_round, r.states, r.pools, decode, 2)
  return out


def _pool_gathers(text: str, pools) -> list[str]:
  """The gathers in a lowered module whose operand is a pool array, under any reshape (as many
  elements as one)."""
  sizes = {int(np.prod(a.shape)) for a in jax.tree.leaves(pools)}
  out = []
  for line in text.splitlines():
    if "stablehlo.gather" not in line and "stablehlo.dynamic_gather" not in line:
      continue
    operand = re.search(r":\s*\(tensor<([\dx]+)x\w+>", line)
    if operand and int(np.prod([int(d) for d in operand[1].split("x")])) in sizes:
      out.append(line.strip())
  return out


SHAPES = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128)


GEMMA = dict(
  n_kv_heads=2,
  layer_types=("sliding_attention", "full_attention"),
  sliding_window=8,
  rope_local_theta=1000.0,
  attn_logit_softcapping=5.0,
  final_logit_softcapping=3.0,
  query_pre_attn_scalar=24.0,
  post_norms=True,
  mlp_activation="gelu_tanh",
  scale_embeddings=True,
)


GPT_OSS = dict(
  n_kv_heads=2,
  layer_types=("sliding_attention", "full_attention"),
  sliding_window=8,
  qkv_bias=True,
  attn_out_bias=True,
  attention_sinks=True,
  moe=MoEConfig(
    n_experts=4,
    top_k=2,
    expert_ffn_dim=32,
    router_bias=True,
    expert_bias=True,
    swiglu_limit=7.0,
  ),
)


# Under -m slow: GQA alone (the draft case lowers the same target's programs, then the draft
# model's) and Gemma (gpt-oss's local and global layers take the same switch).
@pytest.mark.parametrize(
  "kind",
  [
    pytest.param("gqa", marks=pytest.mark.slow),
    "mla",
    "draft",
    pytest.param("gemma", marks=pytest.mark.slow),
    "gpt_oss",
  ],
)
def test_every_step_program_lowers_for_cuda_and_tpu(kind):
  """On a CPU host, each program lowered for cuda holds the Triton kernel and for tpu the
  Mosaic one, and neither gathers a pool: no sequence's pages are copied densely. Gemma's
  local and global layers: each layer's branch of the switch holds its own kernel call (and
  gpt-oss's, with its sinks)."""
  if kind in ("gemma", "gpt_oss"):
    cfg = ModelConfig(**SHAPES, **(GEMMA if kind == "gemma" else GPT_OSS))
  elif kind == "mla":
    mla = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    cfg = ModelConfig(**SHAPES, n_kv_heads=4, mla=mla)
  else:
    cfg = ModelConfig(**SHAPES, n_kv_heads=2)
  model = build(cfg, rngs=nnx.Rngs(0))
  draft = None
  if kind == "draft":
    dcfg = ModelConfig(**{**SHAPES, "n_layers": 1}, n_kv_heads=2)
    draft = build(dcfg, rngs=nnx.Rngs(1))
  engine = Engine(model, dataclasses.replace(CONFIG, num_speculative_tokens=2), draft=draft)
  # Gemma's and gpt-oss's windowed layers keep their blocks in a pool of their own.
  assert (engine.runner.n_window_blocks is not None) == (kind in ("gemma", "gpt_oss"))
  for platform, marker in (("cuda", "xla.gpu.triton"), ("tpu", "tpu_custom_call")):
    for name, text in _lowered(engine, platform).items():
      assert marker in text, (platform, name)
      if kind in ("gemma", "gpt_oss"):  # a kernel call in each window's branch
        assert text.count(marker) >= 2 and "stablehlo.case" in text, (platform, name)
      assert not _pool_gathers(text, engine.pools), (platform, name, _pool_gathers(text, [1]))
  # The check finds gathers from a pool where there are some: the CPU lowering's XLA loop reads
  # its pages through gathers (a page step at a time).
  assert _pool_gathers(_lowered(engine, "cpu")["step"], engine.pools)
