"""`python -m atlas_jax.hf export --checkpoint RUN --out DIR [--adapters merged|separate]`:
a train.py run as a Hugging Face folder (`atlas_jax.hf.export`)."""

from __future__ import annotations

import argparse
import sys

from atlas_jax.hf import HFLoadError
from atlas_jax.hf.export import ADAPTER_MODES, export


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m atlas_jax.hf", description=__doc__)
  commands = p.add_subparsers(dest="command", required=True)
  ex = commands.add_parser("export", help="write a train.py run as a Hugging Face folder")
  ex.add_argument("--checkpoint", required=True, help="the run directory (newest intact step)")
  ex.add_argument("--out", required=True, help="the folder to write")
  ex.add_argument(
    "--adapters",
    choices=ADAPTER_MODES,
    default="merged",
    help="LoRA adapters merged into the weights (default), or kept apart in OUT/adapter (PEFT)",
  )
  args = p.parse_args(argv)
  try:
    files = export(args.checkpoint, args.out, adapters=args.adapters)
  except (HFLoadError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {', '.join(files)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
