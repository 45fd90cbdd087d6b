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
from atlas_jax.config import ServeConfig
from atlas_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError
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
  p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
  p.add_argument("--temperature", type=float, default=d.temperature)
  p.add_argument("--top-k", type=int, default=d.top_k)
  p.add_argument("--top-p", type=float, default=d.top_p)
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--max-batch", type=int, default=d.max_batch, help="running requests at most")
  p.add_argument("--num-blocks", type=int, help="KV pool blocks (default: max-batch full contexts)")
  p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
  p.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
  p.add_argument(
    "--prefill-chunk", type=int, default=256, help="prompt tokens per request per step"
  )
  p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
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
  prompts = list(args.prompt)
  if args.prompts:
    with open(args.prompts, encoding="utf-8") as f:
      for i, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{args.prompts}:{i}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
          raise ValueError(f"{args.prompts}:{i}: expected an object with a string 'prompt' field")
        prompts.append(record["prompt"])
  if not prompts:
    raise ValueError("no prompts: pass --prompt TEXT or --prompts FILE.jsonl")
  return prompts


def chat_template_of(path: str):
  """The folder's chat template (tokenizer_config.json or chat_template.jinja), else None."""
  from atlas_jax.serving.server import jinja_chat_template

  folder = Path(path)
  settings = {}
  if (folder / "tokenizer_config.json").is_file():
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
  template = settings.get("chat_template")
  if template is None and (folder / "chat_template.jinja").is_file():
    template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
  if not isinstance(template, str):
    return None
  # Special tokens are strings, or {"content": ...} objects, in tokenizer_config.json.
  token = lambda t: (t.get("content", "") if isinstance(t, dict) else t) or ""
  return jinja_chat_template(
    template,
    bos_token=token(settings.get("bos_token")),
    eos_token=token(settings.get("eos_token")),
  )


def make_engine(args, model, tokenizer) -> Engine:
  max_len = args.max_model_len or model.cfg.max_seq_len
  n_blocks = args.num_blocks or args.max_batch * -(-max_len // args.block_size)
  config = EngineConfig(
    n_blocks=n_blocks,
    block_size=args.block_size,
    max_num_seqs=args.max_batch,
    max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_batch),
    prefill_chunk=args.prefill_chunk,
    max_model_len=max_len,
  )
  return Engine(model, config, eos_id=tokenizer.eos_id, detokenize=tokenizer.decode)


def run_batch(args, engine: Engine, tokenizer, prompts: list[str], params: SamplingParams) -> int:
  out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
  results: dict[int, list[int]] = {}
  texts: dict[int, str] = {}
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
        out.write(json.dumps(record) + "\n")
        out.flush()
        next_out += 1
    if bar is not None:
      bar.close()
  finally:
    if out is not sys.stdout:
      out.close()
  return 0


def run_server(args, engine: Engine, tokenizer) -> int:
  import uvicorn

  from atlas_jax.decoding.guided import GrammarCompiler
  from atlas_jax.serving.server import EngineRunner, ServerLimits, build_app

  runner = EngineRunner(engine)
  # response_format / guided_json / guided_regex / guided_choice, over the model's tokenizer
  guided = GrammarCompiler(tokenizer, vocab_size=engine.model_config.vocab_size)
  app = build_app(
    runner,
    encode=lambda text: tokenizer.encode(text) or [tokenizer.bos_id],
    decode=tokenizer.decode,
    model_name=args.model_name or Path(args.checkpoint).name,
    chat_template=chat_template_of(args.checkpoint),
    limits=ServerLimits(
      max_prompt_tokens=args.max_prompt_tokens,
      max_tokens=args.max_tokens_limit,
      max_n=args.max_n,
      max_body_bytes=args.max_body_bytes,
      default_max_tokens=args.max_new_tokens,
    ),
    api_key=args.api_key,
    guided=guided,
    default_params=SamplingParams(
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seed=args.seed,
    ),
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
    ServeConfig(
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      max_batch=args.max_batch,
      seed=args.seed,
    )
    prompts = read_prompts(args) if args.port is None else []
    model, tokenizer = load_any(args.checkpoint, args.dtype)
    engine = make_engine(args, model, tokenizer)
    params = SamplingParams(
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seed=args.seed,
    )
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.port is not None:
    return run_server(args, engine, tokenizer)
  return run_batch(args, engine, tokenizer, prompts, params)


if __name__ == "__main__":
  sys.exit(main())
