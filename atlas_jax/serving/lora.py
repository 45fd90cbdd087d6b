"""Many LoRA adapters served over one base model (vLLM's `--enable-lora`).

The model holds every served adapter in one pair of arrays per targeted projection
(`atlas_jax.model.lora.SlotAdapters`: [L, S, *in, A] and [L, S, A, *out]; slot 0 the base's
zeros), and each request names its adapter's slot; the step record carries the slot of every new
token (`StepRecord.adapter_RT`), so one step mixes adapters and the base. `ServedAdapters` keeps
the names: it reads PEFT folders (what `python -m atlas_jax.hf export --adapters separate`
writes, and what peft's `save_pretrained` writes), lays each adapter out as the held arrays hold
it (ranks zero-padded to `max_lora_rank`, alpha / r, or alpha / sqrt(r) for rsLoRA, folded into
`b`), and writes it into a free slot of the held state, or zeroes a slot it frees. The arrays keep
their shapes, so loading at run time compiles nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.model.lora import SERVED_TARGETS, serve_adapters
from atlas_jax.model.transformer import layer_stacks

# A PEFT tensor's name: base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}...
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
  """An adapter that cannot be served, or a name that is not; `field` names the request field."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class Adapter:
  """A served adapter."""

  name: str
  path: str
  slot: int  # its index in the held arrays (1..max_loras)
  rank: int
  targets: tuple[str, ...]  # the projections it adapts (Hugging Face names)
  generation: int = 0  # which load of the server's this is (a name loaded again gets a new one)

  @property
  def cache_salt(self) -> bytes:
    """Its identity in the prefix cache's block hashes: K/V computed under it are shared with
    its own requests only, and never with a later load of the same name (other weights)."""
    return f"lora:{self.name}:{self.generation}".encode()


@dataclasses.dataclass(frozen=True)
class _Held:
  """Where one target's adapter arrays sit in the model's state, and their shapes."""

  stack: str  # "blocks" or "dense_blocks"
  part: str  # "attn" or "mlp"
  attr: str  # the weight's attribute ("wq"); its adapters are f"{attr}_lora"
  n_layers: int
  ins: tuple[int, ...]
  outs: tuple[int, ...]


class ServedAdapters:
  """The adapters a server holds over `model`'s base weights, up to `max_loras` at once, each of
  rank up to `max_lora_rank`. Building it gives every targetable projection of `model` its
  slot arrays (`serve_adapters`), so build it before the engine splits the model.

  Raises:
    ConfigError for a model that cannot serve adapters (see `serve_adapters`).
  """

  def __init__(self, model, *, max_loras: int, max_lora_rank: int):
    self.cfg = model.cfg
    self.max_loras, self.max_rank = max_loras, max_lora_rank
    self.targets = serve_adapters(model, n_slots=max_loras + 1, rank=max_lora_rank)
    self.layers = layer_stacks(self.cfg)  # layer -> (stack, index in it)
    self.held: dict[str, list[_Held]] = {}
    for stack in ("blocks", "dense_blocks"):
      module = getattr(model, stack, None)
      for target, (part, attr, n_in) in SERVED_TARGETS.items():
        lora = getattr(getattr(module, part, None), f"{attr}_lora", None)
        if module is None or lora is None or not hasattr(lora, "n_in"):
          continue
        shape = getattr(getattr(module, part), attr).shape  # [L, *in, *out]
        h = _Held(stack, part, attr, shape[0], tuple(shape[1 : 1 + n_in]), tuple(shape[1 + n_in :]))
        self.held.setdefault(target, []).append(h)
    self.by_name: dict[str, Adapter] = {}
    self._lock = threading.Lock()  # loads and unloads, one at a time
    self._n_loads = 0

  # -- names ---------------------------------------------------------------------------------------

  def names(self) -> list[str]:
    return list(self.by_name)

  def slot_of(self, name: str | None) -> int:
    """The slot serving adapter `name` (None: the base, slot 0).

    Raises:
      AdapterError naming the adapter when it is not loaded.
    """
    return 0 if name is None else self.get(name).slot

  def get(self, name: str) -> Adapter:
    """The loaded adapter `name`; AdapterError naming it when it is not loaded."""
    adapter = self.by_name.get(name)
    if adapter is None:
      loaded = ", ".join(repr(n) for n in self.by_name) or "none"
      raise AdapterError(
        f"the LoRA adapter {name!r} is not loaded; loaded adapters: {loaded}", "model"
      )
    return adapter

  # -- reading a PEFT folder -----------------------------------------------------------------------

  def read(self, path: str | Path) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(rank, {target: (a f32[L_all, *in, A], b f32[L_all, A, *out])}) of the PEFT folder at
    `path`: every layer of the model in order (a layer the adapter leaves alone is zeros), the
    scale folded into `b`, ranks padded to `max_lora_rank`.

    Raises:
      AdapterError naming the folder and what is wrong with it.
    """
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
      raise AdapterError(
        f"lora_path={str(path)!r} is not a PEFT adapter folder (no adapter_config.json)",
        "lora_path",
      )
    conf = json.loads(config_file.read_text())
    if conf.get("peft_type", "LORA") != "LORA":
      raise AdapterError(
        f"{config_file}: peft_type={conf['peft_type']!r} is not allowed: LORA only", "lora_path"
      )
    for key in ("rank_pattern", "alpha_pattern"):
      if conf.get(key):
        raise AdapterError(
          f"{config_file}: {key} is not supported: one rank and alpha per adapter", "lora_path"
        )
    if conf.get("fan_in_fan_out"):
      raise AdapterError(
        f"{config_file}: fan_in_fan_out=true is not supported (Conv1D bases)", "lora_path"
      )
    r, alpha = int(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    if r > self.max_rank:
      raise AdapterError(
        f"{folder}: rank {r} is not allowed: the server's --max-lora-rank is {self.max_rank}",
        "lora_path",
      )
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
      raise AdapterError(
        f"{folder}: no adapter_model.safetensors (save with safetensors)", "lora_path"
      )
    from safetensors.numpy import load_file

    tensors = load_file(str(weights))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
      m = _PEFT_KEY.search(key)
      if m is None or m.group(2) not in SERVED_TARGETS:
        raise AdapterError(
          f"{folder}: the tensor {key!r} adapts no projection this server holds adapters "
          f"for ({', '.join(self.held)})",
          "lora_path",
        )
      pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    L, R = len(self.layers), self.max_rank
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, target), ab in sorted(pairs.items()):
      if target not in self.held or layer >= L or set(ab) != {"A", "B"}:
        raise AdapterError(
          f"{folder}: layer {layer}'s {target} cannot be served: this model has {L} layers and "
          f"holds adapters for {', '.join(self.held)}; each needs lora_A and lora_B",
          "lora_path",
        )
      stack = self.layers[layer][0]
      held = next((h for h in self.held[target] if h.stack == stack), None)
      if held is None:
        raise AdapterError(
          f"{folder}: layer {layer}'s {target} takes no adapter (an MoE layer)", "lora_path"
        )
      n_in, n_out = math.prod(held.ins), math.prod(held.outs)
      A_ri, B_or = ab["A"].astype(np.float32), ab["B"].astype(np.float32)
      if A_ri.shape != (r, n_in) or B_or.shape != (n_out, r):
        raise AdapterError(
          f"{folder}: layer {layer}'s {target} has lora_A {A_ri.shape} and lora_B {B_or.shape}; "
          f"this model needs ({r}, {n_in}) and ({n_out}, {r})",
          "lora_path",
        )
      if target not in out:
        out[target] = (
          np.zeros((L, *held.ins, R), np.float32),
          np.zeros((L, R, *held.outs), np.float32),
        )
      a, b = out[target]
      a[layer, ..., :r] = A_ri.T.reshape(*held.ins, r)
      b[layer, :r] = (scale * B_or.T).reshape(r, *held.outs)
    if not out:
      raise AdapterError(f"{folder}: its safetensors hold no LoRA tensors", "lora_path")
    return r, out

  # -- the held state ------------------------------------------------------------------------------

  def _write(self, state, slot: int, arrays: dict[str, tuple[np.ndarray, np.ndarray]]):
    """`state` with slot `slot` of every held adapter array set from `arrays` (zeros for a
    target it lacks); the other slots and every other leaf unchanged."""
    updates = {}
    for target, helds in self.held.items():
      for h in helds:
        rows = [i for i, (s, _) in enumerate(self.layers) if s == h.stack]  # its layers, in order
        if target in arrays:
          a, b = (x[rows] for x in arrays[target])
        else:
          a = np.zeros((h.n_layers, *h.ins, self.max_rank), np.float32)
          b = np.zeros((h.n_layers, self.max_rank, *h.outs), np.float32)
        updates[(h.stack, h.part, f"{h.attr}_lora", "a")] = a
        updates[(h.stack, h.part, f"{h.attr}_lora", "b")] = b

    def put(path, leaf):
      key = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
      new = updates.get(key[:4]) if key[-1] == "value" else None
      if new is None:
        return leaf
      out = leaf.at[:, slot].set(jnp.asarray(new, leaf.dtype))
      # Laid out as before (split over the tensor axis as the weight is), so the compiled
      # programs take it as they took the old one.
      return out if out.sharding == leaf.sharding else jax.device_put(out, leaf.sharding)

    return jax.tree_util.tree_map_with_path(put, state)

  def load(self, state, name: str, path: str | Path):
    """(`state` with adapter `name` read from `path` in a free slot, the `Adapter`).

    Raises:
      AdapterError: the name is taken, every slot is held, or the folder cannot be served.
    """
    with self._lock:
      if name in self.by_name:
        raise AdapterError(
          f"lora_name={name!r} is not allowed: an adapter of that name is loaded", "lora_name"
        )
      used = {a.slot for a in self.by_name.values()}
      free = [s for s in range(1, self.max_loras + 1) if s not in used]
      if not free:
        raise AdapterError(
          f"cannot load {name!r}: all {self.max_loras} adapter slots are in use "
          f"(--max-loras); unload one first",
          "lora_name",
        )
      rank, arrays = self.read(path)
      state = self._write(state, free[0], arrays)
      self._n_loads += 1
      adapter = Adapter(name, str(path), free[0], rank, tuple(sorted(arrays)), self._n_loads)
      self.by_name[name] = adapter
      return state, adapter

  def unload(self, state, name: str):
    """`state` with adapter `name`'s slot zeroed (the base) and freed.

    Raises:
      AdapterError naming the adapter when it is not loaded.
    """
    with self._lock:
      slot = self.slot_of(name)
      state = self._write(state, slot, {})
      del self.by_name[name]
      return state


__all__ = ["Adapter", "AdapterError", "ServedAdapters"]
