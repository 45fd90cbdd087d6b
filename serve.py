"""Generate completions from a trained checkpoint or a Hugging Face folder.

    python serve.py --checkpoint checkpoints/tiny --prompt "def " --prompt "import "
    python serve.py --checkpoint path/to/hf_folder --prompts prompts.jsonl --output out.jsonl

Batch mode reads prompts (repeated --prompt, or a JSONL file with a "prompt" field per line) and
writes one JSON object per prompt: {"prompt", "completion", "completion_tokens"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atlas_jax import hf
from atlas_jax.config import ServeConfig
from atlas_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from atlas_jax.decoding.generate import SamplingParams, generate
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
  p.add_argument("--max-batch", type=int, default=d.max_batch)
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
    prompts = read_prompts(args)
    model, tokenizer = load_any(args.checkpoint, args.dtype)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  params = SamplingParams(
    max_new_tokens=args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
  )
  out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
  try:
    for start in range(0, len(prompts), args.max_batch):
      chunk = prompts[start : start + args.max_batch]
      encoded = [tokenizer.encode(p) or [tokenizer.bos_id] for p in chunk]
      try:
        completions = generate(model, encoded, params, eos_id=tokenizer.eos_id)
      except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
      for prompt, ids in zip(chunk, completions):
        record = {
          "prompt": prompt,
          "completion": tokenizer.decode(ids),
          "completion_tokens": len(ids),
        }
        out.write(json.dumps(record) + "\n")
      out.flush()
  finally:
    if out is not sys.stdout:
      out.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
