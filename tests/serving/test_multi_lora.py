"""Many LoRA adapters served at once over one base (`atlas_jax.serving.lora`): a batch mixing
adapters and the base gives each row the greedy tokens of its adapter merged into the base
(transformers + peft's `merge_and_unload`), and adapters load and unload at run time without a
new compiled program."""

import dataclasses
import json

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from atlas_jax import hf  # noqa: E402
from atlas_jax.config import CPUConfig, EngineConfig  # noqa: E402
from atlas_jax.data.tokenizer import ByteTokenizer  # noqa: E402
from atlas_jax.decoding.sampling import SamplingParams  # noqa: E402
from atlas_jax.serving.engine import Engine  # noqa: E402
from atlas_jax.serving.http.engine_thread import EngineRunner  # noqa: E402
from atlas_jax.serving.lora import AdapterError, ServedAdapters  # noqa: E402
from atlas_jax.serving.server import build_app  # noqa: E402

from .conftest import serving_app  # noqa: E402

V = 259  # the byte tokenizer's
N_NEW = 6
CONFIG = EngineConfig(
  runner="ragged",
  n_blocks=64,
  block_size=4,
  max_num_seqs=4,
  max_num_batched_tokens=64,
  prefill_chunk=32,
  max_model_len=64,
  decode_burst=4,
)
PROMPTS = [[3, 17, 99, 5, 250, 42, 7], [11, 12, 13, 14], [200, 3, 9, 9, 30]]
# (name, targets, r, alpha, rsLoRA): MLP and attention targets, a rank below the served one
ADAPTERS = [
  ("sql", ["q_proj", "v_proj", "o_proj"], 4, 8, False),
  ("poet", ["k_proj", "gate_proj", "up_proj", "down_proj"], 2, 4, True),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """The base folder, each adapter's PEFT folder (peft's `save_pretrained`), and per adapter and
  prompt the greedy tokens of transformers' model with that adapter merged by peft."""
  root = tmp_path_factory.mktemp("lora")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
  )
  base = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in base.named_parameters():
      p.copy_(
        1.0 + 0.1 * torch.randn_like(p)
        if name.endswith("norm.weight")
        else 0.3 * torch.randn_like(p)
      )
  base.save_pretrained(root / "base")
  refs = {None: greedy(base)}
  for i, (name, targets, r, alpha, rs) in enumerate(ADAPTERS):
    model = transformers.LlamaForCausalLM.from_pretrained(root / "base").eval()
    lcfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs)
    pm = peft.get_peft_model(model, lcfg)
    torch.manual_seed(1 + i)
    with torch.no_grad():
      for pname, p in pm.named_parameters():
        if "lora_" in pname:
          p.copy_(0.4 * torch.randn_like(p))  # lora_B starts at zero: draw both
    pm.save_pretrained(root / name)
    refs[name] = greedy(pm.merge_and_unload().eval())
  return root, refs


def greedy(model) -> list[list[int]]:
  out = []
  with torch.no_grad():
    for p in PROMPTS:
      ids = model.generate(
        torch.tensor([p]),
        max_new_tokens=N_NEW,
        min_new_tokens=N_NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
      )
      out.append(ids[0, len(p) :].tolist())
  return out


def engine_of(root, *, max_loras=2, rank=4):
  model = hf.load(root / "base")
  adapters = ServedAdapters(model, max_loras=max_loras, max_lora_rank=rank)
  return Engine(model, CONFIG, adapters=adapters, detokenize=ByteTokenizer().decode)


@pytest.fixture(scope="module")
def engine(folders):
  root, _ = folders
  engine = engine_of(root)
  for name, *_ in ADAPTERS:
    engine.load_adapter(name, root / name)
  return engine


PARAMS = SamplingParams(max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True)


def run(engine, jobs) -> dict:
  """{request id: tokens} of (id, prompt, adapter) jobs, all added before the first step."""
  for rid, prompt, adapter in jobs:
    engine.add_request(rid, prompt, PARAMS, adapter=adapter)
  out = {rid: [] for rid, *_ in jobs}
  while engine.has_unfinished():
    for o in engine.step():
      out[o.request_id] += o.new_token_ids
  return out


def test_a_batch_mixing_adapters_and_the_base_matches_peft_merged(folders, engine):
  _, refs = folders
  jobs = [(f"{name}-{i}", p, name) for name in (None, "sql", "poet") for i, p in enumerate(PROMPTS)]
  steps = engine.n_steps
  got = run(engine, jobs)
  for name in (None, "sql", "poet"):
    assert [got[f"{name}-{i}"] for i in range(len(PROMPTS))] == refs[name], name
  # Nine requests in four seats: every step mixes rows of several adapters.
  assert engine.n_steps - steps < 3 * N_NEW
  assert refs["sql"] != refs[None] and refs["poet"] != refs[None]  # the adapters matter


def test_unknown_adapter_is_refused_by_name_and_one_in_use_stays(engine):
  with pytest.raises(AdapterError, match="'nope'"):
    engine.add_request("x", [1, 2, 3], PARAMS, adapter="nope")
  engine.enqueue([(["busy"], PROMPTS[0], [PARAMS])], adapter="sql")
  with pytest.raises(AdapterError, match="'sql': requests using it are still running"):
    engine.unload_adapter("sql")
  while engine.has_unfinished():
    engine.step()
  assert "sql" in engine.adapters.by_name


def test_prefix_blocks_are_shared_within_an_adapter_only(folders, engine):
  """The prefix cache keys each request's blocks by its adapter's identity (name and load): the
  same prompt under the same adapter hits its 3 full blocks; under another adapter, the base, or
  a new load of the same name, none; and hits give the tokens the uncached run gave."""
  root, _ = folders
  prompt = [5, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]  # 13 tokens: 3 blocks of 4 cached
  outs, hits = [], []
  jobs = ["sql", "sql", "poet", None, None, "poet", "reload sql", "sql"]
  for i, name in enumerate(jobs):
    if name == "reload sql":
      engine.unload_adapter("sql")
      engine.load_adapter("sql", root / "sql")
      continue
    before = engine.scheduler.stats().prefix_hit_tokens
    outs.append((name, run(engine, [(f"prefix-{i}", prompt, name)])[f"prefix-{i}"]))
    hits.append(engine.scheduler.stats().prefix_hit_tokens - before)
  assert hits == [0, 12, 0, 0, 12, 12, 0], hits
  for name in ("sql", "poet", None):
    got = [tokens for n, tokens in outs if n == name]
    assert len(got) >= 2 and all(t == got[0] for t in got), name
  assert outs[0][1] != outs[2][1] != outs[3][1]


def test_the_cpu_runner_serves_a_mixed_batch(folders):
  """The CPU runner (segmented prefills, its own weight layout) over the same adapters: each row
  the tokens of its adapter merged by peft."""
  root, refs = folders
  model = hf.load(root / "base")
  adapters = ServedAdapters(model, max_loras=2, max_lora_rank=4)
  # A layout that would hold each layer's projections transposed: adapters keep them stacked.
  cpu = CPUConfig(weight_layout="out_major", matmul="ynnpack", reductions="xla")
  config = dataclasses.replace(CONFIG, runner="cpu", cpu=cpu)
  engine = Engine(model, config, adapters=adapters, detokenize=ByteTokenizer().decode)
  runner = engine.runner
  assert type(runner).__name__ == "CPUModelRunner" and runner.stacked and not runner.out_major
  for name, *_ in ADAPTERS:
    engine.load_adapter(name, root / name)
  jobs = [(f"{name}-{i}", p, name) for name in (None, "sql", "poet") for i, p in enumerate(PROMPTS)]
  got = run(engine, jobs)
  for name in (None, "sql", "poet"):
    assert [got[f"{name}-{i}"] for i in range(len(PROMPTS))] == refs[name], name


def test_lora_refuses_large_ranks(folders, tmp_path):
  root, _ = folders
  model = hf.load(root / "base")
  adapters = ServedAdapters(model, max_loras=1, max_lora_rank=1)
  engine = Engine(model, CONFIG, adapters=adapters)
  with pytest.raises(AdapterError, match="--max-lora-rank is 1"):
    engine.load_adapter("sql", root / "sql")


def post(url, path, body):
  return httpx.post(url + path, json=body, timeout=60)


def test_http_lists_routes_loads_and_unloads_without_recompiling(folders):
  root, refs = folders
  engine = engine_of(root, max_loras=1)
  runner = EngineRunner(engine)
  app = build_app(runner, tokenizer=ByteTokenizer(), model_name="base")
  with serving_app(app, runner) as url:

    def models():
      return {m["id"]: m.get("parent") for m in httpx.get(url + "/v1/models").json()["data"]}

    def complete(model):
      body = dict(model=model, prompt=PROMPTS[0], max_tokens=N_NEW, temperature=0, ignore_eos=True)
      return post(url, "/v1/completions", body)

    def text(name):  # what the reference's tokens read as
      return ByteTokenizer().decode(refs[name][0])

    assert models() == {"base": None}
    r = complete("sql")
    assert r.status_code == 400 and "'sql'" in r.json()["error"]["message"]
    assert complete("base").json()["choices"][0]["text"] == text(None)
    step = engine.programs.forward_sample
    compiled = step._cache_size()
    r = post(url, "/v1/load_lora_adapter", dict(lora_name="sql", lora_path=str(root / "sql")))
    assert r.status_code == 200, r.text
    assert models() == {"base": None, "sql": "base"}
    r = post(url, "/v1/load_lora_adapter", dict(lora_name="poet", lora_path=str(root / "poet")))
    assert r.status_code == 400 and "--max-loras" in r.json()["error"]["message"]
    r = complete("sql")
    assert r.json()["choices"][0]["text"] == text("sql") != text(None)
    assert r.json()["model"] == "sql"
    # Loading rewrote slot arrays of the same shapes: the same compiled step served it.
    assert step._cache_size() == compiled
    r = post(url, "/v1/unload_lora_adapter", dict(lora_name="sql"))
    assert r.status_code == 200, r.text
    assert models() == {"base": None}
    r = complete("sql")
    assert r.status_code == 400 and "'sql'" in r.json()["error"]["message"]
    # The freed slot takes another adapter, which the next request runs under.
    r = post(url, "/v1/load_lora_adapter", dict(lora_name="poet", lora_path=str(root / "poet")))
    assert r.status_code == 200, r.text
    assert complete("poet").json()["choices"][0]["text"] == text("poet")
    assert complete("base").json()["choices"][0]["text"] == text(None)
    assert step._cache_size() == compiled


def test_serve_flags_load_adapters_at_start(folders):
  import sys
  import types
  from pathlib import Path

  sys.path.insert(0, str(Path(__file__).parent.parent.parent))
  import serve

  root, _ = folders
  sets = ("n_blocks=32", "block_size=4", "max_num_seqs=4", "runner=ragged")
  argv = ["--checkpoint", str(root / "base"), "--enable-lora", "--max-loras", "2"]
  argv += ["--max-lora-rank", "4", "--lora-modules", f"sql={root / 'sql'}", f"poet={root / 'poet'}"]
  args = serve.parse_args([*argv, *(a for s in sets for a in ("--set", f"serve.engine.{s}"))])
  serve.fill_defaults(args)
  tok = types.SimpleNamespace(eos_ids=[258], decode=lambda ids, **kw: "")
  engine = serve.make_engine(args, hf.load(root / "base"), tok)
  assert {n: a.slot for n, a in engine.adapters.by_name.items()} == {"sql": 1, "poet": 2}
  assert engine.adapters.by_name["poet"].rank == 2
  with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
    bad = serve.parse_args(["--checkpoint", "x", "--lora-modules", "a=b"])
    serve.served_adapters(bad, None)
  bad = serve.parse_args(["--checkpoint", "x", "--enable-lora", "--lora-modules", "a"])
  with pytest.raises(ValueError, match="'a' is not allowed: NAME=PATH"):
    serve.served_adapters(bad, None)


def test_our_exported_adapters_serve_as_our_merged_model(tmp_path):
  """`hf export --adapters separate`'s PEFT layout (`_peft_adapter`) of a LoRA model, served
  beside the base, gives the tokens of the same model with its adapters merged."""
  import jax
  from flax import nnx
  from safetensors.numpy import save_file

  from atlas_jax.config import Config, LoRAConfig, ModelConfig, TrainConfig
  from atlas_jax.hf import export
  from atlas_jax.hf.weights import build_model
  from atlas_jax.model import build
  from atlas_jax.model.lora import LoRAParam, merged_params

  from .conftest import TINY

  cfg = ModelConfig(**TINY, n_kv_heads=2, init_std=0.3)
  lora = LoRAConfig(rank=3, alpha=5.0, targets=("attn", "mlp"))
  trained = build(cfg, rngs=nnx.Rngs(3), lora=lora)
  adapters = nnx.state(trained, LoRAParam)
  keys = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(adapters))))
  draw = lambda a: 0.3 * jax.random.normal(next(keys), a.shape)  # b starts at zero: draw both
  nnx.update(trained, jax.tree.map(draw, adapters))
  run_cfg = Config(model=cfg, train=TrainConfig(lora=lora))
  tensors, conf = export._peft_adapter(trained, run_cfg, tmp_path)
  save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
  (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
  base_params = export._drop_adapters(nnx.to_pure_dict(nnx.state(trained)))
  merged = nnx.jit(lambda m, t: m(t))
  base = build_model(cfg, base_params)
  engine = Engine(base, CONFIG, adapters=ServedAdapters(base, max_loras=1, max_lora_rank=4))
  engine.load_adapter("ours", tmp_path)
  prompts = [[1, 5, 9, 2], [30, 31, 3], [7] * 6]
  # Greedy decoding with the merged model itself: whole causal passes over right-padded rows.
  merged_model, T = build_model(cfg, merged_params(trained)), 16
  tokens = np.zeros((len(prompts), T), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  for n in range(N_NEW):
    logits = np.asarray(merged(merged_model, tokens))
    for i, p in enumerate(prompts):
      tokens[i, len(p) + n] = logits[i, len(p) + n - 1].argmax()
  want = {i: tokens[i, len(p) : len(p) + N_NEW].tolist() for i, p in enumerate(prompts)}
  got = run(engine, [(i, p, "ours") for i, p in enumerate(prompts)] + [("base", prompts[0], None)])
  assert [got[i] for i in range(len(prompts))] == [want[i] for i in range(len(prompts))]
  assert got["base"] != want[0]  # the base row in the same batch stays the base's


@pytest.mark.slow  # its own compiles over a 2 x 2 mesh
def test_adapters_split_over_the_tensor_axis_as_their_projections(folders):
  import dataclasses

  root, refs = folders
  model = hf.load(root / "base")
  adapters = ServedAdapters(model, max_loras=2, max_lora_rank=4)
  config = dataclasses.replace(CONFIG, tensor_parallel_size=2, data_parallel_size=2)
  engine = Engine(model, config, adapters=adapters)
  for name, *_ in ADAPTERS:
    engine.load_adapter(name, root / name)
  state = engine.runner.states[0]
  # q_proj's b [L, S, A, N, H] splits its heads, o_proj's a [L, S, N, H, D] its input heads.
  assert tuple(state["blocks"]["attn"]["wq_lora"]["b"][...].sharding.spec)[3] == "tensor"
  assert tuple(state["blocks"]["attn"]["wo_lora"]["a"][...].sharding.spec)[2] == "tensor"
  jobs = [(f"{n}-{i}", p, n) for n in ("poet", None, "sql") for i, p in enumerate(PROMPTS)]
  got = run(engine, jobs)
  for name in (None, "sql", "poet"):
    assert [got[f"{name}-{i}"] for i in range(len(PROMPTS))] == refs[name], name
  # Freed and loaded again, in place on the mesh: the same programs serve it.
  compiled = engine.programs.forward_sample._cache_size()
  engine.unload_adapter("sql")
  engine.load_adapter("sql", root / "sql")
  got = run(engine, [(f"again-{i}", p, "sql") for i, p in enumerate(PROMPTS)])
  assert [got[f"again-{i}"] for i in range(len(PROMPTS))] == refs["sql"]
  assert engine.programs.forward_sample._cache_size() == compiled
