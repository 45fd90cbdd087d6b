"""MFU only where the device's peak is known or given; XLA flags per platform, set before jax
starts."""

import subprocess
import sys
from pathlib import Path

import jax._src.xla_bridge as xla_bridge
import pytest

from atlas_jax.config import ConfigError
from atlas_jax.training import xla_flags
from atlas_jax.training.metrics import mfu, peak_flops_per_device

from .common import tiny_config

ROOT = Path(__file__).parent.parent.parent


def test_no_mfu_on_a_cpu_unless_its_peak_is_given():
  assert peak_flops_per_device() is None
  assert mfu(1000.0, 6e6, n_devices=8) is None
  assert mfu(1000.0, 6e6, n_devices=8, peak_tflops=0.5) == pytest.approx(1000 * 6e6 / (8 * 0.5e12))


def test_peak_tflops_and_xla_flags_are_validated():
  with pytest.raises(ConfigError, match=r"train\.peak_tflops=-1\.0 .*must be > 0"):
    tiny_config("train.peak_tflops=-1")
  with pytest.raises(ConfigError, match=r"train\.xla_flags=.*'xla_foo=1'.*must start with --xla_"):
    tiny_config("train.xla_flags='--xla_gpu_enable_latency_hiding_scheduler=true xla_foo=1'")


def test_platform_is_found_without_starting_jax():
  assert xla_flags.expected_platform({"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
  assert xla_flags.expected_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"
  assert xla_flags.expected_platform({"JAX_PLATFORMS": "tpu"}) == "tpu"


def test_gpu_defaults_config_and_environment_in_precedence_order():
  lhs = "--xla_gpu_enable_latency_hiding_scheduler"
  merged = xla_flags.merged_flags("gpu", None, "")
  assert merged.split() == list(xla_flags.GPU_DEFAULTS)
  assert xla_flags.merged_flags("cpu", None, "--xla_cpu_foo=1") == "--xla_cpu_foo=1"
  assert xla_flags.merged_flags("gpu", "", "") == ""  # "" turns the defaults off
  # The config overrides a default; the environment overrides both; nothing is repeated.
  merged = xla_flags.merged_flags("gpu", f"{lhs}=false --xla_gpu_x=1", "--xla_gpu_x=2")
  flags = merged.split()
  assert f"{lhs}=false" in flags and f"{lhs}=true" not in flags
  assert flags[-1] == "--xla_gpu_x=2" and "--xla_gpu_x=1" not in flags
  assert len({f.split("=")[0] for f in flags}) == len(flags)


def test_apply_sets_xla_flags_only_for_a_gpu(monkeypatch):
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert xla_flags.apply(None, env) == ""
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  env = {"JAX_PLATFORMS": "cuda"}
  added = xla_flags.apply(None, env)
  assert added.split() == list(xla_flags.GPU_DEFAULTS) == env["XLA_FLAGS"].split()


def test_apply_after_jax_started_warns_and_sets_nothing():
  env = {"JAX_PLATFORMS": "cuda"}
  assert xla_bridge.backends_are_initialized()  # the test session has started the CPU backend
  with pytest.warns(UserWarning, match="already started its backend"):
    assert xla_flags.apply(None, env) == ""
  assert "XLA_FLAGS" not in env


def test_train_py_reaches_its_flags_before_any_backend_starts():
  """Importing train.py and the library and reading a config start no jax backend."""
  code = (
    "import sys; sys.path.insert(0, '.'); import train; import jax._src.xla_bridge as xb; "
    "from atlas_jax.config import load_config; load_config('configs/tiny.yaml'); "
    "print(xb.backends_are_initialized())"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert out.stdout.strip() == "False", out.stdout + out.stderr
