"""Where a compiled step's work goes: FLOPs, bytes and measured device time per op class.

Two sources, joined on the optimized HLO's instruction names:

* `hlo_account(hlo_text)` walks the compiled module's HLO text and prices every instruction the
  way XLA's `HloCostAnalysis` does (a dot: 2 x output elements x contracted size; an elementwise
  op: one FLOP, or one transcendental, per output element; a reduce: its combiner's cost per
  folded element; fusions and calls: their computations' sums), so the classes add up to
  `compiled.cost_analysis()` exactly. XLA prices a `while` body once; the account also scales
  loop bodies by their known trip counts (`per_step`), which is what the step really runs: a
  scanned layer stack is L bodies, not one.
* `device_times(xspace_path, account)` sums a `jax.profiler` trace's device events per class,
  matching each event to the HLO instruction it ran (the `hlo_op` stat, or a kernel named after
  the instruction).

Op classes, first match wins for each instruction: collectives; attention (ops under the
`attention_core` named scope the model puts around its attention kernel call, or cuDNN / Pallas
custom calls); elementwise for RoPE's tables (the `rope_tables` scope: on a CPU, a product with
the identity that writes cos and sin once, `model.rope.rotation_tables`); matmuls (dot,
convolution, cuBLAS custom calls); optimizer and loss (ops under the `optimizer` and `loss` named
scopes, matmuls excepted: the LM head inside the chunked loss counts as a matmul); reductions;
elementwise; data movement (copies, slices, transposes: no FLOPs).
A fusion's FLOPs are split over the instructions inside it; its bytes and its measured time go to
one class: that of its costliest instruction.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

CLASSES = (
  "matmul",
  "attention",
  "kv cache write",
  "sampling",
  "elementwise",
  "reduction",
  "loss",
  "optimizer",
  "collective",
  "data movement",
)

# Named scopes the model, the loss and the train step put around their ops; the caches around
# their writes and the sampler around its draw.
ATTENTION_SCOPE, LOSS_SCOPE, OPTIMIZER_SCOPE = "attention_core", "loss", "optimizer"
CACHE_WRITE_SCOPE, SAMPLING_SCOPE, ROPE_TABLES_SCOPE = "kv_cache_write", "sampling", "rope_tables"

_DTYPE_BYTES = {
  "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
  "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_TRANSCENDENTAL = {
  "exponential", "exponential-minus-one", "log", "log-plus-one", "power", "sqrt", "rsqrt", "cbrt",
  "tanh", "sine", "cosine", "tan", "atan2", "logistic", "erf",
}  # fmt: skip
_ELEMENTWISE = _TRANSCENDENTAL | {
  "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "negate", "abs",
  "sign", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "and", "or", "xor", "not",
  "compare", "select", "clamp", "convert", "is-finite", "reduce-precision", "shift-left",
  "shift-right-logical", "shift-right-arithmetic", "popcnt", "count-leading-zeros", "real",
  "imag", "complex", "stochastic-convert",
}  # fmt: skip
_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-)")
_CONTROL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all"}
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")
# cuDNN attention and Pallas kernels (Triton / Mosaic GPU / TPU) reach HLO as custom calls.
_ATTENTION_TARGETS = ("__cudnn$fmha", "__gpu$xla.gpu.triton", "mosaic_gpu", "tpu_custom_call")


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shape: str  # the HLO shape text: "f32[8,16]{1,0}" or a tuple "(s32[], f32[8,16]{1,0})"
  operands: list[str]
  attrs: str  # everything after the operand list
  op_name: str  # metadata op_name: the jax name stack, named scopes included


@dataclasses.dataclass
class Cost:
  flops: float = 0.0
  transcendentals: float = 0.0
  bytes: float = 0.0

  def add(self, other: Cost, times: float = 1.0) -> None:
    self.flops += other.flops * times
    self.transcendentals += other.transcendentals * times
    self.bytes += other.bytes * times


@dataclasses.dataclass
class Account:
  """A step's cost per op class, as XLA counts it (`xla`: loop bodies once) and as it runs
  (`per_step`: loop bodies times their trip counts), and the class of every executed
  instruction (the key that joins a profiler trace to the account)."""

  xla: dict[str, Cost]
  per_step: dict[str, Cost]
  instruction_class: dict[str, str]
  unpriced: set[str]  # opcodes met that carry cost in XLA but not in this walk

  def total(self, per_step: bool = True) -> Cost:
    out = Cost()
    for cost in (self.per_step if per_step else self.xla).values():
      out.add(cost)
    return out


# -- parsing -------------------------------------------------------------------------------------


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group that opens at text[start]."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, i = [], start
  while i < len(text):
    c = text[i]
    if c == '"':  # strings in backend configs may hold brackets
      i = text.index('"', i + 1)
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
    i += 1
  return len(text)


_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """Computations of an HLO module's text: {name: instructions in order}, and the entry's name."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header and "=" not in line.split("(")[0]:
        current = header.group(2)
        computations[current] = []
        entry = current if header.group(1) else entry
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _LINE.match(line)
    if not m:
      continue
    rest = line[m.end() :]
    shape_end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
      continue
    args_end = _balanced(rest, op.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[op.end() : args_end - 1])
    attrs = rest[args_end:]
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    computations[current].append(
      Instruction(
        m.group(1), op.group(1), shape, operands, attrs, op_name.group(1) if op_name else ""
      )
    )
  if entry is None:
    raise ValueError("hlo_text: no ENTRY computation found; pass the compiled module's as_text()")
  return computations, entry


def _arrays(shape: str) -> list[tuple[str, list[int]]]:
  return [
    (dtype, [int(d) for d in dims.split(",") if d])
    for dtype, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]", shape)
    if dtype in _DTYPE_BYTES
  ]


def _elements(shape: str, index: int = 0) -> int:
  arrays = _arrays(shape)
  return math.prod(arrays[index][1]) if arrays else 0


def _bytes(shape: str) -> int:
  return sum(_DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in _arrays(shape))


def _dims(attrs: str, key: str) -> list[int]:
  m = re.search(key + r"=\{([\d,]*)\}", attrs)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(key + r"=\{?%?([^,}\s]+(?:,\s*%[^,}\s]+)*)\}?", attrs)
  return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []


def _trip_count(attrs: str) -> int:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  return int(m.group(1)) if m else 1


def _in_scope(scope: str, op_name: str) -> bool:
  """Whether an op_name ("jit(step)/transpose(jvp(loss))/while/body/...") lies in a named scope:
  autodiff wraps scopes as jvp(loss) or transpose(jvp(loss))."""
  return re.search(rf"(^|[/(]){re.escape(scope)}($|[/)])", op_name) is not None


def _custom_call_target(attrs: str) -> str:
  m = re.search(r'custom_call_target="([^"]*)"', attrs)
  return m.group(1) if m else ""


# -- pricing -------------------------------------------------------------------------------------


class _Walker:
  def __init__(self, text: str):
    self.computations, self.entry = parse_hlo(text)
    self.shapes = {i.name: i.shape for insts in self.computations.values() for i in insts}
    self.xla = {c: Cost() for c in CLASSES}
    self.per_step = {c: Cost() for c in CLASSES}
    self.instruction_class: dict[str, str] = {}
    self.unpriced: set[str] = set()

  def _leaf_class(self, inst: Instruction) -> str:
    """The class of one instruction's own work (no called computations)."""
    op, name = inst.opcode, inst.op_name
    if _COLLECTIVE.match(op):
      return "collective"
    target = _custom_call_target(inst.attrs) if op == "custom-call" else ""
    if _in_scope(ATTENTION_SCOPE, name) or any(t in target for t in _ATTENTION_TARGETS):
      return "attention"
    if _in_scope(ROPE_TABLES_SCOPE, name):
      return "elementwise"
    if op in ("dot", "convolution") or target in _GEMM_TARGETS:
      return "matmul"
    if _in_scope(CACHE_WRITE_SCOPE, name):
      return "kv cache write"
    if _in_scope(SAMPLING_SCOPE, name):
      return "sampling"
    if _in_scope(OPTIMIZER_SCOPE, name):
      return "optimizer"
    if _in_scope(LOSS_SCOPE, name):
      return "loss"
    if op in ("reduce", "reduce-window", "scatter", "select-and-scatter", "sort"):
      return "reduction"
    if op in _ELEMENTWISE:
      return "elementwise"
    return "data movement"

  def _sub(self, name: str) -> Cost:
    """FLOPs of a scalar combiner (the computation a reduce or scatter applies)."""
    cost = Cost()
    for inst in self.computations.get(name, []):
      if inst.opcode in _ELEMENTWISE:
        key = "transcendentals" if inst.opcode in _TRANSCENDENTAL else "flops"
        setattr(cost, key, getattr(cost, key) + _elements(inst.shape))
    return cost

  def _own_flops(self, inst: Instruction) -> Cost:
    """XLA's FLOP and transcendental count for an instruction without called computations."""
    op, out = inst.opcode, _elements(inst.shape)
    if op in _TRANSCENDENTAL:
      return Cost(transcendentals=out)
    if op in _ELEMENTWISE:
      return Cost(flops=out)
    if op == "dot":
      lhs = _arrays(self.shapes[inst.operands[0]])[0][1]
      contracted = math.prod(lhs[d] for d in _dims(inst.attrs, "lhs_contracting_dims"))
      return Cost(flops=2 * out * contracted)
    if op == "custom-call" and _custom_call_target(inst.attrs) in _GEMM_TARGETS:
      lhs = _arrays(self.shapes[inst.operands[0]])[0][1]
      m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
      dims = [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip()] if m else []
      return Cost(flops=2 * out * math.prod(lhs[d] for d in dims))
    if op == "convolution":
      # 2 x output elements x (kernel elements / output features).
      rhs = _arrays(self.shapes[inst.operands[1]])[0][1]
      labels = re.search(r"dim_labels=\w+_(\w+)->", inst.attrs)
      features = rhs[labels.group(1).index("o")] if labels else 1
      return Cost(flops=2 * out * math.prod(rhs) // features)
    if op == "reduce":
      folded = _elements(self.shapes[inst.operands[0]]) - out
      sub = self._sub(_called(inst.attrs, "to_apply")[0])
      return Cost(sub.flops * folded, sub.transcendentals * folded)
    if op == "reduce-window":
      window = re.search(r"window=\{size=([\dx]+)", inst.attrs)
      size = math.prod(int(s) for s in window.group(1).split("x")) if window else 1
      sub = self._sub(_called(inst.attrs, "to_apply")[0])
      return Cost(sub.flops * out * (size - 1), sub.transcendentals * out * (size - 1))
    if op == "scatter":
      updates = _elements(self.shapes[inst.operands[-1]])
      sub = self._sub(_called(inst.attrs, "to_apply")[0])
      return Cost(sub.flops * updates, sub.transcendentals * updates)
    if op in ("all-reduce", "all-reduce-start", "reduce-scatter"):
      sub = self._sub(_called(inst.attrs, "to_apply")[0])
      return Cost(sub.flops * out, sub.transcendentals * out)
    if op in ("sort", "select-and-scatter", "map", "rng", "fft", "triangular-solve", "cholesky"):
      self.unpriced.add(op)
    return Cost()

  def _bytes_of(self, inst: Instruction) -> float:
    """Bytes an executed instruction reads and writes (operands plus result; none for the
    bookkeeping ops that move no data)."""
    if inst.opcode in _CONTROL or inst.opcode in ("while", "call", "conditional"):
      return 0.0
    if inst.opcode in ("dynamic-slice", "slice"):
      return 2.0 * _bytes(inst.shape)
    if inst.opcode == "dynamic-update-slice":
      return 2.0 * _bytes(self.shapes[inst.operands[1]])
    return float(_bytes(inst.shape) + sum(_bytes(self.shapes[o]) for o in inst.operands))

  def fused_flops(self, computation: str) -> dict[str, Cost]:
    """FLOPs per class inside a fused (or called) computation, nested calls included."""
    out: dict[str, Cost] = defaultdict(Cost)
    for inst in self.computations[computation]:
      for cls, cost in self._inner(inst).items():
        out[cls].add(cost)
    return out

  def _inner(self, inst: Instruction) -> dict[str, Cost]:
    if inst.opcode == "fusion" or (inst.opcode == "call" and "to_apply" in inst.attrs):
      return self.fused_flops(
        _called(inst.attrs, "calls" if inst.opcode == "fusion" else "to_apply")[0]
      )
    return {self._leaf_class(inst): self._own_flops(inst)}

  def walk(self, computation: str, times: int) -> None:
    """Prices the executed instructions of `computation`, run `times` times per step."""
    for inst in self.computations[computation]:
      if inst.opcode == "while":
        trips = _trip_count(inst.attrs)
        for key in ("body", "condition"):
          self._walk_nested(_called(inst.attrs, key)[0], times, trips)
        continue
      if inst.opcode == "conditional":
        branches = _called(inst.attrs, "branch_computations") or (
          _called(inst.attrs, "true_computation") + _called(inst.attrs, "false_computation")
        )
        # As XLA's cost analysis does: the costliest branch (a step's optimizer update under the
        # finite check runs the update, not the branch that keeps the state).
        self._walk_nested(max(branches, key=self._branch_flops), times, 1)
        continue
      if inst.opcode == "call" and "to_apply" in inst.attrs:
        self._walk_nested(_called(inst.attrs, "to_apply")[0], times, 1)
        continue
      parts = self._inner(inst)
      cls = max(parts, key=lambda c: (parts[c].flops + parts[c].transcendentals, c == "matmul"))
      if inst.opcode == "fusion":  # a fusion around a custom call or a scoped op takes its class
        inners = {self._leaf_class(i) for i in self.computations[_called(inst.attrs, "calls")[0]]}
        for special in ("attention", "collective"):
          cls = special if special in inners else cls
      self.instruction_class[inst.name] = cls
      moved = self._bytes_of(inst)
      # XLA prices a loop body once whatever its trip count; `per_step` runs it `times` times.
      for part, cost in parts.items():
        self.xla[part].add(cost)
        self.per_step[part].add(cost, times)
      self.xla[cls].bytes += moved
      self.per_step[cls].bytes += moved * times

  def _walk_nested(self, computation: str, times: int, trips: int) -> None:
    self.walk(computation, times * trips)

  def _branch_flops(self, computation: str) -> float:
    """FLOPs of one run of `computation`, walked on copies (the account is left as it was)."""
    saved = (self.xla, self.per_step)
    self.xla = {c: Cost() for c in CLASSES}
    self.per_step = {c: Cost() for c in CLASSES}
    try:
      self.walk(computation, 1)
      return sum(c.flops + c.transcendentals for c in self.per_step.values())
    finally:
      self.xla, self.per_step = saved


def hlo_account(hlo_text: str) -> Account:
  """FLOPs, transcendentals and bytes per op class of a compiled module's HLO text
  (`jax.jit(f).lower(...).compile().as_text()`)."""
  walker = _Walker(hlo_text)
  walker.walk(walker.entry, 1)
  return Account(walker.xla, walker.per_step, walker.instruction_class, walker.unpriced)


# -- measured time -------------------------------------------------------------------------------

# Lines a profiler adds on top of the kernels (whole modules, steps): summing them would count
# the same time twice.
_AGGREGATE_LINES = ("XLA Modules", "Steps", "XLA TraceMe", "Framework", "Source code")


def device_times(
  xspace_path: str, account: Account, *, steps: int, plane_prefix: str = "/device:"
) -> tuple[dict[str, float], float, list[tuple[str, float]]]:
  """Seconds per step of device time per op class, from a `jax.profiler.trace` capture.

  Args:
    xspace_path: the capture's `*.xplane.pb`.
    account: `hlo_account` of the module that ran; its instruction names join events to classes.
    steps: steps the capture holds (the sums are divided by it).
    plane_prefix: planes to read: "/device:" for accelerators ("/host:CPU" reads the CPU
      backend's thunks, whose events overlap across threads).

  Returns:
    ({class: seconds per step}, unmatched seconds per step, the largest unmatched event names).
  """
  from jax.profiler import ProfileData

  names = account.instruction_class
  # GPU kernels are named after their instruction with '.' -> '_' ("loop_add_fusion_3").
  underscored = {n.replace(".", "_"): c for n, c in names.items()}
  times: dict[str, float] = defaultdict(float)
  unmatched: dict[str, float] = defaultdict(float)
  data = ProfileData.from_file(xspace_path)
  for plane in data.planes:
    if not plane.name.startswith(plane_prefix):
      continue
    lines = [ln for ln in plane.lines if not ln.name.startswith(_AGGREGATE_LINES)]
    streams = [ln for ln in lines if ln.name.startswith("Stream")]
    for line in streams or lines:
      for event in line.events:
        seconds = event.duration_ns * 1e-9
        if seconds <= 0:
          continue
        cls = _event_class(event, names, underscored)
        if cls is None:
          unmatched[event.name] += seconds
        else:
          times[cls] += seconds
  top = sorted(unmatched.items(), key=lambda kv: -kv[1])[:5]
  return (
    {c: t / steps for c, t in times.items()},
    sum(unmatched.values()) / steps,
    [(n, t / steps) for n, t in top],
  )


def _event_class(event, names: dict[str, str], underscored: dict[str, str]) -> str | None:
  stats = {}
  for key, value in event.stats:
    stats[key] = value
  hlo_op = stats.get("hlo_op")
  if isinstance(hlo_op, str) and hlo_op in names:
    return names[hlo_op]
  # Otherwise any instruction name in the event's name or string stats (annotations).
  texts = [event.name] + [v for v in stats.values() if isinstance(v, str)]
  for text in texts:
    for token in re.findall(r"[\w.\-]+", text):
      if token in names:
        return names[token]
      if token in underscored:
        return underscored[token]
  return None


# -- report --------------------------------------------------------------------------------------


def markdown_table(
  account: Account,
  *,
  measured: dict[str, float] | None = None,
  unmatched_s: float = 0.0,
  step_s: float | None = None,
) -> str:
  """op class | FLOPs | share | bytes | measured ms | share of step time, per step."""
  total = account.total()
  rows = [
    "| op class | FLOPs per step | share | bytes accessed | measured ms | share of step time |",
    "|---|---|---|---|---|---|",
  ]
  for cls in CLASSES:
    cost = account.per_step[cls]
    ms = measured.get(cls) if measured is not None else None
    if not cost.flops and not cost.bytes and not ms:
      continue
    rows.append(
      f"| {cls} | {cost.flops:.4g} | {_share(cost.flops, total.flops)} | {cost.bytes:.4g} | "
      f"{'-' if ms is None else f'{ms * 1e3:.2f}'} | "
      f"{'-' if ms is None or not step_s else _share(ms, step_s)} |"
    )
  if measured is not None:
    rows.append(
      f"| unattributed device time | - | - | - | {unmatched_s * 1e3:.2f} | "
      f"{_share(unmatched_s, step_s) if step_s else '-'} |"
    )
  busy = sum(measured.values()) + unmatched_s if measured is not None else None
  rows.append(
    f"| total | {total.flops:.4g} | 100% | {total.bytes:.4g} | "
    f"{'-' if busy is None else f'{busy * 1e3:.2f}'} | "
    f"{'-' if busy is None or not step_s else _share(busy, step_s)} |"
  )
  return "\n".join(rows)


def _share(part: float, whole: float) -> str:
  return f"{part / whole:.1%}" if whole else "-"
