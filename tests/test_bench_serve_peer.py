"""bench/serve.py's peer and online modes without vLLM: the SSE reading, the percentiles and
per-pass figures on canned data, the load shapes against a canned SSE server, the flag checks,
and (slow) the online driver against our own serve.py."""

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import importlib.util  # noqa: E402

import serve_http  # noqa: E402
import serve_peer  # noqa: E402

# bench/serve.py under its own name: `import serve` is the repository's serve.py (test_cli.py).
_BENCH_SERVE = Path(__file__).parents[1] / "bench" / "serve.py"
_spec = importlib.util.spec_from_file_location("bench_serve", _BENCH_SERVE)
bench_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serve)


def chunk(text, usage=None):
  body = {"choices": [{"index": 0, "text": text}]}
  if usage is not None:
    body = {"choices": [], "usage": {"completion_tokens": usage}}
  return f"data: {json.dumps(body)}\n"


def test_sse_lines_parse_to_payloads():
  assert serve_http.parse_sse_line('data: {"a": 1}\r\n') == {"a": 1}
  assert serve_http.parse_sse_line("data:[DONE]\n") is serve_http.DONE
  assert serve_http.parse_sse_line("\n") is None
  assert serve_http.parse_sse_line(": keep-alive\n") is None
  assert serve_http.parse_sse_line("event: x\n") is None


def test_read_stream_times_text_events_and_takes_usage():
  lines = [chunk(" w1"), "\n", chunk(""), "\n", chunk(" w2"), "\n", chunk(None, usage=2)]
  lines += ["\n", "data: [DONE]\n", chunk(" late")]
  ticks = iter([10.0, 11.0, 12.5, 13.0, 99.0])
  times, usage = serve_http.read_stream([s.encode() for s in lines], clock=lambda: next(ticks))
  assert times == [10.0, 12.5]  # the empty chunk and the usage chunk carry no text
  assert usage == 2


def test_read_stream_raises_on_an_error_event():
  with pytest.raises(RuntimeError, match="server error event"):
    serve_http.read_stream(['data: {"error": {"message": "boom"}}\n'])


def test_percentile_matches_numpy_and_exact_values():
  xs = [4.0, 1.0, 3.0, 2.0]
  assert serve_http.percentile(xs, 50) == 2.5
  assert serve_http.percentile(xs, 90) == pytest.approx(3.7)
  assert serve_http.percentile(xs, 99) == pytest.approx(3.97)
  assert serve_http.percentile([5.0], 99) == 5.0
  assert np.isnan(serve_http.percentile([], 50))
  rng = np.random.default_rng(0)
  ys = rng.exponential(size=101).tolist()
  for q in (0, 13, 50, 90, 99, 100):
    assert serve_http.percentile(ys, q) == pytest.approx(np.percentile(ys, q))


def test_summarize_a_pass():
  R = serve_http.Record
  records = [
    R(sent=0.0, event_times=[0.1, 0.2, 0.4], n_tokens=3, finished=0.5),
    R(sent=0.5, event_times=[0.8, 0.9], n_tokens=4, finished=1.0),  # one event held 3 tokens
  ]
  f = serve_http.summarize(records)
  assert f["tok_s"] == pytest.approx(7 / 1.0)
  assert f["tokens"] == 7
  assert f["events_per_token"] == pytest.approx(5 / 7)
  assert f["ttft_p50"] == pytest.approx(200.0)  # TTFTs 100 and 300 ms
  assert f["ttft_p90"] == pytest.approx(280.0)
  assert f["itl_p50"] == pytest.approx(100.0)  # ITLs 100, 200, 100 ms
  assert f["itl_p99"] == pytest.approx(198.0)
  assert f["bunched"] == 0.0  # sent 500 ms apart


def test_bunched_counts_requests_sent_with_the_one_before():
  # Two groups of three sent together (1 ms apart), the groups 300 ms apart: 4 of 6 bunched.
  sent = [0.0, 0.001, 0.002, 0.3, 0.301, 0.302]
  assert serve_http.bunched(sent[::-1]) == pytest.approx(4 / 6)  # order of sending irrelevant
  assert serve_http.bunched([0.0, 0.1, 0.2, 0.3]) == 0.0
  assert serve_http.bunched([0.0, 0.006], window=0.005) == 0.0
  assert serve_http.bunched([]) == 0.0


def test_summarize_refuses_a_failed_pass():
  records = [serve_http.Record(sent=0.0, finished=1.0, error="HTTP 400: bad")]
  with pytest.raises(RuntimeError, match="1 of 1 requests failed, first: HTTP 400: bad"):
    serve_http.summarize(records)


def test_poisson_arrivals_are_seeded_increasing_at_the_rate():
  a = serve_http.poisson_arrivals(2000, 50.0, seed=3)
  assert a == serve_http.poisson_arrivals(2000, 50.0, seed=3)
  assert all(x < y for x, y in zip(a, a[1:]))
  assert 2000 / a[-1] == pytest.approx(50.0, rel=0.1)


def test_completion_bodies_are_greedy_token_prompts():
  (body,) = serve_http.completion_bodies([[3, 4]], 5, "m")
  assert body == dict(
    model="m",
    prompt=[3, 4],
    max_tokens=5,
    temperature=0,
    ignore_eos=True,
    stream_options={"include_usage": True},
  )


class CannedSSE(http.server.BaseHTTPRequestHandler):
  """One text event per requested token, 5 ms apart, then the usage chunk and [DONE]."""

  protocol_version = "HTTP/1.1"
  active = 0
  most = 0
  lock = threading.Lock()

  def log_message(self, *args):
    pass

  def do_GET(self):
    self.send_response(200 if self.path == "/health" else 404)
    self.send_header("Content-Length", "0")
    self.end_headers()

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    with CannedSSE.lock:
      CannedSSE.active += 1
      CannedSSE.most = max(CannedSSE.most, CannedSSE.active)
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Transfer-Encoding", "chunked")
    self.end_headers()

    def send(text):
      data = text.encode()
      self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
      self.wfile.flush()

    for i in range(body["max_tokens"]):
      time.sleep(0.005)
      send(chunk(f" w{i}") + "\n")
    send(chunk(None, usage=body["max_tokens"]) + "\n" + "data: [DONE]\n\n")
    self.wfile.write(b"0\r\n\r\n")
    with CannedSSE.lock:
      CannedSSE.active -= 1


@pytest.fixture
def canned_server():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CannedSSE)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  CannedSSE.most = 0
  yield server.server_address[1]
  server.shutdown()


def test_fixed_concurrency_against_a_canned_server(canned_server):
  bodies = serve_http.completion_bodies([[1, 2]] * 6, 4, "m")
  records = serve_http.run_concurrent("127.0.0.1", canned_server, bodies, streams=2)
  f = serve_http.summarize(records)
  # Never more than 2 requests in flight on the client's side (a server thread may outlive its
  # response by a moment, so its own count can read one more).
  edges = sorted([(r.sent, 1) for r in records] + [(r.finished, -1) for r in records])
  in_flight = [sum(step for _, step in edges[: i + 1]) for i in range(len(edges))]
  assert max(in_flight) == 2 and CannedSSE.most >= 2
  assert f["tokens"] == 24 and f["events_per_token"] == 1.0
  assert f["itl_p50"] > 0  # the server sleeps between events: they arrive apart (no bound on time)


def test_staggered_streams_start_apart(canned_server):
  # Each canned request takes at least 20 ms, so by the time the third stream starts (0.4 s)
  # at most 30 of the 60 are taken: all three streams run.
  bodies = serve_http.completion_bodies([[1, 2]] * 60, 4, "m")
  records = serve_http.run_concurrent("127.0.0.1", canned_server, bodies, streams=3, stagger=0.2)
  start = min(r.sent for r in records)
  in_flight = lambda t: sum(r.sent <= t < r.finished for r in records)
  # One stream alone for its first 0.2 s, two until 0.4 s, then three.
  assert max(in_flight(r.sent) for r in records if r.sent < start + 0.19) == 1
  assert max(in_flight(r.sent) for r in records if r.sent < start + 0.39) <= 2
  assert max(in_flight(r.sent) for r in records) == 3
  assert serve_http.summarize(records)["tokens"] == 240


def test_poisson_load_against_a_canned_server(canned_server):
  bodies = serve_http.completion_bodies([[1]] * 5, 3, "m")
  records = serve_http.run_poisson("127.0.0.1", canned_server, bodies, rate=50.0, seed=1)
  assert [r.n_tokens for r in records] == [3] * 5
  assert [len(r.event_times) for r in records] == [3] * 5
  arrivals = serve_http.poisson_arrivals(5, 50.0, seed=1)  # spread over ~80 ms, not sent at once
  assert records[-1].sent - records[0].sent >= arrivals[-1] - arrivals[0] - 0.02


def test_an_http_error_is_recorded():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    rec = serve_http.stream_completion("127.0.0.1", server.server_address[1], {"max_tokens": 1})
  finally:
    server.shutdown()
  assert rec.error.startswith("HTTP 501")


def test_wait_ready_names_a_server_that_exited():
  proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
  proc.wait()
  with pytest.raises(RuntimeError, match="exited with code 3"):
    serve_http.wait_ready(proc, "127.0.0.1", 9, timeout=5)


def test_agreement_counts_equal_sequences_and_prefixes():
  same, prefix = serve_peer.agreement([[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 9, 4], [5, 6], [8]])
  assert same == 1
  assert prefix == pytest.approx((0.5 + 1.0 + 0.0) / 3)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--batches", "8,x"], "--batches '8,x'"),
    (["--online", "--streams", "0"], "--streams '0'"),
    (["--peer", "vllm", "--peer-python", "/nonexistent/python"], "--peer-python /nonexistent"),
    (["--streams", "4"], "--streams is an --online flag"),
    (["--starts", "2"], "--starts is an --online flag"),
    (["--online", "--starts", "0"], "--starts 0: must be at least 1"),
    (["--stagger", "50"], "--stagger is an --online flag"),
    (["--online", "--stagger", "-1"], "--stagger -1: must be at least 0"),
  ],
)
def test_bad_flags_name_the_flag(argv, message, capsys, monkeypatch):
  monkeypatch.delenv("VLLM_PYTHON", raising=False)
  with pytest.raises(SystemExit) as e:
    bench_serve.main(argv)
  assert message in f"{e.value.code} {capsys.readouterr().err}"


@pytest.mark.slow
def test_layouts_mode_runs_both_layouts(capsys):
  """`--only layouts`: a row per repetition and batch, stacked against per-layer, the ratio the
  two rates', under a header naming a layer's bytes as the runner counts them."""
  small = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1"]
  small += ["model.ffn_dim=64", "model.vocab_size=64"]
  argv = ["--only", "layouts", "--batches", "2", "--prompt-len", "40", "--new-tokens", "4"]
  bench_serve.main(argv + ["--repeat", "2"] + [a for kv in small for a in ("--set", kv)])
  out = capsys.readouterr().out
  D, F, H = 32, 64, 16
  layer = 4 * (2 * D * 2 * H + 2 * D * 1 * H + 3 * D * F + 2 * D)
  assert f"({layer / 1e6:.1f} MB a layer)" in out
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 2 |")]
  assert len(rows) == 2
  for _, _, stacked, per_layer, ratio in rows:
    assert float(ratio) == pytest.approx(float(stacked) / float(per_layer), abs=0.02)


def test_peer_without_a_python_says_how_to_give_one(monkeypatch):
  monkeypatch.delenv("VLLM_PYTHON", raising=False)
  with pytest.raises(SystemExit, match="--peer-python PATH"):
    bench_serve.main(["--peer", "vllm"])


def test_the_folder_has_a_tokenizer_transformers_loads(tmp_path):
  from flax import nnx
  from transformers import AutoTokenizer

  from atlas_jax.config import load_config
  from atlas_jax.model.transformer import Transformer

  cfg = load_config("configs/tiny.yaml", ["model.n_layers=1", "model.vocab_size=64"]).model
  folder = serve_peer.random_folder(Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path / "m")
  tok = AutoTokenizer.from_pretrained(folder)
  assert tok("w5 w63 w0")["input_ids"] == [5, 63, 0]  # no BOS added
  assert tok.decode([5, 63]) == "w5 w63"
  assert json.loads((folder / "config.json").read_text())["vocab_size"] == 64


@pytest.mark.slow
def test_online_driver_against_our_server(capsys):
  bench_serve.main(
    ["--online", "--set", "model.n_layers=1", "--set", "model.d_model=64", "--set",
     "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set", "model.ffn_dim=128",
     "--streams", "2", "--rate", "20", "--requests", "4", "--repeat", "1", "--new-tokens", "4",
     "--prompt-len", "8", "--starts", "2"]
  )  # fmt: skip
  out = capsys.readouterr().out
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ours #")]
  cells = [[c.strip() for c in r] for r in rows]
  assert [(c[0], c[1]) for c in cells] == [
    ("ours #1", "2 streams"),
    ("ours #2", "2 streams"),
    ("ours #1", "Poisson 20/s"),
    ("ours #2", "Poisson 20/s"),
  ]
  assert all(c[5] == "1.00" for c in cells)  # one event per token
  assert all(0.0 <= float(c[6]) <= 1.0 for c in cells)  # the bunched share
