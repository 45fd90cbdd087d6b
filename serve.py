r"""Generate completions from a trained checkpoint or a Hugging Face folder.

    python serve.py --checkpoint checkpoints/tiny --prompt "def " --prompt "import "
    python serve.py --checkpoint path/to/hf_folder --prompts prompts.jsonl --output out.jsonl
    python serve.py --checkpoint path/to/hf_folder --port 8000 [--host 127.0.0.1] [--api-key KEY]
    python serve.py --checkpoint path/to/hf_folder --port 8000 --tensor-parallel-size 4 \
      --data-parallel-size 2 --set serve.engine.kv_cache_memory=0.8

Batch mode reads prompts (repeated --prompt, or a JSONL file with a "prompt" field per line,
and optionally the line's own max_tokens, temperature, top_p, top_k, stop, seed, ...) and writes
one JSON object per prompt: {"prompt", "completion", "completion_tokens", "finish_reason"}, in
input order. With --port it serves the OpenAI API instead (/v1/completions,
/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics). Both run the
continuous-batching engine over a paged KV cache.

A Hugging Face folder is served as its files say: the eos ids of generation_config.json (else
config.json, else tokenizer_config.json), the BOS its tokenizer adds, its chat template, its
dtype, and generation_config.json's sampling defaults (--generation-config vllm ignores them);
the flags override each.

Every serving setting is a field of `ServeConfig` (sections engine, limits, sampling), set with
`--set serve.SECTION.FIELD=VALUE`; the engine and limit flags are aliases of fields, with vLLM's
names where vLLM has one, checked by the same rules (an error names the flag as given). On
several devices the model is split over `--tensor-parallel-size` devices per replica and
`--data-parallel-size` replicas (`atlas_jax.serving.mesh`); the pool is sized from the devices'
memory (`atlas_jax.serving.sizing`).

Across hosts, run the same command on each with `--coordinator-address HOST:PORT --num-processes
N --process-id I`: process 0 serves HTTP (or the batch) and schedules, every process runs the
same steps over one mesh of all their devices (`atlas_jax.serving.multihost`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from atlas_jax import hf, host_memory, quant
from atlas_jax.config import (
  ConfigError,
  SamplingDefaults,
  ServeConfig,
  apply_overrides,
  build,
  load_config,
  migrate_serve,
)
from atlas_jax.data.corpus import iter_json_objects
from atlas_jax.decoding.drafters import NGramDrafter
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.hf.tokenizer import run_tokenizer
from atlas_jax.serving import mesh as placement
from atlas_jax.serving import model_files, multihost, reasoning, tool_parsers
from atlas_jax.serving.engine import Engine, RequestError
from atlas_jax.serving.lora import ServedAdapters
from atlas_jax.serving.server import (
  EngineRunner,
  RequestFields,
  Text,
  build_app,
  check_sampling_fields,
  describe_invalid,
  encodable,
  request_params,
  sampling_defaults,
)
from atlas_jax.training import checkpoint

log = logging.getLogger("atlas_jax.serving")
DTYPES = ("float32", "bfloat16", "float16")
# The persistent compilation cache's folder unless --compilation-cache-dir says otherwise.
COMPILATION_CACHE_ENV = "ATLAS_JAX_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = "~/.cache/atlas_jax/xla"


def parse_args(argv=None) -> argparse.Namespace:
  d = ServeConfig()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument(
    "--checkpoint",
    required=True,
    help="a train.py run directory, a Hugging Face folder (config.json + safetensors) or a "
    "GGUF file",
  )
  p.add_argument(
    "--fp8-activations",
    choices=("auto", "static", "dynamic", "none"),
    default="auto",
    help="an FP8 folder's kept weights: dynamic multiplies them by activations quantized to "
    "e4m3 per token (W8A8), static by activations quantized with the folder's input scales "
    "(activation_scheme static), none dequantizes them in the matmuls (weight-only); auto: "
    "static or dynamic where the backend has FP8 matmuls (cuda, tpu), else none",
  )
  p.add_argument(
    "--fp8-weights",
    choices=("keep", "dequantize"),
    default="keep",
    help="an FP8 folder's projections: keep their e4m3 codes and block scales on the device "
    "(where the model's layout holds the blocks), or dequantize all to --dtype at load",
  )
  p.add_argument(
    "--gguf-weights",
    choices=("keep", "dequantize"),
    default="keep",
    help="a GGUF file's Q8_0/Q4_0/Q6_K projections: keep their int8/int4 codes and group scales "
    "on the device (exact), or dequantize all to --dtype at load",
  )
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--prompts", help='JSONL file, one {"prompt": ...} per line')
  p.add_argument("--output", help="write JSONL here instead of stdout")
  # Defaults: generation_config.json's, else the run's `serve:` section, else these.
  default = lambda name: (
    f"default: generation_config.json's or the run's, else {getattr(d.sampling, name)}"
  )
  p.add_argument("--max-new-tokens", type=int, help=default("max_new_tokens"))
  p.add_argument("--temperature", type=float, help=default("temperature") + " (greedy)")
  p.add_argument("--top-k", type=int, help=default("top_k") + " (off)")
  p.add_argument("--top-p", type=float, help=default("top_p"))
  p.add_argument("--min-p", type=float, help="default: generation_config.json's, else 0 (off)")
  p.add_argument(
    "--repetition-penalty", type=float, help="default: generation_config.json's, else 1 (off)"
  )
  p.add_argument(
    "--seed",
    type=int,
    help="batch mode: the seed of prompts without their own (default: the run's, else 0); "
    "the server draws a fresh seed for each request without one",
  )
  p.add_argument(
    "--generation-config",
    default="auto",
    help="auto: the sampling defaults of the model folder's generation_config.json; vllm: "
    "ignore it; or a folder holding the generation_config.json to use",
  )
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="serve.SECTION.FIELD=VALUE",
    help="any serving setting, as train.py's --set (sections: engine, limits, sampling); the "
    "flags below are aliases of these fields; also train.py's mesh.coordinator_address, "
    "mesh.num_processes and mesh.process_id",
  )
  for path, (names, kind, what) in CONFIG_FLAGS.items():
    default = config_default(d, path)
    text = f"{what} (serve.{path}; default: {default if default is not None else 'sized'})"
    # argparse %-formats help (for `%(default)s`), so the table's plain text doubles its "%".
    # A true/false flag given alone means true (`--disable-hybrid-kv-cache-manager`, as vLLM's).
    alone = dict(nargs="?", const=True) if kind is on_off else {}
    p.add_argument(*names, dest=flag_dest(path), type=kind, help=text.replace("%", "%%"), **alone)
  p.add_argument(
    "--draft",
    help="speculative decoding: a smaller model with the same tokenizer (a train.py run directory "
    "or a Hugging Face folder) proposes tokens that the model checks in one pass",
  )
  p.add_argument(
    "--speculative",
    choices=["mtp"],
    help="mtp: self-speculation, the model's own multi-token-prediction heads draft",
  )
  p.add_argument(
    "--speculative-config",
    metavar="JSON",
    help='vLLM\'s speculation settings as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup in each request\'s own '
    'tokens), {"method": "mtp"}, or {"method": "draft_model", "model": PATH}',
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar in batch mode")
  p.add_argument(
    "--port",
    type=int,
    help="serve the OpenAI-compatible HTTP API on this port; a request with stream: true gets "
    "one server-sent event per token, each sent as soon as it is drawn (see --stream-bursts)",
  )
  p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
  p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ endpoints")
  p.add_argument(
    "--model-name",
    "--served-model-name",
    nargs="+",
    help="the model id(s) the API serves: requests naming another get a 404 (default: the folder)",
  )
  p.add_argument(
    "--chat-template",
    help="a Jinja chat template file, or the template itself (default: the model folder's)",
  )
  p.add_argument(
    "--enable-lora",
    action="store_true",
    help="serve LoRA adapters over the model: a request's model field names one (the base "
    "name: none), batches mix them; /v1/load_lora_adapter and /v1/unload_lora_adapter at run time",
  )
  p.add_argument(
    "--lora-modules",
    nargs="+",
    metavar="NAME=PATH",
    help="adapters loaded at start-up (PEFT folders: hf export --adapters separate, or peft's)",
  )
  p.add_argument(
    "--max-loras", type=int, default=1, help="adapters held at once (--enable-lora; default 1)"
  )
  p.add_argument(
    "--max-lora-rank",
    type=int,
    default=16,
    help="the largest adapter rank (--enable-lora; smaller ranks are zero-padded; default 16)",
  )
  p.add_argument(
    "--enable-auto-tool-choice",
    action="store_true",
    help='tool_choice "auto": the model\'s own tool calls read back as tool_calls (needs '
    "--tool-call-parser)",
  )
  p.add_argument(
    "--tool-call-parser",
    choices=sorted(tool_parsers.PARSERS),
    help="the model's tool-call syntax: hermes (Qwen2.5, Qwen3), llama3_json, mistral, "
    'deepseek_v3 (tool_choice "required" and named functions are guided, with or without it)',
  )
  p.add_argument(
    "--reasoning-parser",
    choices=sorted(reasoning.PARSERS),
    help="return a thinking model's <think>...</think> as reasoning_content beside content",
  )
  p.add_argument(
    "--dtype",
    default="auto",
    choices=["auto", *DTYPES],
    help="parameter/compute dtype for Hugging Face folders; auto: the checkpoint's (float32 on a "
    "CPU in place of bfloat16 or float16, whose matmuls are slow there)",
  )
  p.add_argument(
    "--compilation-cache-dir",
    default=os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE),
    help="jax's persistent compilation cache: a later start-up reads the step programs compiled "
    f"here instead of compiling them again (default: ${COMPILATION_CACHE_ENV}, else "
    f"{DEFAULT_COMPILATION_CACHE}; off: no cache)",
  )
  p.add_argument(
    "--coordinator-address",
    help="multi-host: process 0's HOST:PORT, the same on every host (with --num-processes and "
    "--process-id; train.py's mesh.coordinator_address)",
  )
  p.add_argument("--num-processes", type=int, help="multi-host: processes in the group")
  p.add_argument(
    "--process-id",
    type=int,
    help="multi-host: this process's rank; 0 serves HTTP and schedules, the others run its steps",
  )
  p.add_argument(
    "--heartbeat-timeout",
    type=float,
    default=30.0,
    help="multi-host: seconds a process may be silent before the group stops (default 30)",
  )
  p.add_argument(
    "--log-level",
    default="info",
    choices=["debug", "info", "warning", "error", "critical"],
    help="start-up progress and one line per finished request at info",
  )
  args = p.parse_args(argv)
  args.typed = typed_flags(sys.argv[1:] if argv is None else argv)
  return args


class _StderrHandler(logging.StreamHandler):
  """Writes to whatever sys.stderr is when a record is emitted (a test may swap it)."""

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value):
    pass


def setup_logging(level: str) -> None:
  """`--log-level` for atlas_jax's loggers, one line per record on stderr. Other libraries log
  at warning and above, through the same handler: it replaces the plain stderr handler some of
  them install on import (orbax does), which would print each line twice."""
  root = logging.getLogger()
  if not any(isinstance(h, _StderrHandler) for h in root.handlers):
    for h in list(root.handlers):
      if type(h) is logging.StreamHandler:
        root.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
  logging.getLogger("atlas_jax").setLevel(level.upper())


def step_folder_error(path: Path) -> str | None:
  """The message for a train.py step folder (a numbered subfolder of a run), else None."""
  if path.name.isdigit() and checkpoint.is_checkpoint(path.parent):
    return (
      f"--checkpoint={path} is step {path.name} of the train.py run {path.parent}: pass the run "
      f"directory {path.parent} (it serves the newest intact step)"
    )
  return None


def resolve_dtype(requested: str, folder: str) -> str:
  """--dtype for a Hugging Face folder: as given, or the checkpoint's (auto)."""
  if requested != "auto":
    return requested
  import jax

  stored = model_files.checkpoint_dtype(folder)
  if stored not in DTYPES:
    if stored is not None:
      log.info("dtype: float32 (config.json's %r is not one of %s)", stored, ", ".join(DTYPES))
    return "float32"
  if stored != "float32" and jax.default_backend() == "cpu":
    log.info(
      "dtype: float32, not the checkpoint's %s: its matmuls are slow on a CPU "
      "(--dtype %s keeps it)",
      stored,
      stored,
    )
    return "float32"
  return stored


def load_any(
  path: str,
  dtype: str,
  *,
  fp8_weights: str = "keep",
  fp8_activations: str = "auto",
  gguf_weights: str = "keep",
):
  """(model, tokenizer) from a run directory, a Hugging Face folder (an FP8 one's weights as
  `hf.load`'s `fp8_weights` and `fp8_activations` say; "auto": None there) or a GGUF file (its
  Q8_0/Q4_0/Q6_K projections as `gguf_weights` says)."""
  folder = Path(path)
  if checkpoint.is_checkpoint(folder):
    model, _, _ = checkpoint.load_model(folder)  # a LoRA run's adapters merged
    # With the special tokens of the tokenizer files a fine-tune kept from its source.
    return model, run_tokenizer(folder, model.cfg.vocab_size)
  if (message := step_folder_error(folder)) is not None:
    raise ValueError(message)
  dtype = resolve_dtype(dtype, path)
  activations = None if fp8_activations == "auto" else fp8_activations
  model = hf.load(
    path,
    dtype=dtype,
    fp8_weights=fp8_weights,
    fp8_activations=activations,
    gguf_weights=gguf_weights,
  )
  return model, model_files.load_tokenizer(folder, model.cfg.vocab_size)


class BatchLine(RequestFields):
  """A line of --prompts: a prompt, and any of the completion API's sampling fields."""

  prompt: Text


def read_prompts(args) -> list[tuple[str, BatchLine | None]]:
  """(prompt, its line's fields, or None for a --prompt) in input order."""
  prompts: list[tuple[str, BatchLine | None]] = []
  where = [f"--prompt {i + 1}" for i in range(len(args.prompt))]
  for i, p in enumerate(args.prompt):
    try:
      prompts.append((encodable(p), None))
    except ValueError as e:
      raise ValueError(f"{where[i]}: {e}") from None
  ignored: set[str] = set()
  for i, record in iter_json_objects(Path(args.prompts)) if args.prompts else ():
    at = f"{Path(args.prompts).name}:{i}"
    if "prompt" not in record:
      raise ValueError(f"{at}: the object has no 'prompt' field (fields: {sorted(record)})")
    try:
      line = BatchLine.model_validate(record)
    except ValueError as e:  # pydantic's ValidationError
      raise ValueError(f"{at}: {describe_invalid(e.errors())[0]}") from None
    ignored |= set(line.model_extra or {})
    prompts.append((line.prompt, line))
  if ignored:
    log.warning("fields ignored in %s: %s", args.prompts, ", ".join(sorted(ignored)))
  if not prompts:
    raise ValueError("no prompts: pass --prompt TEXT or --prompts FILE.jsonl")
  return prompts


# serve.py's sampling flags and the API fields they stand for: one set of rules for both.
SAMPLING_FLAGS = {
  "max_new_tokens": ("--max-new-tokens", "max_tokens"),
  "temperature": ("--temperature", "temperature"),
  "top_k": ("--top-k", "top_k"),
  "top_p": ("--top-p", "top_p"),
  "min_p": ("--min-p", "min_p"),
  "repetition_penalty": ("--repetition-penalty", "repetition_penalty"),
  "seed": ("--seed", "seed"),
}
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {f"{u}i": 2 ** (10 * (i + 1)) for i, u in enumerate("kmgt")}


def memory_amount(text: str) -> float:
  """--kv-cache-memory: bytes (8e9, 8GB, 8GiB) or a fraction (0.9)."""
  raw = text.strip().lower().removesuffix("b")
  for unit, scale in sorted(_UNITS.items(), key=lambda u: -len(u[0])):
    if raw.endswith(unit):
      try:
        return float(raw[: -len(unit)]) * scale
      except ValueError:
        break
  try:
    return float(raw)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not bytes (8e9, 8GB, 8GiB) or a fraction (0.9)"
    ) from None


def on_off(text: str) -> bool:
  """A true/false flag value (true, false, on, off, yes, no, 1, 0)."""
  value = {"true": True, "on": True, "yes": True, "1": True}.get(text.strip().lower())
  if value is None and text.strip().lower() not in ("false", "off", "no", "0"):
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
  return bool(value)


# The flags standing for ServeConfig fields: (names, the first vLLM's where vLLM has one; type;
# what it sets). `--set serve.SECTION.FIELD=VALUE` reaches every field, these included.
CONFIG_FLAGS = {
  "engine.max_num_seqs": (("--max-num-seqs", "--max-batch"), int, "running requests at most"),
  "engine.n_blocks": (
    ("--num-blocks", "--num-gpu-blocks-override"),
    int,
    "pool blocks per data-parallel replica",
  ),
  "engine.block_size": (("--block-size",), int, "tokens per pool block"),
  "quantization": (
    ("--quantization", "-q"),
    str,
    "weights quantized after loading: int8 (per channel), int4 (per channel and input group) or "
    "fp8 (e4m3, per channel): the attention, MLP and expert projections, held so on the "
    "device and dequantized in the matmuls",
  ),
  "quantization_group_size": (("--quantization-group-size",), int, "int4's inputs per scale"),
  "quantize_lm_head": (("--quantize-lm-head",), on_off, "true: quantize the LM head too"),
  "engine.kv_cache_dtype": (
    ("--kv-cache-dtype",),
    str,
    "the pool's storage: auto (the model's dtype), int8 or fp8 (8-bit codes with a scale per "
    "token and kv head)",
  ),
  "engine.max_num_batched_tokens": (("--max-num-batched-tokens",), int, "per-step token budget"),
  "engine.prefill_chunk": (("--prefill-chunk",), int, "prompt tokens per request per step"),
  "engine.max_model_len": (("--max-model-len",), int, "context length (default: the model's)"),
  "engine.num_speculative_tokens": (
    ("--num-speculative-tokens",),
    int,
    "tokens the draft proposes per round (4; with --speculative mtp, the model's MTP depth)",
  ),
  "engine.speculative_max_batch": (
    ("--speculative-max-batch",),
    int,
    "the largest batch that speculates (larger ones decode plainly)",
  ),
  "engine.guided_speculative_max_batch": (
    ("--guided-speculative-max-batch",),
    int,
    "the same for a batch with a guided request",
  ),
  "engine.tensor_parallel_size": (
    ("--tensor-parallel-size", "-tp"),
    int,
    "devices per replica: heads, FFN and vocabulary split over them",
  ),
  "engine.data_parallel_size": (
    ("--data-parallel-size", "-dp"),
    int,
    "replicas, each with its own requests and pages of the pool",
  ),
  "engine.prefill_context_parallel_size": (
    ("--prefill-context-parallel-size", "-pcp"),
    int,
    "devices per replica splitting each step's tokens (a long prompt's chunks) between them",
  ),
  "engine.kv_cache_memory": (
    ("--kv-cache-memory",),
    memory_amount,
    "pool bytes per device (8GiB), or a fraction (0.9) of what weights and activations leave",
  ),
  "engine.gpu_memory_utilization": (
    ("--gpu-memory-utilization",),
    float,
    "the fraction of each device's memory for weights, activations and pool together",
  ),
  "engine.decode_burst": (
    ("--decode-burst",),
    int,
    "decode iterations per call when no request needs the host (1: no bursts)",
  ),
  "engine.offline_burst": (
    ("--offline-burst",),
    int,
    "decode iterations per call in batch mode, where every prompt is added before the first "
    "step and none can wait for a burst (at least --decode-burst)",
  ),
  "engine.disable_hybrid_kv_cache_manager": (
    ("--disable-hybrid-kv-cache-manager",),
    on_off,
    "a model mixing sliding-window and full-attention layers keeps every layer's blocks in one "
    "pool, the windowed layers' too, rather than their window's in a pool of their own",
  ),
  "engine.stream_bursts": (
    ("--stream-bursts",),
    on_off,
    "false: while a streamed request runs, no burst runs, so its tokens leave one by one as "
    "they are drawn (as vLLM streams); true: bursts run anyway, its tokens arriving "
    "--decode-burst at a time (still one event each), the host's work amortised",
  ),
  "engine.warmup": (
    ("--warmup",),
    str,
    "step shapes compiled ahead, one of each kind before the server answers and the rest on a "
    "background thread (a request that needs one before it is done compiles it): none; default "
    "(every shape the runner's steps, bursts and speculative rounds take); all (the CPU runner "
    "also compiles prefills over a context already in the pool: chunks past --prefill-chunk, "
    "prompts after a cached prefix)",
  ),
  "engine.runner": (
    ("--runner",),
    str,
    "the model runner: ragged (one ragged step per engine iteration over the ragged "
    "paged-attention kernels: the accelerator path, on any backend); cpu (its specialisation "
    "for XLA's CPU backend: weight layouts, segmented prompts, compiler options); auto (cpu on a "
    "CPU backend, ragged elsewhere)",
  ),
  "engine.cpu.weight_layout": (
    ("--weight-layout",),
    str,
    "the CPU runner: how one device holds the weights: stacked (as trained, the layer scan "
    "slicing each layer); one array per layer, in_major ([in, out], as trained) or out_major "
    "([out, in], as nn.Linear); auto (out_major where its GEMMs ran 5% faster, timed once per "
    "machine, else stacked for layers of up to 8 MiB, in_major above)",
  ),
  "engine.cpu.matmul": (
    ("--cpu-matmul",),
    str,
    "the CPU runner: whose dots the step programs use: ynnpack (XLA's default); xla (XLA's "
    "own); auto (XLA's own for the decode batch sizes where they ran faster, timed once per "
    "machine)",
  ),
  "engine.cpu.reductions": (
    ("--cpu-reductions",),
    str,
    "the CPU runner: whose reductions decode steps of up to 4 rows use on one device: xla "
    "(XLA's loops); ynnpack (YNNPACK's, 32 keys an attention iteration); auto (YNNPACK's at the "
    "batch sizes where the decode attention ran 1.1x faster so, timed once per machine)",
  ),
  "limits.max_prompt_tokens": (("--max-prompt-tokens",), int, "longest prompt allowed"),
  "limits.max_tokens": (("--max-tokens-limit",), int, "largest max_tokens allowed"),
  "limits.max_n": (("--max-n",), int, "largest n (choices per request) allowed"),
  "limits.max_body_bytes": (("--max-body-bytes",), int, "largest request body"),
  "limits.max_logprobs": (("--max-logprobs",), int, "largest logprobs / top_logprobs allowed"),
}


def flag_dest(path: str) -> str:
  """The argparse name of a config flag: its field, prefixed by a subsection (cpu_matmul); a
  field of `serve:` itself (quantization) by its name."""
  if path == "limits.max_tokens":
    return "max_tokens_limit"
  return "_".join(path.split(".")[1:]) or path


def config_default(config, path: str):
  """The default of a dotted field of a ServeConfig."""
  for name in path.split("."):
    config = getattr(config, name)
  return config


def typed_flags(argv) -> dict[str, str]:
  """{ServeConfig field: the flag name the command line used for it}, for the messages."""
  out = {}
  for path, (names, _, _) in CONFIG_FLAGS.items():
    for arg in argv:
      name = arg.split("=", 1)[0]
      if name in names:
        out[path] = name
  for name, (flag, _) in SAMPLING_FLAGS.items():
    if flag in (a.split("=", 1)[0] for a in argv):
      out[f"sampling.{name}"] = flag
  return out


def flagged(message: str, args) -> str:
  """A message naming ServeConfig fields, with each field given by a flag named by that flag."""
  for path, flag in getattr(args, "typed", {}).items():
    message = message.replace(f"serve.{path}", flag)
  return message


def run_serve_section(args) -> dict:
  """The run's `serve:` section as a dict (a train.py run directory knows how its model samples
  best), else {} (ServeConfig's defaults)."""
  if checkpoint.is_checkpoint(args.checkpoint):
    return dataclasses.asdict(load_config(Path(args.checkpoint) / "config.yaml").serve)
  return {}


def set_overrides(args) -> dict:
  """--set serve.SECTION.FIELD=VALUE overrides as a nested {section: {field: value}}."""
  for item in args.set:
    if not item.strip().startswith("serve."):
      raise ConfigError(
        f"--set {item} is not allowed: serve.py takes serve.SECTION.FIELD=VALUE (sections: "
        "engine, limits, sampling)"
      )
  return apply_overrides({}, args.set).get("serve", {})


def serve_config(args) -> ServeConfig:
  """One ServeConfig from the run's serve section, --set and the flags (later wins), its
  sampling section as `fill_defaults` resolved it; checked by ServeConfig's own rules."""
  data = run_serve_section(args)
  for section, fields in set_overrides(args).items():
    if isinstance(fields, dict) and isinstance(data.get(section, {}), dict):
      data[section] = {**data.get(section, {}), **fields}
    else:
      data[section] = fields
  for path in CONFIG_FLAGS:
    value = getattr(args, flag_dest(path))
    if value is not None:
      *sections, field = path.split(".")
      node = data
      for section in sections:
        node = node.setdefault(section, {})
      node[field] = value
  data["sampling"] = {name: getattr(args, name) for name in SAMPLING_FLAGS}
  holder = {"serve": data}
  migrate_serve(holder)  # the CPU runner's fields under their old engine names
  return build(ServeConfig, holder["serve"], prefix="serve")


def fill_defaults(args) -> None:
  """Sampling flags not given come from --set serve.sampling, else generation_config.json (with
  --generation-config auto, a Hugging Face folder's), else from the run's `serve.sampling`
  section, else from its defaults. `args.sources` names where each value came from, for the
  messages."""
  run = run_serve_section(args).get("sampling", {})
  given = set_overrides(args).get("sampling", {})
  generation = {}
  if args.generation_config != "vllm":
    folder = args.checkpoint if args.generation_config == "auto" else args.generation_config
    if args.generation_config != "auto" and not Path(folder).is_dir():
      raise ValueError(
        f"--generation-config={folder!r} is not allowed: must be auto, vllm or a folder"
      )
    generation, where = model_files.generation_defaults(folder)
  fallback = {**dataclasses.asdict(SamplingDefaults()), **run}
  args.sources = {}
  for name, (flag, api_name) in SAMPLING_FLAGS.items():
    if getattr(args, name) is not None:
      args.sources[name] = flag
    elif name in given:
      setattr(args, name, given[name])
      args.sources[name] = f"--set serve.sampling.{name}"
    elif api_name in generation:
      setattr(args, name, generation[api_name])
      args.sources[name] = f"{where} {name}"  # generation_config.json's field of that name
    else:
      setattr(args, name, fallback[name])
      args.sources[name] = flag


def check_args(args) -> ServeConfig:
  """Every flag checked before anything is loaded; errors name the flag (or --set field), the
  value and what is allowed (the sampling flags with the HTTP API's own rules and messages).
  Returns the ServeConfig they make."""
  for name, (flag, api_name) in SAMPLING_FLAGS.items():
    try:
      check_sampling_fields(**{api_name: getattr(args, name)})
    except ValueError as e:
      raise ValueError(f"{args.sources.get(name, flag)}={getattr(args, name)}: {e}") from None
  config = serve_config(args)
  e = config.engine
  placement.check_devices(
    e.data_parallel_size, e.tensor_parallel_size, context=e.prefill_context_parallel_size
  )
  if args.port is not None and not 1 <= args.port <= 65535:
    raise ValueError(f"--port={args.port} is not allowed: must be in [1, 65535]")
  if args.enable_auto_tool_choice and args.tool_call_parser is None:
    raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
  if args.output is not None:
    out = Path(args.output)
    if out.is_dir():
      raise ValueError(f"--output={args.output} is a folder; give a file path")
    if not out.absolute().parent.is_dir():
      raise ValueError(f"--output={args.output}: the folder {out.absolute().parent} does not exist")
  return config


def sampling_params(args) -> SamplingParams:
  return sampling_defaults(serve_config(args).sampling)


SPECULATIVE_METHODS = ("ngram", "mtp", "deepseek_mtp", "draft_model")


def speculative_config(text: str) -> tuple[object, str | None, int | None]:
  """--speculative-config (vLLM's JSON): (the draft: "mtp", an `NGramDrafter` or None for a
  draft model; the draft model's path or None; num_speculative_tokens or None)."""
  flag = "--speculative-config"
  try:
    spec = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{flag}={text!r} is not JSON: {e}") from None
  if not isinstance(spec, dict):
    raise ValueError(f"{flag}={text!r} is not allowed: expected a JSON object")
  method = spec.get("method")
  if method not in SPECULATIVE_METHODS:
    raise ValueError(
      f"{flag}: method={method!r} is not allowed: expected one of {SPECULATIVE_METHODS}"
    )
  known = {"method", "num_speculative_tokens"} | {
    "ngram": {"prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"model"},
  }.get(method, set())
  if set(spec) - known:
    raise ValueError(
      f"{flag}: {sorted(set(spec) - known)} not allowed with method={method!r}: expected "
      f"{sorted(known)}"
    )
  k = spec.get("num_speculative_tokens")
  path = None
  if method == "ngram":
    # As vLLM: 5 and 5 when neither is given, else the one given for the other.
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lo is None and hi is None:
      lo = hi = 5
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    try:
      draft = NGramDrafter(prompt_lookup_min=lo, prompt_lookup_max=hi)
    except ValueError as e:
      raise ValueError(f"{flag}: {e}") from None
  elif method == "draft_model":
    draft, path = None, spec.get("model")
    if not isinstance(path, str):
      raise ValueError(f"{flag}: method='draft_model' needs \"model\": the draft's path")
  else:
    draft = "mtp"
  return draft, path, k


def make_engine(args, model, tokenizer) -> Engine:
  given = [f for f, v in (("--draft", args.draft), ("--speculative", args.speculative)) if v]
  if args.speculative_config is not None:
    given.append("--speculative-config")
  if len(given) > 1:
    raise ValueError(f"{' and '.join(given)} are two drafts: give one")
  draft, path = args.speculative, args.draft
  serve = serve_config(args)
  config = serve.engine
  if serve.quantization is not None:
    names = quant.quantize_model(
      model,
      serve.quantization,
      group_size=serve.quantization_group_size,
      lm_head=serve.quantize_lm_head,
    )
    log.info("weights: %d projection stacks quantized to %s", len(names), serve.quantization)
  if args.speculative_config is not None:
    draft, path, k = speculative_config(args.speculative_config)
    if k is not None:
      given = config.num_speculative_tokens
      if given is not None and given != k:
        raise ValueError(
          f"--speculative-config num_speculative_tokens={k} != --num-speculative-tokens={given}"
        )
      config = dataclasses.replace(config, num_speculative_tokens=k)
  if path is not None:
    draft = load_draft(path, args.dtype, tokenizer)
  adapters = served_adapters(args, model)
  if multihost.processes() > 1:
    config = multihost.engine_config(config, lora=adapters is not None)
  engine = Engine(
    model,
    config,
    eos_id=tokenizer.eos_ids,
    detokenize=tokenizer.decode,
    draft=draft,
    adapters=adapters,
  )
  for spec in args.lora_modules or []:
    name, _, folder = spec.partition("=")
    engine.load_adapter(name, folder)
  return engine


def served_adapters(args, model) -> ServedAdapters | None:
  """--enable-lora: the model's adapter slots (--max-loras of rank --max-lora-rank), or None."""
  for spec in args.lora_modules or []:
    name, sep, folder = spec.partition("=")
    if not (name and sep and folder):
      raise ValueError(f"--lora-modules {spec!r} is not allowed: NAME=PATH (a PEFT folder)")
  if not args.enable_lora:
    if args.lora_modules:
      raise ValueError("--lora-modules needs --enable-lora")
    return None
  return ServedAdapters(model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def load_draft(path: str, dtype: str, tokenizer):
  """The --draft model; its tokenizer must be the model's (one vocabulary, the same ids)."""
  draft, draft_tokenizer = load_any(path, dtype)
  if draft_tokenizer.fingerprint() != tokenizer.fingerprint():
    raise ValueError(
      f"--draft={path}: its tokenizer differs from the model's (speculation needs the same ids)"
    )
  return draft


def run_batch(args, engine: Engine, tokenizer, prompts, params: SamplingParams) -> int:
  try:
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
  except OSError as e:
    print(f"error: --output={args.output}: {e.strerror}", file=sys.stderr)
    return 2
  results: dict[int, list[int]] = {}
  texts: dict[int, str] = {}
  reasons: dict[int, str | None] = {}
  errors: dict[int, str] = {}
  try:
    for i, (prompt, line) in enumerate(prompts):
      ids = tokenizer.encode(prompt, add_special_tokens=True) or [tokenizer.bos_id]
      try:
        p = params
        if line is not None:  # the line's own fields over the flags'
          max_tokens = line.max_tokens or line.max_completion_tokens or params.max_new_tokens
          seed = params.seed if line.seed is None else line.seed
          p = request_params(line, params, max_tokens=max_tokens, seed=seed)
        engine.add_request(i, ids, p)
      except (RequestError, ValueError) as e:
        print(f"error: prompt {i + 1}: {e}", file=sys.stderr)
        return 2
      results[i], texts[i] = [], ""
    bar = None
    if not args.no_progress and sys.stderr.isatty():
      from tqdm import tqdm

      bar = tqdm(total=len(prompts), unit="req", file=sys.stderr)
    next_out = 0
    done: set[int] = set()
    engine.offline = True  # every prompt is in: bursts run --offline-burst iterations
    while engine.has_unfinished():
      for o in engine.step():
        results[o.request_id] += o.new_token_ids
        texts[o.request_id] += o.text
        if o.error:
          errors[o.request_id] = o.error
          print(f"error: prompt {o.request_id + 1}: {o.error}", file=sys.stderr)
        if o.finished:
          reasons[o.request_id] = o.finish_reason
          done.add(o.request_id)
          if bar is not None:
            bar.update(1)
      # Write completions in input order as soon as every earlier one is done.
      while next_out in done:
        record = {
          "prompt": prompts[next_out][0],
          "completion": texts[next_out],
          "completion_tokens": len(results[next_out]),
          "finish_reason": reasons[next_out],
        }
        if next_out in errors:
          record["error"] = errors[next_out]
        out.write(json.dumps(record) + "\n")
        out.flush()
        next_out += 1
    if bar is not None:
      bar.close()
  finally:
    if out is not sys.stdout:
      out.close()
  return 1 if errors else 0


def build_server(args, engine: Engine, tokenizer, chat_template):
  """(the app, its EngineRunner) for --port: the engine behind the OpenAI-compatible API."""
  from atlas_jax.decoding.guided import GrammarCompiler

  runner = EngineRunner(engine)
  # response_format / guided_json / guided_regex / guided_choice, over the model's tokenizer
  try:
    guided = GrammarCompiler(tokenizer, vocab_size=engine.model_config.vocab_size)
  except ValueError as e:  # e.g. a tokenizer without an eos token: serve, without guided decoding
    guided = None
    log.warning("guided decoding is off: %s", e)
  app = build_app(
    runner,
    tokenizer=tokenizer,
    model_name=args.model_name or [Path(args.checkpoint).name],
    chat_template=chat_template,
    limits=serve_config(args).limits,
    api_key=args.api_key,
    guided=guided,
    default_params=sampling_params(args),
    tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    reasoning_parser=args.reasoning_parser,
  )
  return app, runner


def warmup(engine: Engine) -> None:
  """Compiles the first step shapes of the engine's warm-up level (one of each kind: what the
  first requests run) before returning, the rest on a background thread; a progress line each."""
  shapes, deferred = engine.warmup_shapes()
  start = time.perf_counter()
  first = len({shape.kind for shape in shapes})  # `warmup_shapes` lists one of each first
  progress = lambda i, n, shape: log.info("compiled step shape %d/%d: %s", i, n, shape)
  thread = engine.warmup(progress, first=first)
  log.info(
    "warmup=%s: compiled %d of %d step shapes in %.1f s%s; compiled on first use: %s",
    engine.config.warmup,
    first,
    len(shapes),
    time.perf_counter() - start,
    ", the rest compiling in the background" if thread is not None else "",
    "; ".join(deferred),
  )


def run_server(args, engine: Engine, tokenizer, chat_template) -> int:
  import uvicorn

  app, runner = build_server(args, engine, tokenizer, chat_template)
  warmup(engine)
  names = args.model_name or [Path(args.checkpoint).name]
  log.info("serving %s on http://%s:%d", ", ".join(names), args.host, args.port)
  try:
    # uvicorn's own lines through the same handler; its access log is the per-request line's
    uvicorn.run(
      app,
      host=args.host,
      port=args.port,
      log_level=args.log_level,
      access_log=False,
      log_config=None,
    )
  finally:
    runner.shutdown()
  return 0


def describe(args, model, tokenizer, engine: Engine) -> None:
  """The start-up summary: what is served, how it stops, how it samples."""
  cfg = model.cfg
  log.info(
    "%s: %d layers, d_model %d, vocabulary %d, %s, context %d tokens",
    args.checkpoint,
    cfg.n_layers,
    cfg.d_model,
    cfg.vocab_size,
    cfg.dtype,
    engine.max_model_len,
  )
  named = lambda ids: ", ".join(
    f"{i} {tokenizer.decode([i], skip_special_tokens=False)!r}" for i in ids
  )
  eos, bos = named(tokenizer.eos_ids), named(tokenizer.encode("", add_special_tokens=True))
  log.info("stops on eos %s; prompts start with %s", eos or "none", bos or "no BOS")
  given = lambda name: args.sources[name].startswith("--")  # a flag, or its default
  log.info(
    "sampling defaults: %s",
    ", ".join(
      f"{name}={getattr(args, name)}" + ("" if given(name) else f" ({args.sources[name]})")
      for name in SAMPLING_FLAGS
    ),
  )


def compilation_cache(path: str) -> str | None:
  """Turns on jax's persistent compilation cache in `path` (~ expanded; "off": none), for every
  program however fast it compiled: a second start-up then loads its warm-up shapes (measured on
  the CPU backend: 22 shapes in 48 s, then 4 s). Returns the folder, or None."""
  if path.strip().lower() == "off":
    return None
  import jax

  folder = Path(path).expanduser()
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--compilation-cache-dir={path}: {e.strerror or e}") from None
  jax.config.update("jax_compilation_cache_dir", str(folder))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return str(folder)


def prepare(args):
  """(engine, tokenizer, chat template or None, batch prompts) for parsed flags: the flags
  filled in and checked, the model loaded. ValueError or OSError on bad input."""
  fill_defaults(args)
  config = check_args(args).engine
  cache = compilation_cache(args.compilation_cache_dir)
  prompts = read_prompts(args) if args.port is None else []
  devices = config.tensor_parallel_size * config.data_parallel_size
  import jax

  # Across devices, host memory first: the runner places each device's shard, never a whole
  # copy on one.
  place = (
    jax.default_device(jax.local_devices(backend="cpu")[0])
    if devices * config.prefill_context_parallel_size > 1
    else contextlib.nullcontext()
  )
  with place:
    model, tokenizer = load_any(
      args.checkpoint,
      args.dtype,
      fp8_weights=args.fp8_weights,
      fp8_activations=args.fp8_activations,
      gguf_weights=args.gguf_weights,
    )
  # Loading reads every tensor through host buffers freed once the model holds its arrays, and
  # making the engine frees the copies its placement replaced: glibc keeps such freed memory in
  # its arenas, resident, unless handed back (about the weights' size again after a load).
  host_memory.return_freed_memory()
  engine = make_engine(args, model, tokenizer)
  if cache is not None:
    # Loading and sizing the pool ran programs that never run again: a conversion per tensor
    # shape, the largest step compiled for its memory figure. jax keeps each one's executable
    # for the life of the process (a few MB each on a CPU, about 90 MB after loading the
    # 135M-parameter, 30-layer shape); dropped here, a program needed again loads from the
    # persistent cache.
    jax.clear_caches()
  host_memory.return_freed_memory()
  log.info("compilation cache: %s", cache or "off")  # after loading: a bad folder is one line
  chat_template = None
  if args.port is not None:
    chat_template = model_files.chat_template(args.checkpoint, tokenizer, args.chat_template)
  describe(args, model, tokenizer, engine)
  return engine, tokenizer, chat_template, prompts


# train.py's names for the multi-host flags, taken by --set too.
MESH_FIELDS = {"coordinator_address": str, "num_processes": int, "process_id": int}


def distributed(args) -> multihost.Distributed:
  """The multi-host flags (or train.py's --set mesh.FIELD=VALUE for them; the flags win),
  checked. The mesh items leave `args.set`, which holds serve.* fields only."""
  rest = []
  for item in args.set:
    key, sep, value = item.strip().partition("=")
    field = key.removeprefix("mesh.")
    if not (key.startswith("mesh.") and sep and field in MESH_FIELDS):
      rest.append(item)
      continue
    try:
      value = MESH_FIELDS[field](value)
    except ValueError:
      raise ConfigError(f"--set {item} is not allowed: {field} is an integer") from None
    if getattr(args, field) is None:
      setattr(args, field, value)
  args.set = rest
  return multihost.Distributed(
    args.coordinator_address, args.num_processes, args.process_id, args.heartbeat_timeout
  )


def main(argv=None) -> int:
  args = parse_args(argv)
  setup_logging(args.log_level)
  try:
    group = distributed(args)
    liveness = multihost.initialize(group)
    engine, tokenizer, chat_template, prompts = prepare(args)
    mirror = multihost.start(engine, liveness)
  except (ValueError, OSError) as e:
    print(f"error: {flagged(str(e), args)}", file=sys.stderr)
    return 2
  if not group.leader:
    mirror.follow()
    multihost.leave()
  try:
    if args.port is not None:
      return run_server(args, engine, tokenizer, chat_template)
    return run_batch(args, engine, tokenizer, prompts, sampling_params(args))
  finally:
    if mirror is not None:
      mirror.stop()


if __name__ == "__main__":
  sys.exit(main())
