"""`atlas-plan` / `python -m atlas_jax.plan`: presets, Hugging Face folders, JSON, plots, errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_jax import hf
from atlas_jax.plan.cli import main
from atlas_jax.plan.models import REFERENCE_MODELS

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
  rc = main(list(argv))
  out = capsys.readouterr()
  return rc, out.out, out.err


def numbers(tree):
  """Every leaf of a JSON tree that is not a name, flag or note."""
  if isinstance(tree, dict):
    for v in tree.values():
      yield from numbers(v)
  elif isinstance(tree, list):
    for v in tree:
      yield from numbers(v)
  elif not isinstance(tree, str | bool | type(None)):
    yield tree


def test_preset_json_takes_the_presets_training_shape(capsys):
  rc, out, _ = run(capsys, "--config", str(ROOT / "configs/small.yaml"), "--json", "--devices", "4")
  assert rc == 0
  plan = json.loads(out)
  assert plan["inputs"]["seq_len"] == 1024 and plan["inputs"]["batch"] == 32
  assert (plan["inputs"]["precision"], plan["inputs"]["remat"]) == ("bf16", "selective")
  assert plan["inputs"]["strategy"] == "zero1" and plan["training"]["selected"] == "zero1"
  assert plan["params"]["total"] == 75_914_496
  assert all(isinstance(x, int | float) for x in numbers(plan))
  zero1 = next(s for s in plan["training"]["strategies"] if s["strategy"] == "zero1")
  assert zero1["micro_batch"] == 8
  assert zero1["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "stage": 1, "tensor": 1}
  assert plan["pipeline"] is None


def test_set_overrides_a_preset(capsys):
  rc, out, _ = run(
    capsys, "--config", str(ROOT / "configs/tiny.yaml"), "--set", "model.n_layers=2", "--json"
  )
  assert rc == 0 and json.loads(out)["model"]["n_layers"] == 2


def test_hugging_face_folder_needs_only_config_json(tmp_path, capsys):
  cfg = REFERENCE_MODELS["llama-2-70b"].model
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
  for target in (tmp_path, tmp_path / "config.json"):
    rc, out, _ = run(capsys, "--config", str(target), "--precision", "fp16", "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["params"]["total"] == 68_976_648_192
    assert plan["inputs"]["seq_len"] == 4096  # min(4096, max_position_embeddings)
    assert plan["kv_cache"]["bytes_per_sequence"] == 1_342_177_280


def test_module_entry_point_markdown_and_known_model():
  result = subprocess.run(
    [sys.executable, "-m", "atlas_jax.plan", "--config", "deepseek-v3", "--markdown"],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert result.returncode == 0, result.stderr
  assert "| MLA (this model) | 70,272 |" in result.stdout
  assert "mixture-of-experts" in result.stdout  # the dense stand-in is said out loud


def test_plot_writes_pngs(tmp_path, capsys):
  rc, out, err = run(capsys, "--config", "llama-3-8b", "--plot", str(tmp_path / "charts"))
  assert rc == 0 and "Training memory per device" in out
  pngs = sorted((tmp_path / "charts").glob("*.png"))
  assert [p.name for p in pngs] == [
    "activations.png",
    "kv_cache.png",
    "kv_context.png",
    "training_memory.png",
  ]
  assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--config", "no/such.yaml"], "--config='no/such.yaml' is not a YAML preset"),
    (["--config", "llama-9"], "known models: llama-2-7b"),
    (
      ["--config", "llama-2-7b", "--device", "Z80"],
      "--device='Z80' is not a known device; allowed",
    ),
    (["--config", "llama-2-7b", "--microbatches", "4"], "--microbatches=4 needs --pipeline > 1"),
    (
      ["--config", "llama-2-7b", "--pipeline", "4", "--microbatches", "2", "--repeats", "2"],
      "--microbatches=2 must be >= --pipeline=4 with --repeats=2",
    ),
    (["--config", "llama-2-7b", "--pipeline", "3"], "--pipeline=3 must divide --devices=8"),
    (
      [
        "--config",
        "llama-2-7b",
        "--pipeline",
        "8",
        "--devices",
        "64",
        "--repeats",
        "8",
        "--microbatches",
        "8",
      ],
      "--pipeline=8 x --repeats=8 must divide the model's n_layers=32",
    ),
    (["--config", "llama-2-7b", "--tensor", "3"], "--tensor=3 must divide --devices=8"),
    (["--config", "llama-2-7b", "--mfu", "1.5"], "--mfu=1.5 must be in (0, 1]"),
    (["--config", "llama-2-7b", "--remat-every", "3"], "--remat-every=3 must divide"),
    (["--config", "llama-2-7b", "--set", "a.b=1"], "overrides apply to YAML presets only"),
    (["--config", "configs/tiny.yaml", "--set", "train.remat=most"], "train.remat='most'"),
    (["--config", "llama-2-7b", "--memory", "24XB"], "--memory='24XB' is not a size"),
    (["--config", "llama-2-7b", "--memory=0GB"], "--memory='0GB' is not a size"),
  ],
)
def test_bad_input_names_the_flag_and_the_allowed_values(argv, message, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  rc, out, err = run(capsys, *argv)
  assert rc == 2 and out == ""
  assert err.startswith("atlas-plan: error: ")
  assert message in err, err


def test_folder_without_config_json(tmp_path, capsys):
  rc, _, err = run(capsys, "--config", str(tmp_path))
  assert rc == 2 and "has no config.json" in err


def test_mixture_of_experts_folder_plans_its_active_parameters(tmp_path, capsys):
  """A DeepSeek-V3 config.json plans like the known shape: total and active parameters, the
  experts split over --expert."""
  from atlas_jax.plan.params import counts

  hf_config = hf.config_to_hf(REFERENCE_MODELS["deepseek-v3"].model)
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  rc, out, _ = run(capsys, "--config", str(tmp_path), "--devices", "64", "--expert", "8", "--json")
  assert rc == 0
  plan = json.loads(out)
  pc = counts(REFERENCE_MODELS["deepseek-v3"].model)
  # The folder has no MTP weights to count, so the trunk is what is planned.
  assert plan["params"]["inference"] == pc.inference and plan["params"]["active"] == pc.active
  assert plan["training"]["strategies"][0]["mesh"]["expert"] == 8
  rc, out, _ = run(capsys, "--config", str(tmp_path), "--devices", "64", "--expert", "8")
  assert rc == 0 and "active per token" in out and "256 experts (top 8, sigmoid noaux_tc)" in out


def test_bad_choice_is_argparse_error(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--config", "llama-2-7b", "--strategy", "zero4"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--strategy: invalid choice: 'zero4'" in err and "'zero3'" in err


def test_batch_1_reports_serving_and_names_the_training_constraint(capsys):
  """One sequence on 8 devices cannot be split 8 ways for training, but the KV cache and the
  decode ceiling do not depend on that: the plan is made, and the training rows say why they
  have no activations."""
  rc, out, err = run(capsys, "--config", "llama-2-7b", "--batch", "1", "--json")
  assert rc == 0, err
  plan = json.loads(out)
  assert plan["kv_cache"]["bytes_batch"] == plan["kv_cache"]["bytes_per_sequence"] > 0
  assert plan["decode"]["one_device_batch_1"]["tokens_per_s"] > 0
  rows = {s["strategy"]: s for s in plan["training"]["strategies"]}
  assert rows["zero3"]["constraint"] == (
    "--batch=1 must be a multiple of 8 under --strategy=zero3 (8 data-parallel replicas x "
    "--grad-accum=1)"
  )
  assert rows["zero3"]["activations_peak"] is None and rows["zero3"]["params"] > 0
  assert rows["tensor"]["constraint"] is None and rows["tensor"]["total"] > 0  # 1 replica
  assert plan["activations"] == []
  rc, out, _ = run(capsys, "--config", "llama-2-7b", "--batch", "1")
  assert rc == 0 and "n/a: --batch=1 must be a multiple of 8 under --strategy=zero3" in out
  assert "Decode ceiling" in out and "KV cache" in out


def test_pipeline_flags(capsys):
  argv = ["--config", "llama-3-8b", "--devices", "16", "--tensor", "2", "--json"]
  rc, out, err = run(capsys, *argv, "--pipeline", "4", "--microbatches", "8", "--repeats", "2")
  assert rc == 0, err
  plan = json.loads(out)
  pp = plan["pipeline"]
  assert (pp["stages"], pp["microbatches"], pp["repeats"], pp["schedule"]) == (4, 8, 2, "circular")
  assert pp["iterations"] == 19 and pp["bubble"] == pytest.approx(3 / 19)
  zero3 = next(s for s in plan["training"]["strategies"] if s["strategy"] == "zero3")
  assert zero3["mesh"] == {"data": 1, "fsdp": 2, "expert": 1, "stage": 4, "tensor": 2}
  rc, out, _ = run(capsys, *argv[:-1], "--pipeline", "4", "--microbatches", "8")
  assert rc == 0 and "4 stages x 8 micro-batches (GPipe)" in out and "bubble" in out


def test_serving_figures_start_from_what_serve_py_serves(tmp_path, capsys):
  """A float32 folder is planned in float32 (serve.py --dtype auto serves its checkpoint's
  dtype) unless --precision says otherwise; --memory replaces the device's memory; the decode
  ceiling prints each (devices, batch) row once."""
  cfg = REFERENCE_MODELS["llama-3-8b"].model
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))  # dtype float32
  rc, out, _ = run(capsys, "--config", str(tmp_path), "--devices", "1", "--batch", "1", "--json")
  plan = json.loads(out)
  assert plan["inputs"]["precision"] == "fp32" and plan["kv_cache"]["dtype_bytes"] == 4
  rc, out, _ = run(capsys, "--config", str(tmp_path), "--precision", "bf16", "--json")
  assert json.loads(out)["inputs"]["precision"] == "bf16"
  args = ("--config", "llama-3-8b", "--devices", "1", "--batch", "1", "--json")
  h100 = json.loads(run(capsys, *args)[1])["serving"]
  small = json.loads(run(capsys, *args, "--memory", "24GB")[1])["serving"]
  assert small["pool_bytes_per_device"] == int(0.9 * 24e9) - small["weight_bytes_per_device"]
  assert h100["pool_bytes_per_device"] == int(0.9 * 80e9) - h100["weight_bytes_per_device"]
  rc, out, _ = run(capsys, "--config", "llama-3-8b", "--devices", "1", "--batch", "1")
  assert rc == 0 and out.count("1 device, batch 1") == 1
