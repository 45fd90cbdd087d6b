"""XLA flags the trainer sets per platform, before jax starts its backend.

XLA reads `XLA_FLAGS` once, when the first backend starts; flags set later are ignored. So
`train.py` calls `apply` right after reading its config and before anything touches a device.
On GPU it adds:

* `--xla_gpu_enable_latency_hiding_scheduler=true`: schedule collectives (the FSDP all-gathers
  and reduce-scatters, the data-parallel all-reduce) asynchronously so that they overlap compute,
  instead of in program order;
* `--xla_gpu_{all_gather,reduce_scatter,all_reduce}_combine_threshold_bytes=134217728`: merge the
  per-layer collectives into fewer, larger ones (128 MiB), which run nearer link bandwidth;
* `--xla_gpu_enable_highest_priority_async_stream=true`: collectives run on the highest-priority
  stream, so they are not starved by the compute they should overlap.

Nothing is added on CPU or TPU. Precedence, lowest first: these defaults, `train.xla_flags`, then
flags already in the `XLA_FLAGS` environment variable; a flag named in a later source is not
repeated from an earlier one. `train.xla_flags: ""` turns the defaults off. An unknown flag stops
XLA at start-up with a message naming it, so a flag a newer XLA removed is reported, not ignored.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil

GPU_DEFAULTS = (
  "--xla_gpu_enable_latency_hiding_scheduler=true",
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
  "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
  "--xla_gpu_enable_highest_priority_async_stream=true",
)
DEFAULTS = {"gpu": GPU_DEFAULTS, "cpu": (), "tpu": ()}


def expected_platform(env: dict[str, str] | None = None) -> str:
  """ "gpu", "tpu" or "cpu": the platform jax will start, found without starting it.

  `JAX_PLATFORMS` decides when set (its first entry); otherwise an installed CUDA or ROCm plugin
  means a GPU, a libtpu means a TPU.
  """
  env = os.environ if env is None else env
  platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    first = platforms[0]
    return "gpu" if first in ("cuda", "rocm", "gpu") else "tpu" if first == "tpu" else "cpu"
  plugins = []
  if importlib.util.find_spec("jax_plugins") is not None:
    import jax_plugins

    plugins = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  if any("cuda" in name or "rocm" in name for name in plugins):
    return "gpu"
  if importlib.util.find_spec("libtpu") is not None:
    return "tpu"
  return "cpu"


def _name(flag: str) -> str:
  return flag.split("=", 1)[0]


def merged_flags(platform: str, configured: str | None, environment: str) -> str:
  """The XLA_FLAGS value for `platform`: defaults, then `configured`, then `environment`.

  `configured` None: the defaults; "": no defaults; otherwise flags added after the defaults.
  """
  sources = [  # lowest precedence first
    DEFAULTS.get(platform, ()) if configured != "" else (),
    tuple((configured or "").split()),
    tuple(environment.split()),
  ]
  out = []
  for i, source in enumerate(sources):
    overridden = {_name(f) for later in sources[i + 1 :] for f in later}
    out += [f for f in source if _name(f) not in overridden]
  return " ".join(out)


def apply(configured: str | None, env: dict[str, str] | None = None) -> str:
  """Sets `XLA_FLAGS` for the platform jax is about to start; returns the flags added.

  If a jax backend is already running, XLA would ignore them: warns and sets nothing.
  """
  import warnings

  import jax._src.xla_bridge as xla_bridge

  env = os.environ if env is None else env
  platform = expected_platform(env)
  before = env.get("XLA_FLAGS", "")
  after = merged_flags(platform, configured, before)
  if after == before:
    return ""
  if xla_bridge.backends_are_initialized():
    warnings.warn(
      "XLA flags not set: jax has already started its backend (set XLA_FLAGS in the "
      "environment, or call atlas_jax.training.xla_flags.apply before using jax)",
      stacklevel=2,
    )
    return ""
  env["XLA_FLAGS"] = after
  return " ".join(f for f in after.split() if f not in before.split())
