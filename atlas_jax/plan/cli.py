"""`atlas-plan` / `python -m atlas_jax.plan`: memory and compute of a model, before running it.

    atlas-plan --config configs/llama3-8b.yaml
    atlas-plan --config path/to/hf_folder --seq-len 4096 --batch 16 --device H200 --json
    atlas-plan --config llama-2-70b --devices 64 --strategy zero3 --plot charts/
    atlas-plan --config configs/llama3-70b.yaml --devices 64 --pipeline 4 --microbatches 16

`--config` takes a YAML preset, a Hugging Face folder (its config.json alone is read), or a
published model's name (see `atlas_jax.plan.models`). A preset supplies the defaults for the
sequence length, batch, precision, remat policy, sharding, tensor parallelism and pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from atlas_jax.config import Config, ConfigError, ModelConfig
from atlas_jax.devices import DEVICES
from atlas_jax.plan import memory
from atlas_jax.plan.models import REFERENCE_MODELS, get_reference
from atlas_jax.plan.planner import PRECISIONS, PlanInputs, make_plan
from atlas_jax.plan.report import render


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  model: ModelConfig
  config: Config | None  # a YAML preset's full config (training defaults), else None
  notes: tuple[str, ...] = ()
  folder_dtype: str | None = None  # a Hugging Face folder's stored dtype (config.json's)
  fp8: memory.FP8Folder | None = None  # an FP8 folder's scales (quantization_config)


# A folder's stored dtype -> the precision serve.py --dtype auto serves it in.
FOLDER_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update(kib=2**10, mib=2**20, gib=2**30, tib=2**40, k=10**3, m=10**6, g=10**9, t=10**12)


def parse_size(text: str, flag: str) -> int:
  """Bytes from "24GB", "80GiB", "24G" or a plain number; ValueError naming the flag."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
  unit = m[2].lower() if m else None
  if m is None or unit not in _UNITS or float(m[1]) <= 0:
    raise ValueError(
      f"{flag}={text!r} is not a size: a positive number with a unit of B, KB, MB, GB, TB "
      "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
    )
  return int(float(m[1]) * _UNITS[unit])


def load_source(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> Source:
  """The model behind `--config`: a YAML preset, a Hugging Face folder, or a known model name."""
  path = Path(spec)
  if path.is_file() and path.suffix in (".yaml", ".yml"):
    from atlas_jax import sources  # a fine-tuning preset's model is its train.init_from's

    cfg = sources.load_config(path, overrides)
    return Source(path.stem, cfg.model, cfg)
  if overrides:
    raise ValueError(f"--set {overrides[0]!r}: overrides apply to YAML presets only")
  if path.is_file() and path.name == "config.json":
    path = path.parent
  if path.is_dir():
    if not (path / "config.json").is_file():
      raise ValueError(
        f"--config={spec!r}: the folder has no config.json (expected a Hugging Face model folder)"
      )
    from atlas_jax import hf
    from atlas_jax.serving.model_files import checkpoint_dtype

    try:
      model = hf.load_config(path)
      fp8 = _fp8_folder(path)
    except hf.HFLoadError as e:
      raise ValueError(f"--config={spec!r}: {e}") from e
    return Source(path.name, model, None, folder_dtype=checkpoint_dtype(path), fp8=fp8)
  ref = get_reference(spec)
  if ref is not None:
    return Source(ref.title, ref.model, None, (ref.note,) if ref.note else ())
  raise ValueError(
    f"--config={spec!r} is not a YAML preset, a Hugging Face folder with a config.json, or a "
    f"known model; known models: {', '.join(REFERENCE_MODELS)}"
  )


def _fp8_folder(path: Path) -> memory.FP8Folder | None:
  """The folder's FP8 scales when config.json's `quantization_config` is `quant_method: fp8`."""
  from atlas_jax.hf import fp8

  q = json.loads((path / "config.json").read_text()).get("quantization_config")
  if not isinstance(q, dict) or q.get("quant_method") not in fp8.METHODS:
    return None
  return memory.FP8Folder(fp8.block_size(q))


def preset_defaults(source: Source, devices: int) -> dict:
  """PlanInputs fields a preset implies (training shape, precision, remat, sharding)."""
  cfg = source.config
  if cfg is None:
    return {"seq_len": min(4096, source.model.max_seq_len), "batch": devices}
  t = cfg.train
  stage = cfg.mesh.stage if cfg.mesh.stage > 0 and devices % cfg.mesh.stage == 0 else 1
  tensor = cfg.mesh.tensor if (devices // stage) % cfg.mesh.tensor == 0 else 1
  ways = devices // stage // tensor
  expert = cfg.mesh.expert if cfg.mesh.expert > 0 and ways % cfg.mesh.expert == 0 else 1
  strategy = {"fsdp": "zero3"}.get(t.sharding, t.sharding)
  pipeline = {"pipeline": 1, "microbatches": 1, "repeats": 1}
  if stage > 1:
    pipeline = {
      "pipeline": stage,
      "microbatches": t.pipeline_microbatches,
      "repeats": t.pipeline_repeats,
    }
  return {
    **pipeline,
    "seq_len": t.seq_len,
    "batch": t.batch_size,
    "precision": t.precision,
    "remat": t.remat,
    "remat_every": t.remat_every,
    "strategy": strategy,
    "tensor": tensor,
    "expert": expert,
    "grad_accum": t.grad_accum,
    "loss_chunk": t.loss_chunk,
    "attention": "xla" if cfg.attention.implementation == "xla" else "flash",
    **({} if t.lora is None else {"lora_rank": t.lora.rank, "lora_targets": t.lora.targets}),
    "base_quantization": t.base_quantization,
    "base_quantization_group_size": t.base_quantization_group_size,
  }


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="atlas-plan",
    description="Memory and compute of a model: parameters, KV cache, training memory per "
    "device, activations per remat policy, FLOPs, time to train and the decode ceiling.",
  )
  p.add_argument("--config", required=True, help="YAML preset, HF folder, or a known model name")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset override")
  p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
  p.add_argument("--batch", type=int, help="global batch / sequences served")
  p.add_argument("--devices", type=int, default=8, help="devices to train on (default 8)")
  p.add_argument("--strategy", choices=memory.STRATEGIES, help="sharding strategy")
  p.add_argument("--tensor", type=int, help="tensor-parallel ways combined with the strategy")
  p.add_argument("--expert", type=int, help="expert-parallel ways (mixture-of-experts models)")
  p.add_argument("--remat", choices=memory.REMAT_POLICIES, help="activation checkpointing")
  p.add_argument("--remat-every", type=int, help="k for --remat every_k")
  p.add_argument("--precision", choices=PRECISIONS, help="compute precision (default bf16)")
  p.add_argument("--device", default="H100", help=f"one of: {', '.join(DEVICES)}")
  p.add_argument(
    "--memory",
    metavar="SIZE",
    help="memory per device (e.g. 24GB, 80GiB), in place of the --device's own",
  )
  p.add_argument("--attention", choices=memory.ATTENTION_IMPLS, help="attention implementation")
  p.add_argument("--grad-accum", type=int, help="micro-batches per step")
  p.add_argument("--pipeline", type=int, help="pipeline stages (the layer stack split S ways)")
  p.add_argument("--microbatches", type=int, help="pipeline micro-batches per accumulation step")
  p.add_argument("--repeats", type=int, help="layer groups per stage (circular schedule if > 1)")
  p.add_argument(
    "--loss-chunk", type=int, help="positions per chunk of the chunked cross-entropy (0: plain)"
  )
  p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
  p.add_argument("--tokens", type=float, help="training tokens (default: Chinchilla-optimal)")
  p.add_argument("--block-size", type=int, default=16, help="paged KV block size (default 16)")
  p.add_argument(
    "--devices-per-host",
    type=int,
    default=8,
    help="serving across hosts: devices per host, for the all-reduce bytes that cross hosts "
    "(default 8)",
  )
  p.add_argument(
    "--kv-cache-dtype",
    default="auto",
    help="serving's pool: auto (the compute dtype), int8 or fp8 (a byte a value and a scale "
    "per token and kv head)",
  )
  p.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank only (0: all)")
  p.add_argument(
    "--lora-targets", help="comma-separated LoRA targets (default: the preset's, or attn,mlp)"
  )
  p.add_argument(
    "--base-quantization",
    choices=memory.QUANT_BITS,
    help="QLoRA: the frozen base's projections held in int8, int4 or fp8 (with --lora-rank)",
  )
  p.add_argument(
    "--base-quantization-group-size", type=int, help="int4's inputs per scale (default 128)"
  )
  p.add_argument(
    "--fp8-weights",
    choices=("keep", "dequantize"),
    default="keep",
    help="an FP8 folder's projections as serve.py holds them: keep (e4m3 codes and float32 "
    "scales, the default) or dequantize (the serving dtype)",
  )
  out = p.add_mutually_exclusive_group()
  out.add_argument("--json", action="store_true", help="print every figure as JSON")
  out.add_argument("--markdown", action="store_true", help="print markdown tables")
  p.add_argument("--plot", metavar="DIR", help="also write PNG charts into DIR")
  return p


def build_plan(args: argparse.Namespace) -> dict:
  source = load_source(args.config, args.set)
  fields = {"devices": args.devices, **preset_defaults(source, args.devices)}
  for name in ("seq_len", "batch", "strategy", "tensor", "remat", "remat_every", "precision"):
    if getattr(args, name) is not None:
      fields[name] = getattr(args, name)
  if args.pipeline is not None and args.pipeline != fields.get("pipeline"):
    fields.update(microbatches=1, repeats=1)  # the preset's belong to its own stage count
  names = ("attention", "grad_accum", "loss_chunk", "expert", "lora_rank", "base_quantization")
  names += ("base_quantization_group_size",)
  for name in (*names, "pipeline", "microbatches", "repeats"):
    if getattr(args, name) is not None:
      fields[name] = getattr(args, name)
  if args.lora_targets is not None:
    fields["lora_targets"] = tuple(t.strip() for t in args.lora_targets.split(","))
  if args.tokens is not None:
    fields["tokens"] = int(args.tokens)
  notes = source.notes
  if args.precision is None and source.folder_dtype in FOLDER_PRECISIONS:
    # What serve.py --dtype auto serves a folder in: its checkpoint's dtype.
    fields["precision"] = FOLDER_PRECISIONS[source.folder_dtype]
    notes = (*notes, f"precision {fields['precision']}: the folder's {source.folder_dtype}")
  if args.memory is not None:
    fields["memory_bytes"] = parse_size(args.memory, "--memory")
  fields.update(
    device=args.device,
    mfu=args.mfu,
    block_size=args.block_size,
    kv_cache_dtype=args.kv_cache_dtype,
    devices_per_host=args.devices_per_host,
    fp8_weights=args.fp8_weights,
  )
  if source.fp8 is not None:
    held = (
      "e4m3 codes and float32 scales"
      if args.fp8_weights == "keep"
      else f"dequantized to {fields.get('precision', 'bf16')}"
    )
    notes = (*notes, f"FP8 folder: serving holds its projections as {held} (--fp8-weights)")
  return make_plan(
    source.model, PlanInputs(**fields), name=source.name, notes=notes, fp8=source.fp8
  )


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:
    plan = build_plan(args)
  except (ValueError, ConfigError) as e:  # HFLoadError and ConfigError are ValueErrors
    print(f"atlas-plan: error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(plan, indent=2))
  else:
    print(render(plan, markdown=args.markdown))
  if args.plot:
    from atlas_jax.plan.charts import save_charts

    for path in save_charts(plan, args.plot):
      print(f"wrote {path}", file=sys.stderr)
  return 0
