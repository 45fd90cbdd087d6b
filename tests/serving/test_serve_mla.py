"""serve.py on MLA models: a trained deepseek-tiny run, and a DeepSeek-V3-style Hugging Face folder
served over HTTP, both giving the tokens `generate` and transformers give."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.training import checkpoint

ROOT = Path(__file__).parent.parent.parent
sys.path.insert(0, str(ROOT))

import serve  # noqa: E402
import train  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("deepseek")
  data = tmp / "data.jsonl"
  data.write_text(
    "".join(json.dumps({"text": f"def g{i}(y):\n    return y + {i}\n"}) + "\n" for i in range(100))
  )
  sets = {
    "data.source": data,
    "data.eval_fraction": 0.1,
    "model.n_layers": 2,
    "model.d_model": 64,
    "model.ffn_dim": 128,
    "model.n_heads": 4,
    "model.mla.q_lora_rank": 24,
    "model.mla.kv_lora_rank": 16,
    "model.mla.qk_rope_head_dim": 8,
    "model.mla.qk_nope_head_dim": 16,
    "model.mla.v_head_dim": 16,
    "train.steps": 2,
    "train.seq_len": 32,
    "train.log_every": 2,
    "train.eval_every": 0,
    "train.checkpoint_dir": tmp / "ckpt",
  }
  argv = ["--config", str(ROOT / "configs" / "deepseek-tiny.yaml"), "--sample-prompt", ""]
  for key, value in sets.items():
    argv += ["--set", f"{key}={value}"]
  assert train.main(argv) == 0
  return tmp / "ckpt"


@pytest.mark.slow  # MLA folders and models are served in the fast suite
def test_trained_deepseek_run_serves_what_generate_gives(deepseek_run, tmp_path):
  prompts = ["def g1", "return", "x"]
  out = tmp_path / "out.jsonl"
  argv = ["--checkpoint", str(deepseek_run), "--max-new-tokens", "10", "--output", str(out)]
  assert serve.main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]

  model, cfg, tok = checkpoint.load_model(deepseek_run)
  assert cfg.model.mla is not None and cfg.model.mtp is not None
  ids = generate(
    model, [tok.encode(p) for p in prompts], SamplingParams(max_new_tokens=10), eos_id=tok.eos_id
  )
  assert [r["completion"] for r in rows] == [tok.decode(i) for i in ids]
  assert [r["completion_tokens"] for r in rows] == [len(i) for i in ids]
  # Self-speculation with the run's MTP head: the same greedy completions.
  spec = tmp_path / "spec.jsonl"
  argv = [*argv[:-1], str(spec), "--speculative", "mtp", "--num-speculative-tokens", "1"]
  assert serve.main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
  assert [json.loads(line)["completion"] for line in spec.read_text().splitlines()] == [
    r["completion"] for r in rows
  ]


def word_tokenizer(vocab_size: int):
  """A reversible tokenizer: token i is the word "w{i}", words joined by spaces."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {f"w{i}": i for i in range(vocab_size)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return tok


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # the engine-level V3 checks stay in the default suite
def test_deepseek_v3_hf_folder_over_http_matches_transformers(tmp_path):
  from tests.test_hf_deepseek import build_hf

  V = 101
  ref = build_hf(tmp_path, vocab_size=V)
  word_tokenizer(V).save(str(tmp_path / "tokenizer.json"))
  # Prompts of up to 16 tokens take MLA's absorbed path in prefill, longer ones the expanded one.
  prompts = [[5, 17, 3, 99, 42, 8, 8, 60], [7, 1, 2], [(13 * i) % V for i in range(1, 24)]]
  want = []
  for p in prompts:
    with torch.no_grad():
      out = ref.generate(
        torch.tensor([p]),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
      )
    want.append(out[0, len(p) :].tolist())

  port = free_port()
  cmd = [sys.executable, str(ROOT / "serve.py"), "--checkpoint", str(tmp_path), "--port", str(port)]
  cmd += ["--served-model-name", "m", "--max-batch", "2", "--prefill-chunk", "32"]
  proc = subprocess.Popen(
    cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  try:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
      assert proc.poll() is None, proc.stdout.read()
      try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() < deadline, "serve.py did not come up"
      time.sleep(0.5)
    for p, w in zip(prompts, want):
      body = {"model": "m", "prompt": " ".join(f"w{t}" for t in p), "max_tokens": 8}
      r = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=120)
      assert r.status_code == 200, r.text
      assert r.json()["choices"][0]["text"] == " ".join(f"w{t}" for t in w)
  finally:
    proc.terminate()
    proc.wait(timeout=30)
