"""host_memory: freed XLA CPU temporaries are kept by malloc, counted in page faults per call."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from atlas_jax import host_memory

# A program whose temporaries (the [2048, 8192] float32 sine and its cumulative sum, which XLA
# materialises before reversing it: 128 MiB, past glibc's largest mmap threshold) are allocated
# and freed on every call. The child prints their bytes and each call's minor page faults; it
# waits a moment after each call, since the runtime frees the temporaries on its own thread
# after the result is ready.
_CHILD = textwrap.dedent(
  """
  import json, resource, sys, time
  from atlas_jax import host_memory
  CALLS = 16
  if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory().startswith("glibc malloc keeps"), "not applied"
  import jax, jax.numpy as jnp
  x = jnp.ones((2048, 8192), jnp.float32)
  f = jax.jit(lambda x: jnp.sum(jnp.cumsum(jnp.sin(x), axis=0)[::-1][:8]))
  compiled = f.lower(x).compile()
  faults = []
  for _ in range(CALLS):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    compiled(x).block_until_ready()
    time.sleep(0.05)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  print(json.dumps({"temp": compiled.memory_analysis().temp_size_in_bytes, "faults": faults}))
  """
)


def _run_child(script: str, mode: str):
  """What `script` prints last (JSON), run in a fresh process with malloc's policy applied
  ("keep") or left as glibc's default ("system"), whatever this environment sets."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
  env.pop("LD_PRELOAD", None)
  env["ATLAS_JAX_MALLOC"] = "auto" if mode == "keep" else "system"
  # XLA's own optimisation: the suite's compile-fast flags (tests/conftest.py) leave the sine and
  # the sum unoptimised, which doubles the child's time for the same temporaries.
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
    [sys.executable, "-c", script, mode], env=env, capture_output=True, text=True, check=True
  ).stdout
  return json.loads(out.strip().splitlines()[-1])


def _faults(mode: str) -> tuple[int, list[int]]:
  got = _run_child(_CHILD, mode)
  return got["temp"] // os.sysconf("SC_PAGE_SIZE"), got["faults"]


@pytest.mark.skipif(
  platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
def test_freed_temporaries_are_not_faulted_in_again():
  pages, system = _faults("system")
  assert pages >= 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
  fresh = lambda faults: sum(f >= 0.9 * pages for f in faults)  # calls that faulted all in
  # glibc's default: every call maps its temporaries afresh and faults each page in.
  assert fresh(system) == len(system) == 16, (system, pages)
  pages_kept, kept = _faults("keep")
  assert pages_kept == pages
  # Kept: the heap grows by a copy only while the freed ones are not yet free or not yet
  # reusable (glibc's best fit; one to four calls here, under load too); the other calls reuse
  # freed memory and fault nothing in.
  assert fresh(kept) <= 6, (kept, pages)
  assert sum(f < pages // 50 for f in kept) >= 10, (kept, pages)


# A buffer past 2 GiB, glibc's largest positive trim threshold, written, freed and taken again:
# the child prints each pass's minor page faults.
_TRIM_CHILD = textwrap.dedent(
  """
  import ctypes, json, resource, sys
  from atlas_jax import host_memory
  if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory().startswith("glibc malloc keeps"), "not applied"
  libc = ctypes.CDLL(None)
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
  n = 5 << 29  # 2.5 GiB
  faults = []
  for _ in range(2):
    p = libc.malloc(n)
    assert p, "malloc failed"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    libc.memset(p, 1, n)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(p)
  print(json.dumps(faults))
  """
)


@pytest.mark.skipif(
  platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
@pytest.mark.slow
def test_a_freed_heap_top_past_2_gib_is_kept():
  """Trimming is off, not merely at its largest threshold: a 2.5 GiB buffer freed at the heap's
  top is taken again without a page fault (at a threshold of 2 GiB it would be returned to the
  system and faulted in again, as the small preset's training step was)."""
  first, again = _run_child(_TRIM_CHILD, "system")
  assert again >= 0.9 * first > 0, (first, again)  # glibc's default maps it afresh each time
  first, again = _run_child(_TRIM_CHILD, "keep")
  assert first > 0 and again <= 0.01 * first, (first, again)


def test_the_users_allocator_choice_is_left_alone():
  assert host_memory.users_choice({}) is None
  assert host_memory.users_choice({"ATLAS_JAX_MALLOC": "auto"}) is None
  assert host_memory.users_choice({"ATLAS_JAX_MALLOC": "system"}) == "ATLAS_JAX_MALLOC=system"
  preload = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}
  assert host_memory.users_choice(preload) == "tcmalloc in LD_PRELOAD"
  assert host_memory.users_choice({"LD_PRELOAD": "libfoo.so"}) is None
  tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
  assert host_memory.users_choice(tunables) == "glibc.malloc tunables in GLIBC_TUNABLES"
  assert host_memory.users_choice({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
  assert host_memory.users_choice({"MALLOC_ARENA_MAX": "2"}) == "MALLOC_ARENA_MAX set"
  with pytest.raises(ValueError, match="ATLAS_JAX_MALLOC='keep'.*auto, system"):
    host_memory.users_choice({"ATLAS_JAX_MALLOC": "keep"})
  # The policy is not applied where the user chose: nothing is called, the reason is returned.
  left = host_memory.keep_freed_memory(preload)
  assert left == "left as the environment sets it (tcmalloc in LD_PRELOAD)"


_ARENA_CHILD = """
import ctypes, re, threading
from pathlib import Path
from atlas_jax import host_memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text())[1])

def churn():  # blocks of a compiler's working memory, in this thread's arena, each between
  # two that stay: freed, none coalesces into the heap's top, where free() itself would trim
  blocks, pins = [], []
  for _ in range(4_000):
    blocks.append(libc.malloc(65536))
    pins.append(libc.malloc(64))
  for b in blocks:
    ctypes.memset(b, 1, 65536)
  for b in blocks:
    libc.free(b)
  kept.extend(pins)

kept = []

t = threading.Thread(target=churn)
t.start()
t.join()
before = rss()
host_memory.return_freed_memory()
print(before, rss())
"""


@pytest.mark.skipif(
  platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
def test_freed_memory_in_a_threads_arena_goes_back_to_the_system():
  """What a compile thread frees between memory it still holds stays in its malloc arena until
  `return_freed_memory`: 256 MB of 64 KiB blocks a worker thread freed, each between two blocks
  it keeps, are resident until then, and go back to the system."""
  out = subprocess.run(
    [sys.executable, "-c", _ARENA_CHILD], capture_output=True, text=True, check=True
  ).stdout
  before, after = map(int, out.split())
  assert before - after > 150_000, (before, after)  # kB
