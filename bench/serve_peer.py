"""Our engine and server against a peer's (vLLM's CPU engine), on the same Hugging Face folder.

bench/serve.py's `--peer vllm` and `--online` modes; the peer runs in its own virtualenv, as a
subprocess (bench/vllm_peer.py offline, vLLM's OpenAI server online), so neither vLLM nor its
torch is one of our dependencies. See bench/serve.py's docstring for the commands.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import serve_http

from atlas_jax import hf
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.model.transformer import Transformer
from atlas_jax.serving.engine import Engine, EngineConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"  # the id both servers serve the folder as
# The peer comparison's model (`--peer`, `--online`) before any --set: a float32 Llama larger
# than tiny's, so that neither stack's per-step overhead is all that is measured.
PEER_SHAPE = [
  "model.d_model=512",
  "model.n_layers=6",
  "model.n_heads=8",
  "model.n_kv_heads=4",
  "model.ffn_dim=1408",
  "model.vocab_size=2048",
]


# A step's token budget for both engines offline: vLLM's own default for its offline `LLM` on CPU
# (4096; its OpenAI server's is 2048), passed to it explicitly and given to ours.
PEER_BATCHED_TOKENS = 4096


def word_tokenizer_files(folder: Path, vocab_size: int) -> None:
  """tokenizer.json and tokenizer_config.json of a reversible word-level tokenizer (token i is
  the word "w{i}"), which our serve.py and vLLM both load; no BOS is added to a prompt."""
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, as they were split
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")
  fast.save_pretrained(folder)


def random_folder(model: Transformer, folder: Path) -> Path:
  """`model`'s weights (random) as a Hugging Face folder with a tokenizer both stacks load."""
  hf.save(model, folder)
  word_tokenizer_files(folder, model.cfg.vocab_size)
  return folder


def loadavg() -> str:
  return f"{os.getloadavg()[0]:.2f}"


def check_peer_python(path: str | None) -> str:
  """The peer's python, checked: a clear error naming the flag if it is missing or not a file."""
  if not path:
    raise SystemExit("error: --peer vllm needs --peer-python PATH (or the VLLM_PYTHON variable)")
  if not (os.path.isfile(path) and os.access(path, os.X_OK)):
    raise SystemExit(f"error: --peer-python {path}: not an executable file")
  return os.path.abspath(path)  # the peer runs elsewhere; abspath keeps the venv's symlink


# -- offline ----------------------------------------------------------------------------------


class PeerProcess:
  """bench/vllm_peer.py --serve: one vLLM engine, runs sent one JSON line at a time."""

  def __init__(self, python: str, job: dict, log):
    self.job_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(job, self.job_file)
    self.job_file.close()
    cmd = [python, str(ROOT / "bench" / "vllm_peer.py"), self.job_file.name, "--serve"]
    self.proc = subprocess.Popen(
      cmd,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=log,
      text=True,
      cwd=Path(job["folder"]).parent,  # not the repository: nothing there shadows vLLM's imports
      start_new_session=True,
    )
    try:
      self._reply()  # {"ready": true} once the engine is built
    except BaseException:
      serve_http.stop(self.proc)
      os.unlink(self.job_file.name)
      raise

  def _reply(self) -> dict:
    for line in self.proc.stdout:
      if line.startswith("PEER "):
        return json.loads(line[5:])
    raise RuntimeError(f"vllm_peer.py exited with code {self.proc.wait()} (its log is above)")

  def run(self, prompts, max_tokens) -> dict:
    self.proc.stdin.write(json.dumps(dict(prompts=prompts, max_tokens=max_tokens)) + "\n")
    self.proc.stdin.flush()
    return self._reply()

  def close(self) -> None:
    try:
      if self.proc.poll() is None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
      pass
    serve_http.stop(self.proc)
    os.unlink(self.job_file.name)


def engine_config(
  batch: int, max_prompt: int, new_tokens: int, max_len: int, burst: int, tokens: int = 2048
):
  """Our engine sized as bench/serve.py's ratio mode sizes it, for `batch` running requests and
  a budget of `tokens` a step."""
  Z = 16
  return EngineConfig(
    n_blocks=batch * -(-(max_prompt + new_tokens + burst) // Z) + 8,
    block_size=Z,
    max_num_seqs=batch,
    max_num_batched_tokens=max(batch, tokens),
    prefill_chunk=min(512, 1 << max(max_prompt - 1, 1).bit_length()),
    max_model_len=max_len,
    decode_burst=burst,
  )


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
  """(sequences equal token for token, mean fraction of each sequence before the first
  difference)."""
  same, prefix = 0, []
  for a, b in zip(ours, theirs, strict=True):
    same += a == b
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    prefix.append(n / max(len(a), 1))
  return same, float(np.mean(prefix))


def offline(model: Transformer, args) -> None:
  """Ours (`Engine.generate`) and vLLM's `LLM.generate` on the same folder and prompts, runs
  interleaved, best of `args.repeat`; tok/s, the ratio and greedy agreement per batch size."""
  cfg = model.cfg
  rng = np.random.default_rng(0)
  lengths = rng.integers(args.min_prompt_len, args.prompt_len + 1, args.requests)
  prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lengths]
  max_tokens = [args.new_tokens] * len(prompts)
  params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  n_tokens = sum(max_tokens)
  print(
    f"\n## offline against vLLM: {len(prompts)} prompts of {args.min_prompt_len}-"
    f"{args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy, ignore_eos"
  )
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    folder = random_folder(model, Path(tmp) / "model")
    model = hf.load(folder)  # ours reads the folder vLLM reads
    for batch in args.batches:
      print(f"building vLLM (max_num_seqs {batch}), load {loadavg()}", flush=True)
      job = dict(
        folder=str(folder),
        max_num_seqs=batch,
        max_model_len=cfg.max_seq_len,
        max_num_batched_tokens=PEER_BATCHED_TOKENS,
        enforce_eager=args.peer_eager,
      )
      peer = PeerProcess(args.peer_python, job, sys.stderr)
      try:
        config = engine_config(
          batch, args.prompt_len, args.new_tokens, cfg.max_seq_len, 8, PEER_BATCHED_TOKENS
        )
        Engine(model, config).generate(prompts, params)  # compiles every shape it will use
        peer.run(prompts, max_tokens)  # vLLM's warm-up
        best_ours = best_theirs = 0.0
        for r in range(args.repeat):
          print(f"batch {batch} repeat {r + 1}: ours, load {loadavg()}", flush=True)
          engine = Engine(model, config)  # a fresh pool: no prefix-cache hits from the last run
          start = time.perf_counter()
          ours_ids = engine.generate(prompts, params)
          best_ours = max(best_ours, n_tokens / (time.perf_counter() - start))
          print(f"batch {batch} repeat {r + 1}: vLLM, load {loadavg()}", flush=True)
          got = peer.run(prompts, max_tokens)
          best_theirs = max(best_theirs, n_tokens / got["seconds"])
      finally:
        peer.close()
      same, prefix = agreement(ours_ids, got["token_ids"])
      rows.append((batch, best_ours, best_theirs, same, prefix))
  print(
    "\n| batch | ours tok/s | vLLM tok/s | ours / vLLM | greedy sequences equal | prefix agreed |"
  )
  print("|---|---|---|---|---|---|")
  for batch, o, t, same, prefix in rows:
    print(f"| {batch} | {o:.0f} | {t:.0f} | {o / t:.2f} | {same}/{len(prompts)} | {prefix:.2f} |")


# -- online -----------------------------------------------------------------------------------


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def server_command(kind: str, folder: Path, port: int, seqs: int, max_len: int, python: str):
  """(argv, extra environment) of our serve.py or vLLM's OpenAI server on `folder`."""
  common = ["--port", str(port), "--served-model-name", MODEL_NAME, "--max-num-seqs", str(seqs)]
  common += ["--max-model-len", str(max_len)]
  if kind == "ours":
    cmd = [sys.executable, str(ROOT / "serve.py"), "--checkpoint", str(folder), *common]
    return cmd + ["--kv-cache-memory", "1GiB", "--log-level", "warning"], {}
  cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *common]
  return cmd + ["--dtype", "float32"], {"VLLM_CPU_KVCACHE_SPACE": "1"}


def load_shapes(args) -> list[tuple[str, object]]:
  apart = f", {args.stagger:g} ms apart" if args.stagger else ""
  return [(f"{n} streams{apart}", n) for n in args.streams] + (
    [(f"Poisson {args.rate:g}/s", None)] if args.rate is not None else []
  )


def drive(port: int, shape, bodies: list[dict], args) -> dict:
  """One pass of one load shape: its figures (serve_http.summarize)."""
  if shape is None:
    records = serve_http.run_poisson("127.0.0.1", port, bodies, args.rate, seed=args.seed)
  else:
    records = serve_http.run_concurrent(
      "127.0.0.1", port, bodies, shape, stagger=args.stagger / 1e3
    )
  return serve_http.summarize(records)


def online_server(kind: str, folder: Path, args, prompts_by_pass) -> dict:
  """{shape name: medians over passes} for one server, started here and always stopped."""
  port = free_port()
  seqs = max([*args.streams, args.batch])
  cmd, env = server_command(kind, folder, port, seqs, args.max_len, args.peer_python)
  results = {}
  with tempfile.TemporaryFile("w+") as log:
    proc = subprocess.Popen(
      cmd,
      cwd=folder.parent,  # not the repository: nothing there shadows vLLM's imports
      env={**os.environ, **env},
      stdout=log,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
    try:
      try:
        up = serve_http.wait_ready(proc, "127.0.0.1", port, args.server_timeout)
      except RuntimeError as e:
        log.seek(0)
        tail = log.read()[-4000:]
        raise SystemExit(f"error: {kind} server: {e}\n{tail}") from None
      print(f"{kind} server ready in {up:.0f} s on port {port} (max_num_seqs {seqs})", flush=True)
      for name, shape in load_shapes(args):
        warm, *passes = prompts_by_pass
        drive(port, shape, serve_http.completion_bodies(warm, args.new_tokens, MODEL_NAME), args)
        figures = []
        for i, prompts in enumerate(passes):
          print(f"{kind}, {name}, pass {i + 1}: load {loadavg()}", flush=True)
          bodies = serve_http.completion_bodies(prompts, args.new_tokens, MODEL_NAME)
          figures.append(drive(port, shape, bodies, args))
        results[name] = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
        if args.guidellm and isinstance(shape, int):
          results[f"guidellm {shape} streams"] = guidellm_pass(
            args, port, shape, folder, prompts_by_pass
          )
    finally:
      serve_http.stop(proc)
  return results


def guidellm_pass(args, port: int, streams: int, folder: Path, prompts_by_pass) -> dict:
  """guidellm (an outside load generator, `--guidellm PATH` its executable) on the same server:
  a warm-up pass, then one measured pass of `args.requests` of the last pass's prompts, written
  as text in the folder tokenizer's words so both servers read the same token ids."""
  out = {}
  for label, prompts in (("warm", prompts_by_pass[0]), ("run", prompts_by_pass[-1])):
    data = folder.parent / f"guidellm_{port}_{label}.jsonl"
    with open(data, "w") as f:
      for p in prompts:
        text = " ".join(f"w{t}" for t in p)
        row = {"prompt": text, "prompt_tokens_count": len(p)}
        f.write(json.dumps({**row, "output_tokens_count": args.new_tokens}) + "\n")
    report = folder.parent / f"guidellm_{port}_{label}.json"
    backend = f"http://127.0.0.1:{port},model={MODEL_NAME},request_format=/v1/completions"
    cmd = [os.path.abspath(args.guidellm), "run", "--backend", f"kind=openai_http,target={backend}"]
    cmd += ["--profile", f"kind=concurrent,streams={streams}"]
    cmd += ["--constraint", f"kind=max_requests,count={len(prompts)}"]
    cmd += ["--data", f"kind=json_file,path={data}"]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={folder}"]
    cmd += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    done = subprocess.run(cmd, cwd=folder.parent, capture_output=True, text=True)
    if done.returncode:
      raise SystemExit(f"error: guidellm exited with {done.returncode}\n{done.stderr[-3000:]}")
  bench = json.loads(report.read_text())["benchmarks"][0]
  m = bench["metrics"]
  ttft, itl = m["time_to_first_token_ms"]["successful"], m["inter_token_latency_ms"]["successful"]
  pct = lambda d, q: d["median"] if q == 50 else d["percentiles"][f"p{q}"]
  tokens = m["output_token_count"]["successful"]["total_sum"]
  out = {
    "tok_s": tokens / bench["duration"],
    "events_per_token": float("nan"),
    "bunched": float("nan"),
  }
  for q in (50, 90, 99):
    out[f"ttft_p{q}"], out[f"itl_p{q}"] = pct(ttft, q), pct(itl, q)
  return out


def online(model: Transformer, args) -> None:
  """Ours and (with --peer vllm) vLLM's server, each started `args.starts` times in turn (ours,
  vLLM, ours, ...), under each load shape; a table row per start of medians over `args.repeat`
  passes after a discarded warm-up pass."""
  cfg = model.cfg
  rng = np.random.default_rng(args.seed)
  prompts_by_pass = [
    [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    for _ in range(args.repeat + 1)
  ]
  print(
    f"\n## online over HTTP: streamed /v1/completions, {args.requests} requests a pass of "
    f"{args.prompt_len} prompt tokens and {args.new_tokens} new tokens (greedy, ignore_eos); "
    f"medians of {args.repeat} passes after a warm-up pass, {args.starts} start(s) of each server"
  )
  kinds = ["ours"] + (["vLLM"] if args.peer else [])
  table: dict[str, list[dict]] = {kind: [] for kind in kinds}
  with tempfile.TemporaryDirectory() as tmp:
    folder = random_folder(model, Path(tmp) / "model")
    for _ in range(args.starts):
      for kind in kinds:
        table[kind].append(online_server(kind, folder, args, prompts_by_pass))
  print(
    "\n| server | load | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | "
    "events / token | bunched |"
  )
  print("|---|---|---|---|---|---|---|")
  dash = lambda x, spec: "-" if x != x else format(x, spec)  # NaN: guidellm does not count
  names = [name for name, _ in load_shapes(args)]
  names += [name for name in table["ours"][0] if name.startswith("guidellm ")]
  for name in names:
    for kind in kinds:
      for i, got in enumerate(table[kind]):
        f = got[name]
        label = kind if args.starts == 1 else f"{kind} #{i + 1}"
        print(
          f"| {label} | {name} | {f['tok_s']:.0f} | {f['ttft_p50']:.0f} / {f['ttft_p90']:.0f} / "
          f"{f['ttft_p99']:.0f} | {f['itl_p50']:.1f} / {f['itl_p90']:.1f} / {f['itl_p99']:.1f} | "
          f"{dash(f['events_per_token'], '.2f')} | {dash(f['bunched'], '.2f')} |"
        )
    if args.peer:
      tok = _median(table, "ours", name, "tok_s") / _median(table, "vLLM", name, "tok_s")
      ttft = _median(table, "ours", name, "ttft_p50") / _median(table, "vLLM", name, "ttft_p50")
      label = "ours / vLLM" + (" (median of starts)" if args.starts > 1 else "")
      print(f"| {label} | {name} | {tok:.2f} | p50 {ttft:.2f} | | | |")


def _median(table: dict[str, list[dict]], kind: str, name: str, key: str) -> float:
  """The median over a server's starts of one load shape's figure."""
  return statistics.median(got[name][key] for got in table[kind])
