"""Small supervised tasks with a checkable answer, to see a fine-tune change a model's behaviour.

    python -m atlas_jax.data.synthetic reverse --out data/reverse.jsonl --examples 2000

`reverse`: a prompt of three words and the answer that lists them backwards,
"reverse: red fox sky" -> "sky fox red". Greedy completions of held-out prompts are scored by
exact match (train.eval_exact_match), so a run prints how often the model gets it right before
and after fine-tuning. Lines are completion examples (`prompt`, `completion`) or chats
(`messages`, data.format chat).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# Short, common words: few tokens each under any BPE.
WORDS = (
  "red blue green cat dog fox sun sky sea tree rock bird fish moon star rain snow wind fire leaf"
).split()
FORMATS = ("completion", "chat")


def reverse_examples(n: int, *, seed: int = 0, words: tuple[str, ...] = WORDS, length: int = 3):
  """(prompt, answer) pairs: `length` distinct words, and the same words backwards."""
  rng = random.Random(seed)
  for _ in range(n):
    chosen = rng.sample(words, length)
    yield f"reverse: {' '.join(chosen)}\n", " ".join(reversed(chosen))


def write(path: str | Path, pairs, fmt: str) -> int:
  """Writes (prompt, answer) pairs as JSONL lines of `fmt`; returns the count."""
  if fmt not in FORMATS:
    raise ValueError(f"--format={fmt!r} is not one of {FORMATS}")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  n = 0
  with path.open("w", encoding="utf-8") as f:
    for prompt, answer in pairs:
      if fmt == "completion":
        record = {"prompt": prompt, "completion": answer}
      else:
        record = {
          "messages": [
            {"role": "user", "content": prompt.strip()},
            {"role": "assistant", "content": answer},
          ]
        }
      f.write(json.dumps(record) + "\n")
      n += 1
  return n


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m atlas_jax.data.synthetic", description=__doc__)
  p.add_argument("task", choices=["reverse"])
  p.add_argument("--out", required=True)
  p.add_argument("--examples", type=int, default=2000)
  p.add_argument("--format", choices=FORMATS, default="completion")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.examples <= 0:
    print(f"error: --examples={args.examples} must be > 0", file=sys.stderr)
    return 2
  n = write(args.out, reverse_examples(args.examples, seed=args.seed), args.format)
  print(f"wrote {n} {args.task} examples to {args.out} ({args.format})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
