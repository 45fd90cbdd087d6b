"""Mixture-of-experts layers: the experts' computation, the routers' load, expert-parallel dispatch.

    python bench/moe.py [--only experts|routers|dispatch] [--repeats 5] [--calls 5]

* experts: the grouped matmul (`grouped_experts`: tokens sorted by expert, `jax.lax.ragged_dot`)
  against the dense one-hot reference (`dense_experts`: every expert on every token), a
  per-expert loop (each expert's matmuls on exactly its rows, the routing known when the
  program is built, as transformers' eager loop runs) and GShard's capacity slots
  (`capacity_experts`, factor 1.25), at several token and expert counts: CPU milliseconds
  (interleaved, median over repeats) and the compiled programs' FLOPs and bytes accessed.
* routers: tokens per expert under each router on random tokens: the busiest expert's share over
  the mean, and the experts no token chose.
* dispatch: expert parallelism over 8 (fake CPU) devices, the library's all-gather + local
  experts + reduce-scatter (`expert_parallel`) against an all-to-all that sends each assignment
  to its expert's device (dropless, and with capacity 1.25): the bytes the compiled programs'
  collectives move per device, their FLOPs and bytes accessed. What `atlas_jax.model.moe`
  chose, and why, rests on this.

Prints the versions, the CPU count and the load average before and after.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import atlas_jax  # noqa: E402
from atlas_jax.config import MoEConfig  # noqa: E402
from atlas_jax.model.moe import (  # noqa: E402
  _grouped_f32,
  capacity,
  capacity_experts,
  dense_experts,
  expert_parallel,
  grouped_experts,
  route,
)

D, F = 256, 256  # model and expert width of the experts section


def inputs(t: int, E: int, k: int, *, D: int = D, F: int = F, seed: int = 0):
  """(x_tD, experts_tk, weights_tk, w_gate_EDF, w_up_EDF, w_down_EFD): tokens routed by a random
  softmax router, so the loads are a router's, not uniform."""
  keys = jax.random.split(jax.random.key(seed), 5)
  x_tD = jax.random.normal(keys[0], (t, D))
  cfg = MoEConfig(n_experts=E, top_k=k, expert_ffn_dim=F)
  logits_tE = x_tD @ (jax.random.normal(keys[1], (D, E)) / math.sqrt(D))
  experts_tk, weights_tk, _ = route(logits_tE, cfg)
  w = [
    0.05 * jax.random.normal(keys[i], s)
    for i, s in ((2, (E, D, F)), (3, (E, D, F)), (4, (E, F, D)))
  ]
  return x_tD, experts_tk, weights_tk, *w


def per_expert_loop(experts_tk: np.ndarray, E: int):
  """The experts one by one, each on exactly its rows: the rows are read off a concrete routing
  when the program is built (one program per routing, as an eager loop would run)."""
  t, k = experts_tk.shape
  rows = [np.nonzero(experts_tk == e) for e in range(E)]

  def run(x_tD, experts_tk, weights_tk, w_gate, w_up, w_down):
    y_tD = jnp.zeros(x_tD.shape, jnp.float32)
    for e, (tok, choice) in enumerate(rows):
      if tok.size == 0:
        continue
      x = x_tD[tok]
      h = jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])
      y_tD = y_tD.at[tok].add((h @ w_down[e]) * weights_tk[tok, choice][:, None])
    return y_tD.astype(x_tD.dtype)

  return run


def cost(fn, *args) -> tuple[float, float]:
  """(FLOPs, bytes accessed) of `fn`'s compiled program, from XLA's cost analysis."""
  c = jax.jit(fn).lower(*args).compile().cost_analysis()
  c = c[0] if isinstance(c, list) else c
  return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def experts_section(args) -> None:
  print("\n## experts: one MoE layer's routed experts, D = F = 256, f32, CPU\n")
  print(
    "| tokens | E | k | grouped ms | dense ref ms | per-expert loop ms | capacity 1.25 ms "
    "| dense / grouped | grouped GFLOP | dense GFLOP | loop GFLOP | grouped MB | dense MB |"
  )
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for t, E, k in ((256, 8, 2), (1024, 8, 2), (4096, 8, 2), (1024, 64, 6), (4096, 64, 6)):
    a = inputs(t, E, k)
    slots = capacity(MoEConfig(n_experts=E, top_k=k, expert_ffn_dim=F, capacity_factor=1.25), t)
    capped = lambda *x, slots=slots: capacity_experts(*x, slots=slots)[0]
    arms = {
      "grouped": jax.jit(grouped_experts),
      "dense": jax.jit(dense_experts),
      "loop": jax.jit(per_expert_loop(np.asarray(a[1]), E)),
      "capacity": jax.jit(capped),
    }
    for fn in arms.values():
      jax.block_until_ready(fn(*a))
    times = {name: [] for name in arms}
    for _ in range(args.repeats):  # interleaved, so load drifts hit every arm alike
      for name, fn in arms.items():
        t0 = time.perf_counter()
        for _ in range(args.calls):
          out = fn(*a)
        jax.block_until_ready(out)
        times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
    ms = {name: statistics.median(v) for name, v in times.items()}
    (gf, gb), (df, db) = cost(grouped_experts, *a), cost(dense_experts, *a)
    lf, _ = cost(per_expert_loop(np.asarray(a[1]), E), *a)
    print(
      f"| {t} | {E} | {k} | {ms['grouped']:.2f} | {ms['dense']:.2f} | {ms['loop']:.2f} "
      f"| {ms['capacity']:.2f} | {ms['dense'] / ms['grouped']:.2f}x | {gf / 1e9:.3f} "
      f"| {df / 1e9:.3f} | {lf / 1e9:.3f} | {gb / 1e6:.1f} | {db / 1e6:.1f} |"
    )
  print(
    "\nFLOPs of the k active experts alone: 6 t k D F (at 4096 tokens, E 64, k 6: "
    f"{6 * 4096 * 6 * D * F / 1e9:.3f} GFLOP)."
  )


ROUTERS = {
  "Mixtral (softmax top-2 of 8)": MoEConfig(n_experts=8, top_k=2),
  "Qwen3-MoE (softmax top-8 of 128)": MoEConfig(n_experts=128, top_k=8),
  "DeepSeek-V2 (softmax, group-limited top-6 of 160, 3 of 8 groups)": MoEConfig(
    n_experts=160,
    top_k=6,
    topk_method="group_limited_greedy",
    n_group=8,
    topk_group=3,
    norm_topk_prob=False,
  ),
  "DeepSeek-V3 (sigmoid noaux_tc top-8 of 256, 4 of 8 groups)": MoEConfig(
    n_experts=256,
    top_k=8,
    scoring="sigmoid",
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
  ),
}


def routers_section(args) -> None:
  t, Dr = 16384, 512
  print(f"\n## routers: tokens per expert, {t} random tokens, D = {Dr}, random router weights\n")
  print("| router | mean tokens per expert | busiest / mean | quietest / mean | experts unused |")
  print("|---|---:|---:|---:|---:|")
  keys = jax.random.split(jax.random.key(1), 2)
  x_tD = jax.random.normal(keys[0], (t, Dr))
  for name, cfg in ROUTERS.items():
    w_DE = jax.random.normal(keys[1], (Dr, cfg.n_experts)) / math.sqrt(Dr)
    bias = jnp.zeros(cfg.n_experts) if cfg.topk_method == "noaux_tc" else None
    experts_tk, _, _ = jax.jit(functools.partial(route, cfg=cfg))(x_tD @ w_DE, bias_E=bias)
    load = np.bincount(np.asarray(experts_tk).ravel(), minlength=cfg.n_experts)
    mean = load.mean()
    print(
      f"| {name} | {mean:.0f} | {load.max() / mean:.2f} | {load.min() / mean:.2f} "
      f"| {int((load == 0).sum())} |"
    )


# -- expert-parallel dispatch ---------------------------------------------------------------------


def all_to_all_experts(mesh, *, slots_per_device: int | None):
  """The peer of `expert_parallel`: each device sends each of its assignments to the device
  holding its expert with one all-to-all of [ep, C, D] buffers (C slots per destination; the
  dropless C is every local assignment), the experts run on what arrived, and a second
  all-to-all brings the outputs back. Tokens and experts split over the mesh's one axis."""
  (axis,) = mesh.axis_names
  ep = mesh.shape[axis]

  def local(x_tD, experts_tk, weights_tk, w_gate, w_up, w_down):
    t, k = experts_tk.shape
    E_local, D = w_gate.shape[0], x_tD.shape[1]
    a = t * k
    C = a if slots_per_device is None else slots_per_device
    dest_a = experts_tk.reshape(-1) // E_local
    order_a = jnp.argsort(dest_a, stable=True)
    sizes = jnp.bincount(dest_a, length=ep)
    starts = jnp.cumsum(sizes) - sizes
    rank_sorted = jnp.arange(a) - starts[dest_a[order_a]]
    rank_a = jnp.zeros((a,), jnp.int32).at[order_a].set(rank_sorted.astype(jnp.int32))
    keep_a = rank_a < C
    slot_a = jnp.where(keep_a, dest_a * C + rank_a, ep * C)
    x_aD = jnp.repeat(x_tD, k, axis=0)
    send = jnp.zeros((ep * C, D), x_tD.dtype).at[slot_a].set(x_aD, mode="drop")
    ids = (
      jnp.full((ep * C,), -1, jnp.int32)
      .at[slot_a]
      .set(experts_tk.reshape(-1) % E_local, mode="drop")
    )
    recv = jax.lax.all_to_all(send.reshape(ep, C, D), axis, 0, 0, tiled=False)
    recv_ids = jax.lax.all_to_all(ids.reshape(ep, C), axis, 0, 0, tiled=False)
    ones = jnp.ones((ep * C, 1), jnp.float32)
    out = _grouped_f32(recv.reshape(ep * C, D), recv_ids.reshape(-1, 1), ones, w_gate, w_up, w_down)
    back = jax.lax.all_to_all(out.reshape(ep, C, D), axis, 0, 0, tiled=False).reshape(ep * C, D)
    out_aD = jnp.take(back, slot_a, axis=0, mode="fill", fill_value=0)
    w_a = jnp.where(keep_a, weights_tk.reshape(-1), 0.0)
    return (out_aD * w_a[:, None]).reshape(t, k, D).sum(1).astype(x_tD.dtype)

  tokens = P(axis, None)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(tokens, tokens, tokens, P(axis), P(axis), P(axis)),
    out_specs=tokens,
  )


def collective_bytes(compiled) -> dict[str, float]:
  """Bytes each collective op kind of a compiled program outputs, per device (its shapes are
  one device's)."""
  import step_profile

  computations, _ = step_profile.parse_hlo(compiled.as_text())
  out: dict[str, float] = {}
  for insts in computations.values():
    for inst in insts:
      base = inst.opcode.removesuffix("-start").removesuffix("-done")
      if base in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"):
        if inst.opcode.endswith("-done"):
          continue
        out[base] = out.get(base, 0.0) + step_profile._bytes(inst.shape)
  return out


def dispatch_costs(t: int, E: int, k: int, *, D: int = D, F: int = F, capacity_factor=1.25):
  """{scheme: (collective bytes per device by op, FLOPs, bytes accessed, max |y - reference|)}
  for `t` tokens over 8 devices of one `expert` axis."""
  mesh = Mesh(np.asarray(jax.devices()[:8]), ("expert",))
  a = inputs(t, E, k, D=D, F=F)
  tok, w = NamedSharding(mesh, P("expert", None)), NamedSharding(mesh, P("expert"))
  a = [jax.device_put(x, tok if i < 3 else w) for i, x in enumerate(a)]
  want = grouped_experts(*a)
  per_device = t * k // 8
  schemes = {
    "all-gather + local experts + reduce-scatter (the library's)": lambda *x: expert_parallel(
      mesh.abstract_mesh
    )(*x)[0],
    "all-to-all, dropless": all_to_all_experts(mesh, slots_per_device=None),
    f"all-to-all, capacity {capacity_factor}": all_to_all_experts(
      mesh, slots_per_device=math.ceil(capacity_factor * per_device / 8)
    ),
  }
  out = {}
  for name, fn in schemes.items():
    compiled = jax.jit(fn).lower(*a).compile()
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    err = float(jnp.abs(compiled(*a) - want).max())
    out[name] = (collective_bytes(compiled), float(c["flops"]), float(c["bytes accessed"]), err)
  return out


def dispatch_section(args) -> None:
  print("\n## dispatch: 8 fake CPU devices, experts and tokens split over one `expert` axis\n")
  print(
    "| tokens (all devices) | E | k | scheme | collective MB per device | of which | FLOPs per "
    "device (G) | bytes accessed (MB) | max abs err vs one device |"
  )
  print("|---:|---:|---:|---|---:|---|---:|---:|---:|")
  for t, E, k in ((4096, 8, 2), (4096, 64, 6)):
    for name, (coll, flops, moved, err) in dispatch_costs(t, E, k).items():
      parts = ", ".join(f"{op} {b / 1e6:.2f}" for op, b in sorted(coll.items()))
      print(
        f"| {t} | {E} | {k} | {name} | {sum(coll.values()) / 1e6:.2f} | {parts} "
        f"| {flops / 1e9:.3f} | {moved / 1e6:.1f} | {err:.1e} |"
      )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", choices=("experts", "routers", "dispatch"))
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--calls", type=int, default=5)
  args = ap.parse_args()
  load0 = os.getloadavg()
  print(
    f"jax {jax.__version__} ({jax.default_backend()}), atlas_jax {atlas_jax.__version__}, "
    f"{platform.machine()}, {os.cpu_count()} cpus; load average {load0[0]:.2f} "
    f"{load0[1]:.2f} {load0[2]:.2f} before"
  )
  sections = {"experts": experts_section, "routers": routers_section, "dispatch": dispatch_section}
  for name, section in sections.items():
    if args.only in (None, name):
      section(args)
  load1 = os.getloadavg()
  print(f"\nload average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} after")


if __name__ == "__main__":
  main()
