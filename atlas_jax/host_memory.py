"""The C allocator's policy for XLA's CPU buffers: keep freed memory for the next step.

XLA's CPU runtime takes each execution's temporaries (one buffer, the compiled program's
`temp_size_in_bytes`) from the C library's malloc and frees them when the execution ends. glibc
serves an allocation past its mmap threshold (32 MiB at most) with a fresh mapping and unmaps it
on free, so every call of a program with larger temporaries faults every page of them in again,
each zeroed by the kernel: the tiny preset's training step (186 MiB of temporaries) took 48,000
page faults a step, PyTorch's eager step 2,000-4,000 (its caching allocator keeps freed blocks).

`keep_freed_memory` sets glibc's malloc (`mallopt`) to serve every allocation from its main heap
and keep what is freed there for the next allocation: no mmap (`M_MMAP_MAX` 0), the heap's free
top never returned to the system (`M_TRIM_THRESHOLD` -1, which disables trimming; with 2 GiB,
its largest positive value, the small preset's step of 4 x 256 tokens still took 280,000-360,000
page faults every step, since glibc trims whatever lies above the threshold at the heap's top, and
none once its heap had grown with trimming off), and one arena (`M_ARENA_MAX` 1), since a worker
thread's own arena cannot hold a buffer past 64 MiB and maps it whatever `M_MMAP_MAX` says. The
cost is resident memory: what was freed stays the process's, and glibc's best fit keeps a few
copies of a large buffer (`train.py` on the tiny preset: 1.6 GB peak against 1.1 GB). tcmalloc
(`LD_PRELOAD=libtcmalloc_minimal.so.4`, Debian's `libtcmalloc-minimal4`) keeps freed memory too,
without that cost (its size classes hold freed spans per thread, not one best-fit heap); jemalloc
returns large buffers to the system as glibc does.

The setting is process-wide, so a program makes it (`train.py`, on the CPU backend, before the
backend starts), not the library on import; a JAX project that imports our modules may call
`keep_freed_memory()` itself. `serve.py` does not: its step programs' temporaries are small and
its offline throughput did not change. Malloc is left as it is where the user chose: a
`jemalloc`, `tcmalloc` or `mimalloc` in `LD_PRELOAD`, glibc malloc tunables in `GLIBC_TUNABLES`
or `MALLOC_*_` variables, or `ATLAS_JAX_MALLOC=system`; and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = -1  # never trim (mallopt(3)); 2 GiB, the largest positive int, was too low
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_TUNABLES = (
  "MALLOC_ARENA_MAX",
  "MALLOC_MMAP_MAX_",
  "MALLOC_MMAP_THRESHOLD_",
  "MALLOC_TRIM_THRESHOLD_",
)


def users_choice(env: dict[str, str] | None = None) -> str | None:
  """What in the environment says the user chose the allocator (a phrase), or None.

  Raises ValueError for an `ATLAS_JAX_MALLOC` other than "auto" (the default) or "system"."""
  env = os.environ if env is None else env
  policy = env.get("ATLAS_JAX_MALLOC", "auto")
  if policy not in ("auto", "system"):
    raise ValueError(f"ATLAS_JAX_MALLOC={policy!r}: allowed values are auto, system")
  if policy == "system":
    return "ATLAS_JAX_MALLOC=system"
  preload = env.get("LD_PRELOAD", "")
  for name in _ALLOCATORS:
    if name in preload:
      return f"{name} in LD_PRELOAD"
  if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
    return "glibc.malloc tunables in GLIBC_TUNABLES"
  for name in _TUNABLES:
    if name in env:
      return f"{name} set"
  return None


def keep_freed_memory(env: dict[str, str] | None = None) -> str:
  """Sets glibc's malloc to keep freed memory (the module docstring); returns what was done, a
  phrase for a log line. Call it before the CPU backend starts (its threads pick their malloc
  arenas when they first allocate)."""
  choice = users_choice(env)
  if choice is not None:
    return f"left as the environment sets it ({choice})"
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return "left as it is (not glibc)"
  libc = ctypes.CDLL(None)
  settings = (
    ("M_ARENA_MAX", M_ARENA_MAX, 1),
    ("M_MMAP_MAX", M_MMAP_MAX, 0),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
  )
  refused = [name for name, param, value in settings if libc.mallopt(param, value) != 1]
  if refused:
    return f"mallopt refused {', '.join(refused)}"
  done = "glibc malloc keeps freed memory (one arena, no mmap)"
  tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
  if tcmalloc:
    done += f"; tcmalloc is installed: LD_PRELOAD={tcmalloc} keeps it with less memory"
  return done


def return_freed_memory() -> bool:
  """Hands the C allocator's free memory back to the system (glibc's `malloc_trim(0)`, every
  arena); whether anything was returned. For a process past a burst of large, short-lived
  allocations it will not repeat, as compiling XLA programs is: each compile's working memory is
  freed into the arena of the thread that compiled, where glibc keeps it (a worker thread's
  arena is never trimmed on its own). A no-op off glibc."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  return bool(ctypes.CDLL(None).malloc_trim(0))
