"""Train a model: config -> mesh -> sharded init -> grain data -> jitted steps -> checkpoints.

    python train.py --config configs/tiny.yaml [--set train.steps=300 --set train.remat=full ...]

With train.init_from (a Hugging Face folder or another run) the run fine-tunes that model: its
config, weights and tokenizer, from step 0 with a fresh optimizer; data.format chat or completion
trains on the answers only, and train.lora trains low-rank adapters only.

Rerunning the same command resumes from the run directory's latest checkpoint (model, optimizer,
step and data position), so an interrupted run continues exactly where it stopped: Ctrl-C
(SIGINT) or SIGTERM finishes the step in flight, saves a checkpoint and exits. On several hosts,
run the same command on each with mesh.coordinator_address / num_processes / process_id set (or
the environment jax.distributed reads on TPU pods and SLURM).

`main` reads as the run does: build, load_data, restore, train (which logs, evaluates and
checkpoints), report, sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from atlas_jax import host_memory, sources
from atlas_jax.config import Config, ConfigError, load_config
from atlas_jax.data import pipeline, supervised
from atlas_jax.data.tokenizer import Tokenizer, load_tokenizer
from atlas_jax.decoding.generate import SamplingParams, generate
from atlas_jax.hf import init_from
from atlas_jax.plan.compute import train_flops_per_token
from atlas_jax.schedule import Schedule
from atlas_jax.training import checkpoint
from atlas_jax.training import sharding as shd
from atlas_jax.training.metrics import (
  Logger,
  matmul_params,
  mfu,
  param_count,
  peak_memory,
  peak_memory_bytes,
)
from atlas_jax.training.pipeline import reorder_layers
from atlas_jax.training.step import (
  Trainer,
  TrainState,
  build_model,
  make_eval_step,
  make_train_step,
  make_trainer,
  split_trainable,
)
from atlas_jax.training.xla_flags import apply as apply_xla_flags
from atlas_jax.training.xla_flags import expected_platform


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="configs/tiny.yaml", help="YAML preset")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override a config field, e.g. --set train.steps=100 (repeatable)",
  )
  p.add_argument(
    "--data-cache",
    default=None,
    help="where tokenised corpora are stored (default: <checkpoint_dir>/../.data)",
  )
  p.add_argument(
    "--sample-prompt",
    default=None,
    help="prompt to complete with the trained model at the end ('' to skip; default 'def ' for "
    "text data, none for supervised examples)",
  )
  p.add_argument("--sample-tokens", type=int, default=96)
  return p.parse_args(argv)


def init_distributed(cfg: Config) -> None:
  """Joins a multi-process run when the config (or the environment on pods/SLURM) asks for it."""
  m = cfg.mesh
  if m.coordinator_address is None and m.num_processes is None:
    return
  kwargs = {"coordinator_address": m.coordinator_address, "process_id": m.process_id}
  if m.num_processes not in (None, -1):
    kwargs["num_processes"] = m.num_processes
  # CPU processes exchange collectives over gloo (GPU/TPU use their own interconnect).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)


# Fields that may change when a run is resumed (how it runs, not what it computes).
RESUME_MAY_CHANGE = {
  "steps",
  "log_every",
  "eval_every",
  "eval_batches",
  "checkpoint_every",
  "keep_checkpoints",
  "checkpoint_dir",
  "remat",
  "remat_every",
  "sharding",
  "peak_tflops",
  "on_corrupt_checkpoint",
  "loss_chunk",
  "xla_flags",
  "eval_exact_match",
  "pipeline_microbatches",
  "pipeline_repeats",
}


def has_checkpoints(run_dir: Path) -> bool:
  return run_dir.is_dir() and any(p.name.isdigit() for p in run_dir.iterdir())


def check_resumable(run_dir: Path, cfg: Config) -> None:
  """A run directory holding checkpoints resumes only with the same model, data and training."""
  old_path = run_dir / "config.yaml"
  if not old_path.is_file() or not has_checkpoints(run_dir):
    return
  old = load_config(old_path)
  for section in ("model", "data", "train"):
    a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(cfg, section))
    diff = [k for k in b if a.get(k) != b[k] and k not in RESUME_MAY_CHANGE]
    if diff:
      raise ConfigError(
        f"{run_dir} holds a run with different {section} settings ({', '.join(diff)}); "
        "use another train.checkpoint_dir or the same settings"
      )


@dataclasses.dataclass(frozen=True)
class Run:
  """What every later step needs: the config, where the run lives, its tokenizer and trainer."""

  cfg: Config
  run_dir: Path
  cache_dir: Path
  tokenizer: Tokenizer
  trainer: Trainer
  added_flags: str  # XLA flags set for this platform ("" if none)
  host_malloc: str = ""  # on CPU, what `host_memory.keep_freed_memory` did
  template: Any = None  # data.format chat: the chat template serve.py renders this run's with
  resuming: bool = False  # the run directory holds checkpoints

  @property
  def main_process(self) -> bool:
    return jax.process_index() == 0

  def say(self, *args, **kwargs) -> None:
    """print, on the first process only (every process runs the same loop)."""
    if self.main_process:
      print(*args, **kwargs)


def build(args: argparse.Namespace) -> Run:
  """Config, XLA flags, tokenizer, distributed start-up and the trainer; raises ConfigError,
  ValueError or OSError on bad input, before any device work."""
  cfg = sources.load_config(args.config, args.set)
  # Before anything starts a jax backend: XLA reads its flags once, at start-up.
  added_flags = apply_xla_flags(cfg.train.xla_flags)
  # XLA's CPU temporaries come from malloc: kept between steps, not mapped afresh each step.
  host_malloc = host_memory.keep_freed_memory() if expected_platform() == "cpu" else ""
  run_dir = Path(cfg.train.checkpoint_dir)
  cache_dir = Path(args.data_cache) if args.data_cache else run_dir.parent / ".data"
  check_resumable(run_dir, cfg)
  resuming = has_checkpoints(run_dir)
  # A fine-tune's tokenizer and chat template: the source's, kept in the run directory.
  folder = (run_dir if resuming else Path(cfg.train.init_from)) if cfg.train.init_from else None
  if folder is not None:
    tokenizer = sources.tokenizer(folder, cfg.model.vocab_size)
  elif resuming and cfg.data.tokenizer != "byte" and (run_dir / "tokenizer.json").is_file():
    tokenizer = load_tokenizer(str(run_dir / "tokenizer.json"))  # the one the run began with
  else:
    t0 = time.time()
    tokenizer = pipeline.tokenizer_for(cfg.data, cache_dir)
    if time.time() - t0 > 1:
      print(f"tokenizer: {cfg.data.tokenizer} trained in {time.time() - t0:.1f}s")
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(
      f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
      f"vocabulary ({tokenizer.vocab_size})"
    )
  template = None
  if cfg.data.format == "chat":
    template = sources.chat_template(folder or (run_dir if resuming else None), tokenizer)
  init_distributed(cfg)
  trainer = make_trainer(cfg)
  return Run(
    cfg, run_dir, cache_dir, tokenizer, trainer, added_flags, host_malloc, template, resuming
  )


@dataclasses.dataclass(frozen=True)
class Data:
  train: Any  # the grain dataset: train[i] is step i + 1's process-local batch
  eval: list  # process-local eval batches
  unigram: float  # nats/token of a model that ignores the context (over answers: supervised)
  eval_examples: supervised.Examples | None = None  # held-out examples (supervised formats)


def load_data(run: Run) -> Data:
  """Token files (tokenised once, cached), the packed train dataset and the eval batches."""
  cfg, t0 = run.cfg, time.time()
  files = pipeline.token_files(
    cfg.data, run.tokenizer, run.cache_dir, log=run.say, template=run.template
  )
  if cfg.data.format != "text":
    return load_examples(run, files, t0)
  shards = dict(process_index=jax.process_index(), process_count=jax.process_count())
  sizes = dict(seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size)
  train_ds = pipeline.train_dataset(*files["train"], **sizes, seed=cfg.train.seed, **shards)
  eval_data = pipeline.eval_batches(
    *files["eval"], **sizes, n_batches=cfg.train.eval_batches, **shards
  )
  shortfall = pipeline.eval_shortfall(*files["eval"], **sizes, eval_fraction=cfg.data.eval_fraction)
  if shortfall and cfg.train.eval_every and cfg.train.eval_batches:
    run.say(f"note: {shortfall}")
  unigram = unigram_entropy(np.asarray(files["train"][0]), run.tokenizer.vocab_size)
  run.say(
    f"corpus: {len(files['train'][0]):,} train / {len(files['eval'][0]):,} eval tokens "
    f"({time.time() - t0:.1f}s); unigram baseline {unigram:.3f} nats/token"
  )
  return Data(train_ds, eval_data, unigram)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
  """Nats/token of a model that ignores the context."""
  counts = np.bincount(tokens, minlength=vocab_size)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def load_examples(run: Run, files: dict, t0: float) -> Data:
  """Supervised examples packed into rows; losses (and the unigram baseline) over answers."""
  cfg = run.cfg
  shards = dict(process_index=jax.process_index(), process_count=jax.process_count())
  split = {k: supervised.Examples(tokens=t, starts=s, mask=m) for k, (t, s, m) in files.items()}
  if not len(split["train"]):
    raise ValueError("the train split has no examples: add lines, or lower data.eval_fraction")
  pad = max(run.tokenizer.pad_id, 0)
  rows = {k: supervised.PackedExamples(v, cfg.train.seq_len, pad) for k, v in split.items()}
  train_ds = pipeline.batched_rows(
    rows["train"], batch_size=cfg.train.batch_size, seed=cfg.train.seed, **shards
  )
  eval_data = pipeline.eval_example_batches(
    rows["eval"], batch_size=cfg.train.batch_size, n_batches=cfg.train.eval_batches, **shards
  )
  for name, r in rows.items():
    run.say(f"{name}: {r.packing.describe(cfg.train.seq_len)}")
  answers = np.asarray(split["train"].tokens)[np.asarray(split["train"].mask) > 0]
  unigram = unigram_entropy(answers, run.tokenizer.vocab_size)
  run.say(
    f"examples: {len(split['train']):,} train / {len(split['eval']):,} eval, "
    f"{len(answers):,} answer tokens to learn ({time.time() - t0:.1f}s); unigram baseline "
    f"{unigram:.3f} nats/token over the answers"
  )
  return Data(train_ds, eval_data, unigram, split["eval"])


def asynchronous(cfg: Config) -> bool:
  """Whether checkpoints save while the run goes on (`train.async_checkpointing`)."""
  if cfg.train.async_checkpointing is not None:
    return cfg.train.async_checkpointing
  return jax.default_backend() != "cpu"


def restore(run: Run) -> tuple[Any, TrainState, int]:
  """(checkpoint manager, state, steps done): the newest intact checkpoint, or a fresh init.

  A damaged newest checkpoint is set aside and the next one tried (train.on_corrupt_checkpoint);
  raises checkpoint.CheckpointError where none can be restored."""
  cfg, trainer = run.cfg, run.trainer
  mngr = checkpoint.manager(
    run.run_dir, max_to_keep=cfg.train.keep_checkpoints, asynchronous=asynchronous(cfg)
  )
  if mngr.latest_step() is None:
    key = jax.random.key(cfg.train.seed)
    if cfg.train.init_from is None:
      return mngr, trainer.init(key), 0
    t0 = time.time()
    state = trainer.init(key, init_from.base_params(cfg.train.init_from, trainer))
    run.say(f"initialised from {cfg.train.init_from} ({time.time() - t0:.1f}s)")
    return mngr, state, 0
  step, (state, meta), damaged = checkpoint.newest_intact(
    list(mngr.all_steps()),
    lambda s: checkpoint.restore(mngr, trainer.abstract_state(), trainer.state_shardings, s),
    fallback=cfg.train.on_corrupt_checkpoint == "fallback",
    warn=lambda message: run.say(message, file=sys.stderr),
    hint=" (train.on_corrupt_checkpoint=stop; 'fallback' resumes from the newest intact step)",
  )
  if damaged:
    # Out of orbax's sight, or the resumed run could not save those steps again.
    if run.main_process:
      moved = checkpoint.set_aside(run.run_dir, damaged)
      run.say(f"set aside the damaged steps as {', '.join(p.name for p in moved)}")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices("checkpoint.set_aside")
    mngr = checkpoint.manager(
      run.run_dir, max_to_keep=cfg.train.keep_checkpoints, asynchronous=asynchronous(cfg)
    )
  start = int(meta["data_index"])
  run.say(f"resumed from {run.run_dir} at step {start}")
  return mngr, trainer.restored(state, meta), start


class Interrupt:
  """SIGINT and SIGTERM ask the loop to stop after the step in flight (and save it); a second
  signal stops at once, as without this guard. Outside the main thread it installs nothing."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> Interrupt:
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame) -> None:
    if self.signum is not None:  # the second one: give up on the save
      self.__exit__()
      signal.raise_signal(signum)
      return
    self.signum = signum
    print(
      f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
      "(again to stop at once, without it)",
      file=sys.stderr,
      flush=True,
    )

  def agreed(self, step: int, log_every: int) -> bool:
    """Whether every process stops now. One process reads its own flag at every step; several
    agree at logged steps, where the host waits for the device anyway."""
    if jax.process_count() == 1:
      return self.signum is not None
    if step % log_every:
      return False
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.int32(self.signum or 0))
    if self.signum is None and flags.any():
      self.signum = int(flags.max())
    return bool(flags.any())


def evaluate(eval_step: Callable, params, batches: list, to_global: Callable) -> float:
  """Mean next-token loss over the eval batches (MTP heads and z-loss left out)."""
  return float(np.mean([float(eval_step(params, to_global(b))) for b in batches]))


@dataclasses.dataclass
class Outcome:
  record: dict  # the last metrics logged
  exit_code: int = 0  # 0; 1 a non-finite step under on_nan=stop; 128 + signal when interrupted
  step: int = 0  # steps done when the loop ended
  before: tuple[int, int] | None = None  # held-out exact matches of the initial model (of n)


def decoding_model(trainer: Trainer, params) -> nnx.Module:
  """The model as `generate` runs it: its layers in depth order, without the pipeline runner
  (which runs the uncached layers only)."""
  if trainer.mesh.shape["stage"] == 1:
    return nnx.merge(trainer.graphdef, params)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(trainer.cfg)))
  return nnx.merge(graphdef, reorder_layers(params, trainer.layout, (1, 1)))


def exact_match(run: Run, model, examples: supervised.Examples) -> tuple[int, int]:
  """(matches, n): held-out examples whose greedy completion of their prompt is exactly their
  answer (`train.eval_exact_match` of them, those that fit the context)."""
  n, limit = run.cfg.train.eval_exact_match, run.cfg.model.max_seq_len
  pairs = [
    (p, a)
    for p, a in supervised.held_out_examples(examples, n)
    if p and a and len(p) + len(a) <= limit
  ]
  if not pairs:
    return 0, 0
  params = [SamplingParams(max_new_tokens=len(a), temperature=0.0) for _, a in pairs]
  outs = generate(model, [p for p, _ in pairs], params)
  return sum(list(o) == a for o, (_, a) in zip(outs, pairs)), len(pairs)


def train(run: Run, data: Data, mngr, state: TrainState, start: int) -> Outcome:
  """The loop: a jitted step per batch, metrics and eval every log_every / eval_every steps,
  checkpoints every checkpoint_every steps, at the end and when interrupted."""
  cfg, trainer = run.cfg, run.trainer
  n_params = param_count(state.params)
  flops_tok = train_flops_per_token(
    cfg.model, cfg.train.seq_len, n_matmul_params=matmul_params(state.params)
  )
  run.say(
    f"model: {n_params:,} parameters; precision {cfg.train.precision}, remat "
    f"{cfg.train.remat}, sharding {cfg.train.sharding}"
  )
  stages, repeats = trainer.layout
  if stages > 1:
    sched = Schedule(stages, cfg.train.pipeline_microbatches, repeats)
    kind = f"circular, {repeats} repeats" if repeats > 1 else "GPipe"
    run.say(
      f"pipeline: {stages} stages x {sched.microbatches} micro-batches ({kind}): "
      f"{sched.iterations} iterations per micro-batch step, bubble {sched.bubble:.1%}"
    )
  if cfg.train.lora is not None:
    n_lora = sum(x.size for x in jax.tree.leaves(split_trainable(cfg, state.params)[0]))
    lo = cfg.train.lora
    run.say(
      f"LoRA rank {lo.rank}, alpha {lo.alpha:g} on {', '.join(lo.targets)}: {n_lora:,} trainable "
      f"parameters ({n_lora / n_params:.2%}), the base weights frozen"
      + (f" and held in {q}" if (q := cfg.train.base_quantization) else "")
    )
  out = Outcome({}, step=start)
  if start == 0 and cfg.train.eval_exact_match and data.eval_examples is not None:
    out.before = exact_match(run, decoding_model(trainer, state.params), data.eval_examples)
  train_step, eval_step = make_train_step(trainer), make_eval_step(trainer)
  batch_sharding = shd.batch_sharding(trainer.mesh)
  to_global = lambda local: jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(batch_sharding, x), local
  )
  logger = Logger(run.run_dir, enabled=run.main_process)
  tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
  progress = sys.stdout.isatty() and run.main_process
  save = lambda step: checkpoint.save(mngr, step, state, trainer.checkpoint_meta(step))

  t_last, steps_since = time.time(), 0
  # An asynchronous save holds a host copy of the state until written; with the allocator keeping
  # freed memory (`run.host_malloc`) its buffers would stay resident as holes that the step's one
  # large temporary buffer does not fit, so they go back once the save has ended.
  trim_after_save = False
  if run.host_malloc and start < cfg.train.steps:
    # Compiled ahead, its working memory handed back before the first step takes its buffers:
    # kept as holes, the step's one large temporary buffer would not fit them.
    # (jit's cache keeps the program: the first step's call finds it compiled.)
    train_step.lower(state, to_global(data.train[start])).compile()
    host_memory.return_freed_memory()
  with Interrupt() as interrupt:
    for step in range(start + 1, cfg.train.steps + 1):
      if trim_after_save and not mngr.is_saving_in_progress():
        host_memory.return_freed_memory()
        trim_after_save = False
      state, metrics = train_step(state, to_global(data.train[step - 1]))
      out.step, steps_since = step, steps_since + 1
      last = step == cfg.train.steps
      if progress:
        done = int(30 * step / cfg.train.steps)
        print(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{cfg.train.steps}", end="", flush=True)
      if step % cfg.train.log_every == 0 or last:
        metrics = {k: float(v) for k, v in metrics.items()}
        bad = int(state.first_nonfinite)
        if bad and cfg.train.on_nan == "stop":
          # That step skipped its update, so the state (and every checkpoint) is still clean.
          print(
            f"\nerror: the loss or gradients were not finite at step {bad}; stopping "
            "(train.on_nan=stop; 'skip' skips such steps)",
            file=sys.stderr,
          )
          out.exit_code = 1
          break
        tps = steps_since * tokens_per_step / (time.time() - t_last)
        out.record = step_record(cfg, step, metrics, tps, flops_tok)
        if data.eval and cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
          out.record["eval_loss"] = evaluate(eval_step, state.params, data.eval, to_global)
        if (peak := peak_memory_bytes()) is not None:
          out.record["peak_memory_gb"] = peak / 2**30
        line = "  ".join(
          f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.record.items()
        )
        run.say(("\r" if progress else "") + line, flush=True)
        logger.write(out.record)
        t_last, steps_since = time.time(), 0
      stop = interrupt.agreed(step, cfg.train.log_every)
      if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last or stop:
        save(step)
        trim_after_save = bool(run.host_malloc)
      if stop and not last:
        out.exit_code = 128 + interrupt.signum
        run.say(
          f"interrupted at step {step}: checkpoint saved in {run.run_dir}; rerun the same "
          "command to resume",
          file=sys.stderr,
        )
        break
    mngr.wait_until_finished()  # still guarded: a save is never cut off halfway
  logger.close()
  if (peak := peak_memory()) is not None:
    run.say(f"peak memory: {peak[0] / 2**30:.3f} GiB ({peak[1]}, process {jax.process_index()})")
  return out


def step_record(cfg: Config, step: int, metrics: dict, tps: float, flops_tok: float) -> dict:
  """One line of metrics.jsonl: the next-token loss, its MTP and router terms, the experts' load
  and what the step cost."""
  record = {
    "step": step,
    "loss": metrics["loss"],
    "grad_norm": metrics["grad_norm"],
    "learning_rate": metrics["learning_rate"],
    "tokens_per_s": tps,
  }
  # Only where the device's peak is known or given (train.peak_tflops): not on a CPU.
  util = mfu(tps, flops_tok, n_devices=jax.device_count(), peak_tflops=cfg.train.peak_tflops)
  if util is not None:
    record["mfu"] = util
  mtp = {k: v for k, v in metrics.items() if k.startswith("loss_mtp")}
  # Mixture of experts: the balance and router z losses, the busiest expert's tokens over the
  # mean, the mean tokens per expert, the share of assignments dropped.
  moe = {k: v for k, v in metrics.items() if k.startswith("moe_")}
  if mtp or moe or cfg.train.z_loss:
    record["loss_total"] = metrics["loss_total"]  # the objective the gradients came from
  record.update(mtp)
  record.update(moe)
  if "loss_scale" in metrics:
    record["loss_scale"] = metrics["loss_scale"]
  if metrics.get("skipped"):
    record["skipped"] = int(metrics["skipped"])
  return record


def report(run: Run, data: Data, out: Outcome) -> None:
  run.say(f"checkpoint: {run.run_dir} (step {out.step})")
  if run.cfg.train.eval_exact_match and data.eval_examples is not None:
    model, _, _ = checkpoint.load_model(run.run_dir)  # what serve.py serves: adapters merged
    hits, n = exact_match(run, model, data.eval_examples)
    before = "" if out.before is None else f"{out.before[0]}/{out.before[1]} before, "
    run.say(
      f"held-out exact match (greedy): {before}{hits}/{n} = {hits / max(n, 1):.1%} after "
      f"{out.step} steps"
    )
    record = {"step": out.step, "exact_match": hits / max(n, 1)}
    if out.before is not None:
      record["exact_match_before"] = out.before[0] / max(out.before[1], 1)
    logger = Logger(run.run_dir, enabled=run.main_process)  # a last line of metrics.jsonl
    logger.write(record)
    logger.close()
  if "eval_loss" in out.record:
    eval_loss = out.record["eval_loss"]
    run.say(
      f"eval loss {eval_loss:.3f} nats/token against the unigram baseline "
      f"{data.unigram:.3f}: the context is worth {data.unigram - eval_loss:.3f} nats/token"
    )


def sample(run: Run, prompt_text: str, max_tokens: int) -> None:
  """Completes `prompt_text` with the saved model, sampling as serve.py would from this run."""
  cfg = run.cfg
  model, _, _ = checkpoint.load_model(run.run_dir, implementation=cfg.attention.implementation)
  prompt = run.tokenizer.encode(prompt_text)
  s = cfg.serve.sampling  # how serve.py samples from this run, unless its flags say otherwise
  params = SamplingParams(
    max_new_tokens=min(max_tokens, cfg.model.max_seq_len - len(prompt)),
    temperature=s.temperature,
    top_k=s.top_k,
    top_p=s.top_p,
    seed=s.seed,
  )
  out = generate(model, [prompt], params, eos_id=run.tokenizer.eos_id)[0]
  how = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}, top-k {s.top_k}"
  print(f"sample ({how}):\n{prompt_text + run.tokenizer.decode(out)}")


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    return run_command(args)
  except KeyboardInterrupt:  # outside the loop's guard: before the first step, or while sampling
    print("\ninterrupted; the checkpoints saved so far are kept", file=sys.stderr)
    return 128 + signal.SIGINT


def run_command(args: argparse.Namespace) -> int:
  try:
    run = build(args)
  except (ConfigError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if run.main_process:
    checkpoint.write_run_files(run.run_dir, run.cfg, run.tokenizer)
    if run.cfg.train.init_from and not run.resuming:
      sources.copy_files(run.cfg.train.init_from, run.run_dir)
  run.say(
    f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, "
    f"processes: {jax.process_count()}, mesh: {dict(run.trainer.mesh.shape)}"
  )
  if run.added_flags:
    run.say(f"XLA flags added for {jax.default_backend()}: {run.added_flags}")
  if run.host_malloc:
    run.say(f"host memory: {run.host_malloc}")
  try:
    data = load_data(run)
  except (ValueError, OSError) as e:
    print(f"error: data.source={run.cfg.data.source!r}: {e}", file=sys.stderr)
    return 2
  try:
    mngr, state, start = restore(run)
  except (checkpoint.CheckpointError, ConfigError, ValueError) as e:  # init_from's errors too
    print(f"error: {e}", file=sys.stderr)
    return 2
  # Loading a checkpoint or a folder reads every tensor through host buffers, freed once the
  # state holds its arrays; with the allocator keeping freed memory (`run.host_malloc`) they would
  # stay resident for the whole run, holes the step's one large temporary buffer does not fit.
  host_memory.return_freed_memory()
  out = train(run, data, mngr, state, start)
  if out.exit_code:
    return out.exit_code
  report(run, data, out)
  prompt = args.sample_prompt
  if prompt is None:
    prompt = "def " if run.cfg.data.format == "text" else ""
  if prompt and jax.process_count() == 1:
    sample(run, prompt, args.sample_tokens)
  return 0


if __name__ == "__main__":
  sys.exit(main())
