"""train.py and serve.py end to end on a tiny run, and their errors on bad input."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

import serve  # noqa: E402
import train  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("run")
  data = tmp / "data.jsonl"
  data.write_text(
    "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200))
  )
  out = tmp / "ckpt"
  rc = train.main(
    [
      "--config",
      str(ROOT / "configs" / "tiny.yaml"),
      "--set",
      f"data.source={data}",
      "--set",
      "data.eval_fraction=0.1",
      "--set",
      "model.n_layers=2",
      "--set",
      "model.d_model=64",
      "--set",
      "model.ffn_dim=128",
      "--set",
      "train.steps=40",
      "--set",
      "train.seq_len=32",
      "--set",
      "train.log_every=20",
      "--set",
      "train.eval_every=40",
      "--set",
      "train.checkpoint_every=20",
      "--set",
      f"train.checkpoint_dir={out}",
      "--sample-tokens",
      "8",
    ]
  )
  assert rc == 0
  return out


def test_train_learns_and_checkpoints(run_dir):
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [20, 40]
  # A CPU's peak is not in the device table and train.peak_tflops is not given: no MFU.
  assert not any("mfu" in r for r in records)
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
    (["--set", "model.n_heads=6"], "model.n_heads=6"),
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
  assert "serve.top_p=2.0" in capsys.readouterr().err
  assert serve.main(["--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
  assert "no config.json" in capsys.readouterr().err
