"""Hugging Face folders served as their authors meant, checked against transformers: the prompt
ids of its default encoding and of `apply_chat_template`, greedy completions and chats that
stop where its `generate` stops (the folder's own eos ids), echo's prompt logprobs equal to its
log-softmax, and the folder's sampling defaults and dtype. Built through serve.py, as the
command line builds them."""

import contextlib
import json
import logging
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from .conftest import serving_app  # noqa: E402
from .hf_folders import build_folder  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2]))
import serve  # noqa: E402

KINDS = ("llama", "mistral", "qwen", "llama3")
PROMPTS = ["def foo(x):\n    return", "Hello, how are", "The quick brown"]
CHATS = {
  "mistral": [[{"role": "user", "content": "Hello, how are you?"}]],
  "qwen": [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
  ],
  "llama3": [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}],
  ],
}
FLAGS = ["--max-batch", "4", "--block-size", "8", "--max-num-batched-tokens", "64"]
FLAGS += ["--prefill-chunk", "32", "--max-model-len", "128", "--log-level", "warning"]


@contextlib.contextmanager
def served(folder, *flags):
  """serve.py's server over `folder` on a loopback port: yields its base url."""
  args = serve.parse_args(["--checkpoint", str(folder), "--port", "1", *FLAGS, *flags])
  engine, tokenizer, template, _ = serve.prepare(args)
  app, runner = serve.build_server(args, engine, tokenizer, template)
  with serving_app(app, runner) as url:
    yield url


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for kind in KINDS:
    (root / kind).mkdir()
    info = build_folder(kind, root / kind)
    out[kind] = dict(
      info,
      path=root / kind,
      tok=transformers.AutoTokenizer.from_pretrained(root / kind),
      model=transformers.AutoModelForCausalLM.from_pretrained(root / kind).eval(),
    )
  return out


@pytest.fixture(scope="module")
def servers(folders):
  with contextlib.ExitStack() as stack:
    urls = {kind: stack.enter_context(served(f["path"])) for kind, f in folders.items()}
    yield urls


def hf_greedy(f, ids, n=16):
  """transformers' greedy continuation of `ids`, stopping on the folder's own eos ids."""
  with torch.no_grad():
    out = f["model"].generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
  return out[0, len(ids) :].tolist()


def post(url, path, body):
  r = httpx.post(url + path, json=body, timeout=120)
  assert r.status_code == 200, r.text
  return r.json()


def check_choice(f, choice, usage, new) -> bool:
  """Our text, token count and finish reason are those of transformers' new tokens; whether
  they end on an eos."""
  text = choice["text"] if "text" in choice else choice["message"]["content"]
  assert text == f["tok"].decode(new, skip_special_tokens=True)
  assert usage["completion_tokens"] == len(new)
  eos = f["model"].generation_config.eos_token_id
  stopped = new[-1] in (eos if isinstance(eos, list) else [eos])
  assert choice["finish_reason"] == ("stop" if stopped else "length")
  return stopped


@pytest.mark.parametrize("kind", KINDS)
def test_completions_encode_and_stop_as_transformers(folders, servers, kind):
  f, url = folders[kind], servers[kind]
  stops = []
  for text in PROMPTS:
    want = f["tok"](text).input_ids
    assert post(url, "/tokenize", {"prompt": text})["tokens"] == want
    r = post(url, "/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0})
    assert r["usage"]["prompt_tokens"] == len(want)
    stops.append(check_choice(f, r["choices"][0], r["usage"], hf_greedy(f, want)))
  assert any(stops)  # the folder's eos ends some completion early


@pytest.mark.parametrize("kind", ["mistral", "qwen", "llama3"])
def test_chats_encode_and_stop_as_transformers(folders, servers, kind):
  f, url = folders[kind], servers[kind]
  # Llama 3's template dates its system header with `strftime_now` unless given a date: pinned,
  # so that the prompt (and whether the greedy chat stops) does not change with the day.
  date = {"date_string": "26 Jul 2024"}
  for messages in CHATS[kind]:
    want = f["tok"].apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=False, **date
    )
    got = post(url, "/tokenize", {"messages": messages, "chat_template_kwargs": date})["tokens"]
    assert got == want
    bos = f["tok"].bos_token_id
    assert bos is None or want.count(bos) == 1  # the template's own BOS, once
    body = {"messages": messages, "max_tokens": 16, "temperature": 0}
    body["chat_template_kwargs"] = date
    r = post(url, "/v1/chat/completions", body)
    new = hf_greedy(f, want)
    assert check_choice(f, r["choices"][0], r["usage"], new)
    if kind == "qwen":  # always <|im_end|>, declared in generation_config.json only
      assert new == [f["eos"]] and r["usage"]["completion_tokens"] == 1


def test_a_template_error_is_the_requests_fault(servers):
  body = {"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2}
  r = httpx.post(servers["mistral"] + "/v1/chat/completions", json=body, timeout=120)
  assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]


def test_echo_logprobs_are_transformers_log_softmax(folders, servers):
  f, url = folders["llama"], servers["llama"]
  text = PROMPTS[0]
  ids = f["tok"](text).input_ids
  body = {"prompt": text, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
  lp = post(url, "/v1/completions", body)["choices"][0]["logprobs"]
  with torch.no_grad():
    want = torch.log_softmax(f["model"](torch.tensor([ids])).logits[0].double(), -1)
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  got = np.asarray(lp["token_logprobs"][1 : len(ids)])
  np.testing.assert_allclose(
    got, [want[t - 1, ids[t]].item() for t in range(1, len(ids))], atol=1e-4
  )
  assert len(lp["tokens"]) == len(ids) + 1


def test_special_tokens_in_the_text_only_when_asked(folders, servers):
  f, url = folders["llama3"], servers["llama3"]
  header = f["ids"]["<|start_header_id|>"]
  body = {"prompt": "Hello", "max_tokens": 2, "logit_bias": {str(header): 100}}
  assert post(url, "/v1/completions", body)["choices"][0]["text"] == ""
  body["skip_special_tokens"] = False
  text = post(url, "/v1/completions", body)["choices"][0]["text"]
  assert text == "<|start_header_id|>" * 2


def test_served_model_names(folders):
  with served(folders["llama"]["path"], "--served-model-name", "a", "b") as url:
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["a", "b"]
    assert httpx.get(url + "/v1/models/b").json()["id"] == "b"
    assert post(url, "/v1/completions", {"model": "b", "prompt": "Hi", "max_tokens": 1})
    r = httpx.post(url + "/v1/completions", json={"model": "llama", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_generation_config_gives_the_sampling_defaults(folders):
  path = str(folders["llama3"]["path"])
  args = serve.parse_args(["--checkpoint", path, "--prompt", "x"])
  serve.fill_defaults(args)
  assert (args.temperature, args.top_p) == (0.6, 0.9)  # generation_config.json, do_sample true
  args = serve.parse_args(["--checkpoint", path, "--prompt", "x", "--temperature", "0.2"])
  serve.fill_defaults(args)
  assert (args.temperature, args.top_p) == (0.2, 0.9)
  args = serve.parse_args(["--checkpoint", path, "--prompt", "x", "--generation-config", "vllm"])
  serve.fill_defaults(args)
  assert (args.temperature, args.top_p) == (0.0, 1.0)


def test_dtype_auto_is_the_checkpoints_and_float32_on_cpu(folders, tmp_path, caplog):
  folder = tmp_path / "bf16"
  shutil.copytree(folders["qwen"]["path"], folder)
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
  with caplog.at_level(logging.INFO, logger="atlas_jax"):
    assert serve.resolve_dtype("auto", str(folder)) == "float32"
  assert "not the checkpoint's bfloat16: its matmuls are slow on a CPU" in caplog.text
  assert serve.resolve_dtype("bfloat16", str(folder)) == "bfloat16"
  assert serve.resolve_dtype("auto", str(folders["qwen"]["path"])) == "float32"


def test_tensor_parallel_serving_answers_as_transformers(folders):
  """serve.py --tensor-parallel-size 4 over a Qwen2 folder (2 kv heads with biases, repeated to
  4): greedy completions over HTTP are transformers' tokens."""
  f = folders["qwen"]
  args = serve.parse_args(["--checkpoint", str(f["path"]), "--port", "1", *FLAGS, "-tp", "4"])
  engine, tokenizer, template, _ = serve.prepare(args)
  assert (engine.runner.tensor, engine.model_config.n_kv_heads) == (4, 4)
  app, runner = serve.build_server(args, engine, tokenizer, template)
  with serving_app(app, runner) as url:
    for text in PROMPTS:
      want = f["tok"](text).input_ids
      r = post(url, "/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0})
      check_choice(f, r["choices"][0], r["usage"], hf_greedy(f, want))
