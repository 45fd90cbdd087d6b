"""Test setup: 8 fake CPU devices for sharding tests, set before jax is imported anywhere.

The suite's time goes mostly to XLA compiling hundreds of small programs, not to running them:
LLVM's optimisation passes are turned off (`--xla_backend_optimization_level=0`), which cuts the
compile-bound tests' time by about a third and changes no result a test checks (the programs
compute the same operations; tests compare within tolerances or between programs compiled the
same way)."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Tests compare against float32 references; keep matmuls at full float32 precision.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each module. A worker that runs hundreds of modules
  otherwise keeps thousands of executables mapped, and XLA's CPU compiler has crashed when a
  process neared the kernel's limit on memory mappings."""
  yield
  jax.clear_caches()
