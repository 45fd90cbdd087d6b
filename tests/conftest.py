"""Test setup: 8 fake CPU devices for sharding tests, set before jax is imported anywhere.

The suite's time goes mostly to XLA compiling hundreds of small programs, not to running them.
Two flags make compiling cheaper and change no result a test checks (the programs compute the
same operations; tests compare within tolerances or between programs compiled the same way):
LLVM's optimisation passes are off (`--xla_backend_optimization_level=0`), which cut the
compile-bound tests' time by about a third, and fusions are emitted by XLA's older LLVM IR
emitters rather than its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`), which
halved the backend's compile time again (an engine and a pipeline test: 29.8 -> 13.5 s of
compiling)."""

import os

# Shared with the suite's subprocesses (tests/training/runs.py).
COMPILE_FAST = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + COMPILE_FAST
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# serve.py's persistent compilation cache would write to the user's cache folder: off in tests.
os.environ["ATLAS_JAX_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402

# Tests compare against float32 references; keep matmuls at full float32 precision.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

# The longest modules (measured with --durations), longest first: xdist's loadscope hands out
# modules in collection order, so these start early and no worker ends the run alone on one.
LONGEST_FIRST = (
  "serving/test_engine.py",
  "training/test_pipeline.py",
  "training/test_finetune.py",
  "test_hf_patterns.py",
  "serving/test_ragged_step.py",
  "training/test_qlora.py",
  "training/test_sharding.py",
  "serving/test_engine_speculative.py",
  "serving/test_serve_moe.py",
  "test_hf_moe.py",
  "kernels/test_ragged_paged_attention.py",
  "serving/test_cpu_runner.py",
  "test_hf_glm.py",
  "test_hf_gpt_oss.py",
  "training/test_moe_training.py",
  "decoding/test_drafting.py",
  "serving/test_multihost.py",
  "decoding/test_speculative.py",
  "training/test_chunked_loss.py",
  "training/test_context_parallel.py",
  "test_hf_phi.py",
  "serving/test_multi_lora.py",
  "serving/test_guided_reasoning.py",
  "serving/test_engine_guided.py",
  "serving/test_engine_mtp.py",
  "training/test_resume_and_multihost.py",
  "training/test_pipeline_runs.py",
  "training/test_step.py",
  "training/test_init_from.py",
  "data/test_supervised.py",
  "test_cli.py",
  "serving/test_serve_mla.py",
  "serving/test_server.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  tests = os.path.dirname(os.path.abspath(__file__))
  where = lambda item: os.path.relpath(item.path, tests).replace(os.sep, "/")
  items.sort(key=lambda item: rank.get(where(item), len(rank)))  # stable: the rest keep order


def _memory_mappings() -> int | None:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


# A quarter of Linux's default limit (vm.max_map_count = 65530).
MAPPINGS_BEFORE_RELEASE = 16000


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after a module once the process holds many memory mappings.
  A worker that runs hundreds of modules otherwise keeps thousands of executables mapped, and
  XLA's CPU compiler has crashed when a process neared the kernel's limit on mappings. Below the
  threshold the programs stay: later modules reuse the same small programs (the shared tiny
  models' steps) instead of compiling them again. Where the count cannot be read, every module
  releases."""
  yield
  n = _memory_mappings()
  if n is None or n > MAPPINGS_BEFORE_RELEASE:
    jax.clear_caches()
