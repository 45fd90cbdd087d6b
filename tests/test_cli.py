"""train.py and serve.py end to end on a tiny run, and their errors on bad input."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

import serve  # noqa: E402
import train  # noqa: E402


def small_run(data, out, *, steps: int) -> list[str]:
  """train.py's arguments for a small byte-level run of tiny.yaml's kind on `data`."""
  sets = [
    f"data.source={data}",
    "data.eval_fraction=0.1",
    "data.tokenizer=byte",
    "model.vocab_size=259",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    f"train.steps={steps}",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.log_every=20",
    "train.eval_every=40",
    "train.checkpoint_every=20",
    f"train.checkpoint_dir={out}",
  ]
  return ["--config", str(ROOT / "configs" / "tiny.yaml")] + [x for s in sets for x in ("--set", s)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("run")
  data = tmp / "data.jsonl"
  data.write_text(
    "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200))
  )
  out = tmp / "ckpt"
  rc = train.main(small_run(data, out, steps=40) + ["--sample-tokens", "8"])
  assert rc == 0
  return out


def test_train_learns_and_checkpoints(run_dir):
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [20, 40]
  # A CPU's peak is not in the device table and train.peak_tflops is not given: no MFU.
  assert not any("mfu" in r for r in records)
  # A CPU reports no device memory: the peak is the process's resident set, at most what this
  # (same) process has peaked at by now, and more than the run's train state.
  from atlas_jax.training.metrics import peak_memory

  peak, what = peak_memory()
  assert what == "process peak RSS"
  assert 2**20 < records[-1]["peak_memory_gb"] * 2**30 <= peak
  assert records[-1]["loss"] < 3.0  # well below ln(259) = 5.56: it learned the byte statistics
  assert records[-1]["eval_loss"] < 3.0
  assert (run_dir / "config.yaml").is_file()
  assert sorted(p.name for p in run_dir.iterdir() if p.name.isdigit()) == ["20", "40"]


def test_serve_batch_mode(run_dir, tmp_path, capsys):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "def f1"}\n{"prompt": "return"}\n')
  out = tmp_path / "out.jsonl"
  rc = serve.main(
    [
      "--checkpoint",
      str(run_dir),
      "--prompts",
      str(prompts),
      "--prompt",
      "x",
      "--max-new-tokens",
      "6",
      "--output",
      str(out),
    ]
  )
  assert rc == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["prompt"] for r in rows] == ["x", "def f1", "return"]
  assert all(1 <= r["completion_tokens"] <= 6 for r in rows)
  # Greedy is deterministic: the same request gives the same completion.
  serve.main(["--checkpoint", str(run_dir), "--prompt", "def f1", "--max-new-tokens", "6"])
  assert json.loads(capsys.readouterr().out)["completion"] == rows[1]["completion"]


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--set", "model.n_heads=5"], "model.n_heads=5"),
    (["--set", "train.stepz=3"], "train.stepz is not a known field"),
    (["--config", "nope.yaml"], "does not exist"),
  ],
)
def test_train_rejects_bad_config(argv, match, capsys):
  assert train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), *argv]) == 2
  assert match in capsys.readouterr().err


def test_serve_rejects_bad_input(run_dir, tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "ok"}\n{"text": 3}\n')
  assert serve.main(["--checkpoint", str(run_dir), "--prompts", str(bad)]) == 2
  assert "bad.jsonl:2" in capsys.readouterr().err
  assert serve.main(["--checkpoint", str(run_dir), "--prompt", "x", "--top-p", "2"]) == 2
  assert "--top-p=2.0: invalid value for 'top_p'" in capsys.readouterr().err
  assert serve.main(["--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
  assert "no config.json" in capsys.readouterr().err


def copy_run(run_dir, out):
  shutil.copytree(run_dir, out)
  return out


def resume(run_dir, out, *extra):
  """Reruns the fixture's command, to train.steps=44, in `out` (a damaged copy of `run_dir`)."""
  data = run_dir.parent / "data.jsonl"
  return train.main(small_run(data, out, steps=44) + ["--sample-prompt", "", *extra])


def test_a_damaged_latest_checkpoint_resumes_from_the_newest_intact(run_dir, tmp_path, capsys):
  out = copy_run(run_dir, tmp_path / "run")
  (out / "40" / "meta" / "metadata").write_text('{"step": 4')  # truncated mid-write
  assert resume(run_dir, out) == 0
  captured = capsys.readouterr()
  assert f"{out}/40/meta/metadata is not valid JSON" in captured.err
  assert "trying step 20" in captured.err
  assert "resumed from" in captured.out and "at step 20" in captured.out
  assert (out / "40.corrupt").is_dir()
  assert sorted(p.name for p in out.iterdir() if p.name.isdigit()) == ["20", "40", "44"]
  steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps[-2:] == [40, 44]


def test_a_damaged_checkpoint_can_stop_the_run(run_dir, tmp_path, capsys):
  out = copy_run(run_dir, tmp_path / "run")
  (out / "40" / "state" / "_METADATA").write_text('{"tree_metadata": {')
  assert resume(run_dir, out, "--set", "train.on_corrupt_checkpoint=stop") == 2
  err = capsys.readouterr().err
  assert f"error: checkpoint step 40 in {out} cannot be restored: " in err
  assert f"{out}/40/state/_METADATA is not valid JSON" in err
  assert "train.on_corrupt_checkpoint=stop" in err
  assert (out / "40").is_dir() and not (out / "40.corrupt").exists()


def test_a_damaged_run_config_is_named(run_dir, tmp_path, capsys):
  out = copy_run(run_dir, tmp_path / "run")
  (out / "config.yaml").write_text("model: {vocab_size: 259\n  d_model")
  assert serve.main(["--checkpoint", str(out), "--prompt", "x"]) == 2
  err = capsys.readouterr().err
  assert f"config file '{out}/config.yaml' is not valid YAML" in err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_train_names_a_bad_jsonl_line(tmp_path, capsys):
  data = tmp_path / "data.jsonl"
  data.write_text('{"text": "def f(): pass"}\n{"text": ["not", "a", "string"]}\n')
  rc = train.main(
    [
      "--config",
      str(ROOT / "configs" / "tiny.yaml"),
      "--set",
      f"data.source={data}",
      "--set",
      "train.steps=1",
      "--set",
      f"train.checkpoint_dir={tmp_path / 'run'}",
      "--sample-prompt",
      "",
    ]
  )
  assert rc == 2
  err = capsys.readouterr().err
  assert f"{data}:2: field 'text' must be a string, got list" in err


@pytest.mark.parametrize(
  "argv, message",
  [
    # The sampling flags follow the HTTP API's rules, with its messages.
    (
      ["--temperature", "nan"],
      "--temperature=nan: invalid value for 'temperature': Input should be a finite number",
    ),
    (
      ["--temperature", "3"],
      "--temperature=3.0: invalid value for 'temperature': Input should be less than or equal to 2",
    ),
    (
      ["--top-k", str(2**31)],
      "--top-k=2147483648: invalid value for 'top_k': Input should be "
      "less than or equal to 2147483647",
    ),
    (
      ["--max-new-tokens", "0"],
      "--max-new-tokens=0: invalid value for 'max_tokens': Input "
      "should be greater than or equal to 1",
    ),
    (["--seed", "-1"], "--seed=-1: invalid value for 'seed'"),
    (["--block-size", "0"], "--block-size=0 is not allowed: must be a positive integer"),
    (["--max-batch", "-2"], "--max-batch=-2 is not allowed: must be a positive integer"),
    (["--prefill-chunk", "48"], "--prefill-chunk=48 is not allowed: must be a power of two"),
    (["--port", "70000"], "--port=70000 is not allowed: must be in [1, 65535]"),
    # The engine's flags are aliases of serve.engine's fields: one set of checks, named as given.
    (
      ["--tensor-parallel-size", "4", "-dp", "4"],
      "--tensor-parallel-size=4 x -dp=4 needs 16 devices",
    ),
    (["--max-num-seqs", "0"], "--max-num-seqs=0 is not allowed: must be a positive integer"),
    (["--offline-burst", "0"], "--offline-burst=0 is not allowed: must be a positive integer"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5 is not allowed"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory=0.0 is not allowed: must be bytes per device"),
    (
      ["--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
      "--max-num-batched-tokens=4 is not allowed: must be >= --max-num-seqs=8",
    ),
    (["--output", "{tmp}/missing/out.jsonl"], "the folder {tmp}/missing does not exist"),
    (["--output", "{tmp}"], "is a folder; give a file path"),
    (["--prompt", "ok \udcff"], "--prompt 2: the text cannot be encoded as UTF-8 (character 3"),
  ],
)
def test_serve_flags_are_checked_like_the_api(tmp_path, capsys, argv, message):
  argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
  # Checked before the checkpoint is read: the folder need not exist.
  assert serve.main(["--checkpoint", str(tmp_path / "none"), "--prompt", "x", *argv]) == 2
  err = capsys.readouterr().err
  want = message.replace("{tmp}", str(tmp_path))
  assert want in err and err.startswith("error: --") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--set", "serve.engine.prefill_chunk=48"], "serve.engine.prefill_chunk=48 is not allowed"),
    (["--set", "serve.engine.colour=red"], "serve.engine.colour is not a known field; allowed:"),
    (
      ["--set", "serve.engine.stream_bursts=2"],
      "serve.engine.stream_bursts=2 is not allowed: expected true or false",
    ),
    (
      ["--weight-layout", "sideways"],
      "--weight-layout='sideways' is not allowed: must be one of auto, stacked, in_major, "
      "out_major",
    ),
    (
      ["--cpu-matmul", "mkl"],
      "--cpu-matmul='mkl' is not allowed: must be one of auto, xla, ynnpack",
    ),
    (
      ["--kv-cache-dtype", "fp16"],
      "--kv-cache-dtype='fp16' is not allowed: must be one of auto, int8, fp8",
    ),
    (
      ["--cpu-reductions", "mkl"],
      "--cpu-reductions='mkl' is not allowed: must be one of auto, xla, ynnpack",
    ),
    (["--set", "model.n_layers=2"], "--set model.n_layers=2 is not allowed: serve.py takes"),
    (
      ["--set", "serve.sampling.top_p=2"],
      "--set serve.sampling.top_p=2: invalid value for 'top_p'",
    ),
  ],
)
def test_serve_set_fields_are_checked_by_name(tmp_path, capsys, argv, message):
  assert serve.main(["--checkpoint", str(tmp_path / "none"), "--prompt", "x", *argv]) == 2
  err = capsys.readouterr().err
  assert message in err and len(err.strip().splitlines()) == 1


def test_serve_set_and_flags_make_one_config():
  args = serve.parse_args(
    ["--checkpoint", "none", "--prompt", "x", "--set", "serve.engine.block_size=8", "-tp", "2"]
    + ["--decode-burst", "4", "--stream-bursts", "on"]
  )
  args.set += ["serve.limits.max_n=3", "serve.engine.max_num_seqs=5", "serve.sampling.top_k=7"]
  args.max_num_seqs = 6  # the flag wins over --set
  serve.fill_defaults(args)
  config = serve.check_args(args)
  assert (config.engine.block_size, config.engine.tensor_parallel_size) == (8, 2)
  assert (config.engine.max_num_seqs, config.limits.max_n, config.sampling.top_k) == (6, 3, 7)
  assert (config.engine.decode_burst, config.engine.stream_bursts) == (4, True)
  with pytest.raises(SystemExit):
    serve.parse_args(["--checkpoint", "none", "--stream-bursts", "maybe"])
  assert args.sources["top_k"] == "--set serve.sampling.top_k"


def test_serve_rejects_a_context_past_the_model(run_dir, capsys):
  argv = ["--checkpoint", str(run_dir), "--prompt", "x", "--max-model-len", "4096"]
  assert serve.main(argv) == 2
  assert "--max-model-len=4096 is not allowed: the model's context is 512 tokens" in (
    capsys.readouterr().err
  )


@pytest.mark.parametrize("damage", ["truncated", "config"])
def test_serve_prints_hf_load_errors_as_one_line(tmp_path, capsys, damage):
  from flax import nnx

  from atlas_jax import hf
  from atlas_jax.config import ModelConfig
  from atlas_jax.model.transformer import Transformer

  cfg = ModelConfig(vocab_size=259, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)
  hf.save(Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path)
  if damage == "truncated":
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    want = f"{weights}: not a readable safetensors file"
  else:
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": "64"}))
    want = "config.json field 'intermediate_size'='64' is not allowed: must be an integer"
  assert serve.main(["--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
  err = capsys.readouterr().err
  assert want in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_serve_samples_as_the_run_says_unless_told(run_dir):
  from atlas_jax.config import ServeConfig, load_config

  run = load_config(run_dir / "config.yaml").serve.sampling
  assert run.temperature != ServeConfig().sampling.temperature  # tiny.yaml samples; greedy default
  args = serve.parse_args(["--checkpoint", str(run_dir), "--prompt", "x"])
  serve.fill_defaults(args)
  assert (args.temperature, args.top_k, args.max_new_tokens) == (
    run.temperature,
    run.top_k,
    run.max_new_tokens,
  )
  args = serve.parse_args(["--checkpoint", str(run_dir), "--prompt", "x", "--temperature", "0"])
  serve.fill_defaults(args)
  assert (args.temperature, args.top_k) == (0.0, run.top_k)


def test_serve_with_a_draft_model(run_dir, tmp_path, capsys):
  """--draft: greedy completions are the plain ones (the run drafting for itself accepts all);
  a draft with another tokenizer is refused by name."""
  from flax import nnx

  from atlas_jax import hf
  from atlas_jax.config import ModelConfig
  from atlas_jax.model.transformer import Transformer

  argv = ["--checkpoint", str(run_dir), "--prompt", "def f1", "--max-new-tokens", "9"]
  argv += ["--temperature", "0"]  # greedy (the run samples by default)
  assert serve.main(argv) == 0
  plain = json.loads(capsys.readouterr().out)["completion"]
  assert serve.main([*argv, "--draft", str(run_dir), "--num-speculative-tokens", "3"]) == 0
  assert json.loads(capsys.readouterr().out)["completion"] == plain
  from atlas_jax.data.tokenizer import train_bpe

  cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)
  hf.save(Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path)
  train_bpe(["def f(x):\n    return x\n"] * 20, vocab_size=300).save(tmp_path / "tokenizer.json")
  assert serve.main([*argv, "--draft", str(tmp_path)]) == 2  # another tokenizer
  assert "its tokenizer differs from the model's" in capsys.readouterr().err
  assert serve.main([*argv, "--draft", str(run_dir), "--num-speculative-tokens", "0"]) == 2
  assert "--num-speculative-tokens=0 is not allowed" in capsys.readouterr().err


def test_serve_batch_lines_carry_their_own_fields(run_dir, tmp_path, capsys):
  """A --prompts line's max_tokens, temperature, seed and stop are its own."""

  def batch(*lines):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert serve.main(["--checkpoint", str(run_dir), "--prompts", str(prompts)]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

  greedy = {"prompt": "def f1", "max_tokens": 12, "temperature": 0}
  sampled = {"prompt": "def f1", "max_tokens": 12, "temperature": 1.0, "seed": 7}
  rows = batch(greedy, {**greedy, "max_tokens": 3}, sampled, sampled, {**sampled, "seed": 8})
  assert rows[1]["completion_tokens"] == 3 and rows[1]["finish_reason"] == "length"
  assert rows[1]["completion"] == rows[0]["completion"][: len(rows[1]["completion"])]
  assert rows[2] == rows[3] and rows[2]["completion"] != rows[4]["completion"]
  text = rows[0]["completion"]
  stop = next(c for c in text[1:] if not c.isspace())
  (row,) = batch({**greedy, "stop": [stop]})
  assert row["completion"] == text[: text.index(stop)] and row["finish_reason"] == "stop"
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "x"}\n{"prompt": "y", "top_p": 2}\n')
  assert serve.main(["--checkpoint", str(run_dir), "--prompts", str(bad)]) == 2
  assert "bad.jsonl:2: invalid value for 'top_p'" in capsys.readouterr().err


def test_serve_names_the_run_directory_of_a_step_folder(run_dir, capsys):
  assert serve.main(["--checkpoint", str(run_dir / "40"), "--prompt", "x"]) == 2
  err = capsys.readouterr().err
  assert f"is step 40 of the train.py run {run_dir}: pass the run directory {run_dir}" in err


def test_serve_speculates_with_every_mtp_head_by_default():
  from flax import nnx

  from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig
  from atlas_jax.data.tokenizer import ByteTokenizer
  from atlas_jax.model import build

  mla = MLAConfig(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
  cfg = ModelConfig(
    vocab_size=259, d_model=32, n_layers=1, n_heads=2, ffn_dim=64, mla=mla, mtp=MTPConfig()
  )  # deepseek-tiny's MTP: one sequential module
  model = build(cfg, rngs=nnx.Rngs(0))
  args = serve.parse_args(["--checkpoint", "none", "--prompt", "x", "--speculative", "mtp"])
  serve.fill_defaults(args)
  engine = serve.make_engine(args, model, ByteTokenizer())
  assert engine.config.num_speculative_tokens == 1 and engine.draft == "mtp"
  args.num_speculative_tokens = 4  # one module run again on its own drafts, as vLLM does
  assert serve.make_engine(args, model, ByteTokenizer()).config.num_speculative_tokens == 4
