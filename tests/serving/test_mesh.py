"""Serving on a device mesh (8 fake CPU devices): tensor- and data-parallel engines give the
single-device engine's tokens, greedy and seeded-sampled, with prefix caching, chunked prefill
and a pool small enough to preempt; speculation (a draft model, MTP heads) and guided requests
likewise under tensor 4; the pool lies where it should and no device gathers another's."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, MLAConfig, ModelConfig, MTPConfig
from atlas_jax.data.tokenizer import ByteTokenizer
from atlas_jax.decoding import SamplingParams
from atlas_jax.decoding.guided import GrammarCompiler, spec_from_request
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig
from atlas_jax.serving.runner import Shape

from .conftest import MOE

SHAPE = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=8, ffn_dim=64, max_seq_len=128)
# 16 blocks of 4 tokens per replica for 4 running requests of up to ~50 tokens: preemption;
# chunks of 8 tokens: prompts take several steps; one batch bucket: each program compiles once.
CONFIG = EngineConfig(
  runner="ragged",
  n_blocks=16,
  block_size=4,
  max_num_seqs=4,
  max_num_batched_tokens=16,
  prefill_chunk=8,
  min_batch_bucket=4,
)


def model_of(kind: str, **kw):
  if kind in ("moe", "moe_mla"):  # every expert's FFN split over the tensor axis
    mla = MLAConfig(16, 8, 8, 8) if kind == "moe_mla" else None
    moe = MOE["mla" if mla else "gqa"]
    cfg = ModelConfig(**SHAPE, n_kv_heads=2, init_std=0.3, mla=mla, moe=moe, **kw)
    return build(cfg, rngs=nnx.Rngs(0))
  if kind == "gqa":  # K=2 < 4 and 8: kv heads repeated up to the tensor size
    cfg = ModelConfig(**SHAPE, n_kv_heads=2, init_std=0.3, **kw)
  elif kind == "hybrid":  # a windowed and a full-attention layer: two pools (`HybridPool`)
    types = ("sliding_attention", "full_attention")
    cfg = ModelConfig(
      **SHAPE, n_kv_heads=2, init_std=0.3, sliding_window=8, layer_types=types, **kw
    )
  else:
    mla = MLAConfig(16, 8, 8, 8, q_lora_rank=12 if kind == "mla_qlora" else None)
    cfg = ModelConfig(**SHAPE, n_kv_heads=8, mla=mla, init_std=0.3, **kw)
  return build(cfg, rngs=nnx.Rngs(0))


def workload(vocab=48):
  """Six requests, greedy and seeded-sampled; two share a 20-token prefix (prefix caching)."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, vocab, int(n)).tolist() for n in (23, 9, 30, 14, 5, 17)]
  prompts[3] = prompts[0][:20] + prompts[3]
  params = [
    SamplingParams(
      max_new_tokens=int(rng.integers(6, 16)),
      temperature=float(i % 2),
      top_k=(i % 3) * 5,
      seed=100 + i,
    )
    for i in range(6)
  ]
  return prompts, params


def serve(model, config=CONFIG, draft=None, **kw):
  engine = Engine(model, config, draft=draft, eos_id=3, **kw)
  return engine.generate(*workload(model.cfg.vocab_size)), engine


@pytest.fixture(scope="module")
def reference():
  """kind -> (model, the single-device engine's tokens), computed on first use."""
  cache = {}

  def get(kind):
    if kind not in cache:
      model = model_of(kind)
      got, engine = serve(model)
      assert engine.n_preemptions > 0 and engine.kv_stats().prefix_hit_tokens > 0
      cache[kind] = model, got
    return cache[kind]

  return get


MESHES = [(1, 2), (1, 4), (1, 8), (2, 4), (8, 1)]
# The default run: a tensor mesh that repeats kv heads, data x tensor (the hybrid model's
# windowed pool), and DeepSeek-style experts with MLA split over the tensor axis; the whole
# sweep with -m slow.
FAST = {
  ("gqa", (1, 4)),
  ("moe_mla", (1, 4)),
  ("hybrid", (2, 4)),
}
CASES = [
  pytest.param(
    kind,
    mesh,
    id=f"{kind}-data{mesh[0]}xtensor{mesh[1]}",
    marks=() if (kind, mesh) in FAST else pytest.mark.slow,
  )
  for kind in ("gqa", "mla", "mla_qlora", "moe", "moe_mla", "hybrid")
  for mesh in MESHES
]


@pytest.mark.parametrize("kind, mesh", CASES)
def test_a_mesh_serves_the_single_device_tokens(reference, kind, mesh):
  model, want = reference(kind)
  dp, tp = mesh
  config = dataclasses.replace(CONFIG, data_parallel_size=dp, tensor_parallel_size=tp)
  got, engine = serve(model, config)
  assert got == want
  if model.cfg.moe is not None:  # each device holds 1/tp of every expert
    mlp = engine.runner.states[0]["blocks"]["mlp"]
    for name in ("w_gate", "w_up", "w_down"):
      w = mlp[name][...]  # the layer stack, as the model holds it: [L, E, D, F]
      assert w.shape[0] == sum(model.cfg.sparse_layers()), name
      assert w.addressable_shards[0].data.size == w.size // tp, name
  s = engine.kv_stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks == engine.config.n_blocks * dp
  if kind == "hybrid":  # the windowed layer's pool apart, its pages split over the replicas
    assert all(a.sliding.stats().n_used == 0 for a in engine.allocators)
    sliding = engine.pools[0].sliding.k
    assert sliding.shape[1] == engine.runner.n_window_blocks * dp
    assert sliding.addressable_shards[0].data.shape[1] == engine.runner.n_window_blocks
  if dp <= 2:  # 8 replicas hold the 6 requests without preempting or sharing a prefix
    assert engine.n_preemptions > 0 and s.prefix_hit_tokens > 0
  # The requests were spread over the replicas, each admitted on the least loaded.
  used = [a.stats().prefix_query_tokens > 0 for a in engine.allocators]
  assert sum(used) == min(dp, len(want))


# The default run serves MLA over data x context; context x tensor under -m slow (the step's
# program over that mesh is compiled by test_prefill_context_parallelism_splits_the_steps_matmuls).
PCP_CASES = [
  pytest.param("gqa", (1, 2, 2), id="gqa-context2xtensor2", marks=pytest.mark.slow),
  pytest.param("mla", (2, 1, 4), id="mla-data2xcontext4"),
  pytest.param("hybrid", (2, 2, 2), id="hybrid-data2xcontext2xtensor2", marks=pytest.mark.slow),
  pytest.param("moe", (1, 2, 4), id="moe-context4xtensor2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, mesh", PCP_CASES)
def test_prefill_context_parallelism_serves_the_single_device_tokens(reference, kind, mesh):
  """Each ragged step's tokens split over the context axis (the bursts run whole on each of
  its devices): the single-device tokens, under preemption and prefix caching."""
  model, want = reference(kind)
  dp, tp, pcp = mesh
  config = dataclasses.replace(
    CONFIG, data_parallel_size=dp, tensor_parallel_size=tp, prefill_context_parallel_size=pcp
  )
  got, engine = serve(model, config)
  assert got == want and engine.mesh.shape["context"] == pcp
  # The pool is whole on every device of the context axis: its pages split over data only.
  k = jax.tree.leaves(engine.pools[0])[0]
  assert k.addressable_shards[0].data.shape[1] == k.shape[1] // dp


@pytest.mark.slow
def test_prefill_context_parallelism_with_the_pallas_kernel():
  """The ragged kernel in interpret mode, each device's queries its share of a step's tokens:
  a hybrid model under context 2 x tensor 2 serves one device's tokens."""
  types = ("sliding_attention", "full_attention")
  cfg = ModelConfig(**SHAPE, n_kv_heads=2, init_std=0.3, sliding_window=8, layer_types=types)
  model = build(cfg, rngs=nnx.Rngs(0), implementation="pallas")
  config = dataclasses.replace(CONFIG, max_num_batched_tokens=32, prefill_chunk=16)
  want, _ = serve(model, config)
  split = dataclasses.replace(config, prefill_context_parallel_size=2, tensor_parallel_size=2)
  assert serve(model, split)[0] == want


def test_prefill_context_parallelism_splits_the_steps_matmuls():
  """A step of 64 tokens over context 2: every projection's matmul on each device has 32 rows
  (the compiled per-device program), where without the axis it has 64."""
  model = model_of("gqa")
  rows = {}
  for pcp in (1, 2):
    config = dataclasses.replace(
      CONFIG,
      tensor_parallel_size=2,
      prefill_context_parallel_size=pcp,
      max_num_batched_tokens=64,
      prefill_chunk=64,
    )
    r = Engine(model, config).runner
    program, x = r._warmup_call(Shape("step", r.step_slots(64), 64, r.widths()[0]))
    text = program.lower(r.states, r.pools, x).compile().as_text()
    # The 2-D dots: the projections over the step's tokens (and the head at each sequence's
    # last token, 4 rows).
    found = re.findall(r"= f32\[(\d+),\d+\]\{1,0\} dot\(", text)
    rows[pcp] = set(map(int, found)) - {4}
  assert rows == {1: {64}, 2: {32}}


def pool_arrays(engine):
  return jax.tree.leaves(engine.pools[0])


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_pool_lies_per_shard(kind):
  """Per device: the pool's bytes are a shard's (kv heads split over tensor, pages over data;
  an MLA latent pool whole per tensor device), and the shards add up to the arrays."""
  model = model_of(kind)
  dp, tp = 2, 4
  engine = Engine(
    model, dataclasses.replace(CONFIG, data_parallel_size=dp, tensor_parallel_size=tp)
  )
  cfg = engine.model_config
  for a in pool_arrays(engine):
    by_device = {}
    for shard in a.addressable_shards:
      by_device[shard.device] = by_device.get(shard.device, 0) + shard.data.nbytes
    assert len(by_device) == dp * tp
    copies = 1 if cfg.mla is None else tp  # the latent is replicated over the tensor axis
    assert sum(by_device.values()) == copies * a.nbytes
    assert set(by_device.values()) == {a.nbytes * copies // (dp * tp)}
  L, Z, P = cfg.n_layers, CONFIG.block_size, CONFIG.n_blocks
  if cfg.mla is None:
    assert cfg.n_kv_heads == tp  # 2 kv heads repeated to 4: one per tensor device
    per_block = 2 * L * Z * 1 * cfg.head_dim * 4  # k and v, one kv head per device, f32
  else:
    per_block = L * Z * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4
  assert engine.runner.block_bytes() == per_block
  assert engine.runner.pool_bytes == P * per_block


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_decode_step_gathers_no_pool(kind):
  """The compiled tensor-parallel step (ragged, a decode token) all-reduces activations and
  never all-gathers a pool (or any array of a pool shard's size)."""
  model = model_of(kind)
  tp = 4
  config = dataclasses.replace(CONFIG, n_blocks=128, tensor_parallel_size=tp)
  engine = Engine(model, config)
  runner = engine.runner
  engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
  engine.step()  # the prompt: now the request decodes
  rows = [engine.scheduler.row(engine.running[0], 1)]
  x, _ = runner.step_record(rows)
  hlo = (
    runner.programs.forward_sample.lower(runner.states, runner.pools, runner.on_devices(x))
    .compile()
    .as_text()
  )
  assert "all-reduce" in hlo
  shard = min(a.addressable_shards[0].data.size for a in pool_arrays(engine))
  gathers = [line for line in hlo.splitlines() if re.search(r" all-gather(-start)?\(", line)]
  for line in gathers:  # the result shapes, before the op's name
    for dims in re.findall(r"\w+\[([\d,]*)\]", line.split(" all-gather")[0]):
      assert np.prod([int(d) for d in dims.split(",") if d] or [1]) < shard, line


@pytest.fixture(scope="module")
def draft_pair():
  target = model_of("gqa")
  draft_cfg = ModelConfig(**{**SHAPE, "d_model": 16, "n_layers": 1, "ffn_dim": 32}, n_kv_heads=1)
  return target, build(draft_cfg, rngs=nnx.Rngs(7))


SPEC = dataclasses.replace(
  CONFIG, n_blocks=48, num_speculative_tokens=3, max_num_batched_tokens=64, prefill_chunk=32
)


@pytest.mark.slow
def test_draft_model_speculation_under_tensor_4(draft_pair):
  target, draft = draft_pair
  want, _ = serve(target, SPEC, draft=draft)
  got, engine = serve(target, dataclasses.replace(SPEC, tensor_parallel_size=4), draft=draft)
  assert got == want and engine.n_spec_rounds > 0 and engine.n_accepted > 0
  # The draft shards as the target does: its one kv head repeated to four.
  assert engine.runner.d_layout == engine.runner.layout
  assert all(a.shape[3] == 4 for a in jax.tree.leaves(engine.pools[1]))


@pytest.mark.slow
def test_mtp_speculation_under_tensor_4():
  model = model_of("mla_qlora", mtp=MTPConfig("sequential", 1))
  config = dataclasses.replace(SPEC, num_speculative_tokens=1)
  want, _ = serve(model, config, draft="mtp")
  got, engine = serve(model, dataclasses.replace(config, tensor_parallel_size=4), draft="mtp")
  assert got == want and engine.n_spec_rounds > 0 and engine.n_accepted > 0


@pytest.mark.slow  # speculation under tensor 4 runs in the default suite
def test_guided_requests_under_tensor_4(draft_pair):
  """Greedy and sampled guided requests, plain and speculating, as on one device."""
  tok = ByteTokenizer()
  cfg = ModelConfig(**{**SHAPE, "vocab_size": tok.vocab_size}, n_kv_heads=2, init_std=0.3)
  model = build(cfg, rngs=nnx.Rngs(2))
  compiler = GrammarCompiler(tok, vocab_size=cfg.vocab_size)
  grammars = [
    compiler.compile(spec_from_request(guided_regex=r"[a-c]{1,3}-[0-9]{1,3}")),
    compiler.compile(spec_from_request(guided_choice=["yes", "no", "maybe"])),
  ]
  requests = [
    (tok.encode(f"q{i}: "), SamplingParams(max_new_tokens=12, temperature=t, seed=i, guided=g))
    for i, (g, t) in enumerate([(grammars[0], 0.0), (grammars[1], 1.0), (grammars[0], 1.0)])
  ]
  config = dataclasses.replace(SPEC, num_speculative_tokens=2)
  draft = build(dataclasses.replace(cfg, d_model=16, n_layers=1), rngs=nnx.Rngs(3))
  for d in (None, draft):
    got = []
    for tp in (1, 4):
      engine = Engine(
        model,
        dataclasses.replace(config, tensor_parallel_size=tp),
        draft=d,
        eos_id=tok.eos_id,
        detokenize=tok.decode,
      )
      got.append(engine.generate([p for p, _ in requests], [sp for _, sp in requests]))
    assert got[0] == got[1]
    if d is not None:
      assert engine.n_spec_rounds > 0


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 is not allowed: the model's 8 query"),
    (dict(tensor_parallel_size=4, data_parallel_size=4), "needs 16 devices but 8 are available"),
  ],
)
def test_bad_meshes_are_named(kw, match):
  with pytest.raises(ConfigError, match=match):
    Engine(model_of("gqa"), dataclasses.replace(CONFIG, **kw))


@pytest.mark.parametrize("kind", ["gqa", pytest.param("mla_qlora", marks=pytest.mark.slow)])
def test_an_8bit_pool_on_a_mesh_serves_the_single_device_tokens(kind):
  """int8 codes and their scales split as the float pool is (scales by kv head on the tensor
  axis, pages by replica): data 2 x tensor 4 gives one device's tokens on the same 8-bit pool."""
  model = model_of(kind)
  config = dataclasses.replace(CONFIG, kv_cache_dtype="int8")
  want, _ = serve(model, config)
  got, engine = serve(
    model, dataclasses.replace(config, data_parallel_size=2, tensor_parallel_size=4)
  )
  assert got == want
  arrays = pool_arrays(engine)
  assert any(a.dtype == jnp.int8 for a in arrays) and any(a.dtype == jnp.float32 for a in arrays)
