"""Generate completions from a trained checkpoint or a Hugging Face folder.

    python serve.py --checkpoint checkpoints/tiny --prompt "def " --prompt "import "
    python serve.py --checkpoint path/to/hf_folder --prompts prompts.jsonl --output out.jsonl
    python serve.py --checkpoint path/to/hf_folder --port 8000 [--host 127.0.0.1] [--api-key KEY]

Batch mode reads prompts (repeated --prompt, or a JSONL file with a "prompt" field per line) and
writes one JSON object per prompt: {"prompt", "completion", "completion_tokens"}, in input order.
With --port it serves the OpenAI API instead (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics). Both run the continuous-batching engine over a paged KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atlas_jax import hf
from atlas_jax.config import ServeConfig, load_config
from atlas_jax.data.corpus import iter_jsonl
from atlas_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError
from atlas_jax.serving.server import (
  EngineRunner,
  ServerLimits,
  build_app,
  check_sampling_fields,
  encodable,
  jinja_chat_template,
)
from atlas_jax.training import checkpoint


def parse_args(argv=None) -> argparse.Namespace:
  d = ServeConfig()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument(
    "--checkpoint",
    required=True,
    help="a train.py run directory, or a Hugging Face folder (config.json + safetensors)",
  )
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--prompts", help='JSONL file, one {"prompt": ...} per line')
  p.add_argument("--output", help="write JSONL here instead of stdout")
  # Defaults: the run's `serve:` config section for a train.py run directory, else these.
  default = lambda name: f"default: the run's serve.{name}, else {getattr(d, name)}"
  p.add_argument("--max-new-tokens", type=int, help=default("max_new_tokens"))
  p.add_argument("--temperature", type=float, help=default("temperature") + " (greedy)")
  p.add_argument("--top-k", type=int, help=default("top_k") + " (off)")
  p.add_argument("--top-p", type=float, help=default("top_p"))
  p.add_argument("--seed", type=int, help=default("seed"))
  p.add_argument("--max-batch", type=int, help="running requests at most; " + default("max_batch"))
  p.add_argument("--num-blocks", type=int, help="KV pool blocks (default: max-batch full contexts)")
  p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
  p.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
  p.add_argument(
    "--prefill-chunk", type=int, default=256, help="prompt tokens per request per step"
  )
  p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
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
    "--num-speculative-tokens", type=int, default=4, help="tokens the draft proposes per round"
  )
  p.add_argument(
    "--speculative-max-batch",
    type=int,
    default=8,
    help="the largest batch that speculates (larger ones decode plainly)",
  )
  p.add_argument(
    "--guided-speculative-max-batch",
    type=int,
    default=4,
    help="the same for a batch with a guided request",
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar in batch mode")
  p.add_argument("--port", type=int, help="serve the OpenAI-compatible HTTP API on this port")
  p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
  p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ endpoints")
  p.add_argument("--model-name", help="the model id reported by the API (default: the folder)")
  p.add_argument("--max-prompt-tokens", type=int, default=4096)
  p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens allowed")
  p.add_argument("--max-n", type=int, default=4, help="largest n (choices per request) allowed")
  p.add_argument("--max-body-bytes", type=int, default=1 << 20)
  p.add_argument(
    "--dtype",
    default="float32",
    choices=["float32", "bfloat16", "float16"],
    help="parameter/compute dtype for Hugging Face folders",
  )
  return p.parse_args(argv)


def load_any(path: str, dtype: str):
  """(model, tokenizer) from a run directory or a Hugging Face folder."""
  if checkpoint.is_checkpoint(path):
    model, _, tokenizer = checkpoint.load_model(path)
    return model, tokenizer
  model = hf.load(path, dtype=dtype)
  if (Path(path) / "tokenizer.json").is_file():
    return model, HFTokenizer(hf.load_tokenizer(path))
  if model.cfg.vocab_size != ByteTokenizer.vocab_size:
    raise ValueError(f"{path}: no tokenizer.json beside the weights")
  return model, ByteTokenizer()


def read_prompts(args) -> list[str]:
  prompts = [(f"--prompt {i + 1}", p) for i, p in enumerate(args.prompt)]
  if args.prompts:
    prompts += iter_jsonl(Path(args.prompts), field="prompt")
  if not prompts:
    raise ValueError("no prompts: pass --prompt TEXT or --prompts FILE.jsonl")
  for where, prompt in prompts:
    try:
      encodable(prompt)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
  return [p for _, p in prompts]


# serve.py's sampling flags and the API fields they stand for: one set of rules for both.
SAMPLING_FLAGS = {
  "max_new_tokens": ("--max-new-tokens", "max_tokens"),
  "temperature": ("--temperature", "temperature"),
  "top_k": ("--top-k", "top_k"),
  "top_p": ("--top-p", "top_p"),
  "seed": ("--seed", "seed"),
}
# Engine and server flags: each a positive integer (None where the flag has a default of none).
POSITIVE_FLAGS = (
  "max_batch",
  "num_blocks",
  "block_size",
  "max_num_batched_tokens",
  "prefill_chunk",
  "max_model_len",
  "num_speculative_tokens",
  "speculative_max_batch",
  "guided_speculative_max_batch",
  "max_prompt_tokens",
  "max_tokens_limit",
  "max_n",
  "max_body_bytes",
)


def fill_defaults(args) -> None:
  """Sampling flags not given come from the run's `serve:` section (a train.py run directory
  knows how its model samples best), else from ServeConfig's defaults."""
  d = ServeConfig()
  if checkpoint.is_checkpoint(args.checkpoint):
    d = load_config(Path(args.checkpoint) / "config.yaml").serve
  for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "max_batch"):
    if getattr(args, name) is None:
      setattr(args, name, getattr(d, name))


def check_args(args) -> None:
  """Every flag checked before anything is loaded; errors name the flag, the value and what is
  allowed (the sampling flags with the HTTP API's own rules and messages)."""
  for name, (flag, api_name) in SAMPLING_FLAGS.items():
    try:
      check_sampling_fields(**{api_name: getattr(args, name)})
    except ValueError as e:
      raise ValueError(f"{flag}={getattr(args, name)}: {e}") from None
  for name in POSITIVE_FLAGS:
    value = getattr(args, name)
    if value is not None and value < 1:
      flag = "--" + name.replace("_", "-")
      raise ValueError(f"{flag}={value} is not allowed: must be a positive integer")
  if args.prefill_chunk & (args.prefill_chunk - 1):
    raise ValueError(f"--prefill-chunk={args.prefill_chunk} is not allowed: must be a power of two")
  if args.port is not None and not 1 <= args.port <= 65535:
    raise ValueError(f"--port={args.port} is not allowed: must be in [1, 65535]")
  if args.output is not None:
    out = Path(args.output)
    if out.is_dir():
      raise ValueError(f"--output={args.output} is a folder; give a file path")
    if not out.absolute().parent.is_dir():
      raise ValueError(f"--output={args.output}: the folder {out.absolute().parent} does not exist")


def chat_template_of(path: str):
  """The folder's chat template (tokenizer_config.json or chat_template.jinja), else None."""
  folder = Path(path)
  settings = {}
  config_file = folder / "tokenizer_config.json"
  if config_file.is_file():
    try:
      settings = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(settings, dict):
      raise ValueError(f"{config_file}: expected a JSON object")
  source = f"{config_file} chat_template"
  template = settings.get("chat_template")
  if template is None and (folder / "chat_template.jinja").is_file():
    source = str(folder / "chat_template.jinja")
    template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
  if not isinstance(template, str):
    return None
  # Special tokens are strings, or {"content": ...} objects, in tokenizer_config.json.
  token = lambda t: (t.get("content", "") if isinstance(t, dict) else t) or ""
  try:
    return jinja_chat_template(
      template,
      bos_token=token(settings.get("bos_token")),
      eos_token=token(settings.get("eos_token")),
    )
  except Exception as e:  # jinja2's TemplateSyntaxError and the like
    raise ValueError(f"{source}: not a valid Jinja template ({e})") from None


def sampling_params(args) -> SamplingParams:
  return SamplingParams(
    max_new_tokens=args.max_new_tokens,
    temperature=args.temperature,
    top_k=max(0, args.top_k),  # -1 is off, as in the API
    top_p=args.top_p,
    seed=args.seed,
  )


def make_engine(args, model, tokenizer) -> Engine:
  max_len = args.max_model_len or model.cfg.max_seq_len
  if max_len > model.cfg.max_seq_len:
    raise ValueError(
      f"--max-model-len={max_len} is not allowed: the model's context is "
      f"{model.cfg.max_seq_len} tokens"
    )
  n_blocks = args.num_blocks or args.max_batch * -(-max_len // args.block_size)
  config = EngineConfig(
    n_blocks=n_blocks,
    block_size=args.block_size,
    max_num_seqs=args.max_batch,
    max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_batch),
    prefill_chunk=args.prefill_chunk,
    max_model_len=max_len,
    num_speculative_tokens=args.num_speculative_tokens,
    speculative_max_batch=args.speculative_max_batch,
    guided_speculative_max_batch=args.guided_speculative_max_batch,
  )
  if args.draft is not None and args.speculative is not None:
    raise ValueError("--draft and --speculative mtp are two drafts: give one")
  draft = args.speculative
  if args.draft is not None:
    draft = load_draft(args.draft, args.dtype, tokenizer)
  return Engine(model, config, eos_id=tokenizer.eos_id, detokenize=tokenizer.decode, draft=draft)


def load_draft(path: str, dtype: str, tokenizer):
  """The --draft model; its tokenizer must be the model's (one vocabulary, the same ids)."""
  draft, draft_tokenizer = load_any(path, dtype)
  if draft_tokenizer.fingerprint() != tokenizer.fingerprint():
    raise ValueError(
      f"--draft={path}: its tokenizer differs from the model's (speculation needs the same ids)"
    )
  return draft


def run_batch(args, engine: Engine, tokenizer, prompts: list[str], params: SamplingParams) -> int:
  try:
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
  except OSError as e:
    print(f"error: --output={args.output}: {e.strerror}", file=sys.stderr)
    return 2
  results: dict[int, list[int]] = {}
  texts: dict[int, str] = {}
  errors: dict[int, str] = {}
  try:
    for i, prompt in enumerate(prompts):
      try:
        engine.add_request(i, tokenizer.encode(prompt) or [tokenizer.bos_id], params)
      except RequestError as e:
        print(f"error: prompt {i + 1}: {e}", file=sys.stderr)
        return 2
      results[i], texts[i] = [], ""
    bar = None
    if not args.no_progress and sys.stderr.isatty():
      from tqdm import tqdm

      bar = tqdm(total=len(prompts), unit="req", file=sys.stderr)
    next_out = 0
    done: set[int] = set()
    while engine.has_unfinished():
      for o in engine.step():
        results[o.request_id] += o.new_token_ids
        if o.error:
          errors[o.request_id] = o.error
          print(f"error: prompt {o.request_id + 1}: {o.error}", file=sys.stderr)
        if o.finished:
          done.add(o.request_id)
          if bar is not None:
            bar.update(1)
      # Write completions in input order as soon as every earlier one is done.
      while next_out in done:
        ids = results[next_out]
        record = {
          "prompt": prompts[next_out],
          "completion": tokenizer.decode(ids),
          "completion_tokens": len(ids),
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


def run_server(args, engine: Engine, tokenizer, chat_template) -> int:
  import uvicorn

  from atlas_jax.decoding.guided import GrammarCompiler

  runner = EngineRunner(engine)
  # response_format / guided_json / guided_regex / guided_choice, over the model's tokenizer
  try:
    guided = GrammarCompiler(tokenizer, vocab_size=engine.model_config.vocab_size)
  except ValueError as e:  # e.g. a tokenizer without an eos token: serve, without guided decoding
    guided = None
    print(f"guided decoding is off: {e}", file=sys.stderr)
  app = build_app(
    runner,
    encode=lambda text: tokenizer.encode(text) or [tokenizer.bos_id],
    decode=tokenizer.decode,
    model_name=args.model_name or Path(args.checkpoint).name,
    chat_template=chat_template,
    limits=ServerLimits(
      max_prompt_tokens=args.max_prompt_tokens,
      max_tokens=args.max_tokens_limit,
      max_n=args.max_n,
      max_body_bytes=args.max_body_bytes,
      default_max_tokens=args.max_new_tokens,
    ),
    api_key=args.api_key,
    guided=guided,
    default_params=sampling_params(args),
  )
  print(f"serving on http://{args.host}:{args.port}", file=sys.stderr)
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
  finally:
    runner.shutdown()
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    fill_defaults(args)
    check_args(args)
    prompts = read_prompts(args) if args.port is None else []
    model, tokenizer = load_any(args.checkpoint, args.dtype)
    engine = make_engine(args, model, tokenizer)
    params = sampling_params(args)
    chat_template = chat_template_of(args.checkpoint) if args.port is not None else None
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.port is not None:
    return run_server(args, engine, tokenizer, chat_template)
  return run_batch(args, engine, tokenizer, prompts, params)


if __name__ == "__main__":
  sys.exit(main())
