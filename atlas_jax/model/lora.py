"""LoRA: low-rank adapters on a block's projections (Hu et al. 2021, "LoRA: Low-Rank Adaptation").

An adapted projection computes W x + s * b(a(x)), with s = alpha / rank: `a` maps the weight's
input dims to the rank A, `b` maps A to its output dims. `b` starts at zero, so a freshly adapted
model computes what its base does; only the adapters train (`LoRAParam`, which the trainer tells
apart from the frozen base weights). The update is applied to the activations, never to a copy of
W: the backward pass computes no gradient of W, and no [in, out] array is made per step.

Adapters are parameters of the module that holds the weight (`wq` has `wq_lora`), with their own
logical axes: the weight's input axes then "lora" on `a`, "lora" then its output axes on `b`, so
tensor parallelism and ZeRO split them as they split W, and the rank stays whole. `merged_params`
folds every adapter into its weight (W + s * a b) for export and serving.

Targets are named as Hugging Face names the projections (`atlas_jax.config.LORA_TARGETS`);
MLA's kv_b_proj, one matrix there, is our W_UK and W_UV, and each gets its own adapter. A model
with mixture-of-experts layers takes adapters on its attention projections only (its experts,
and the dense MLPs beside them, take none).

A server holds many adapters at once instead (`SlotAdapters`, `serve_adapters`): one array pair
per targeted weight with a slot axis, each token of a step adding its own slot's product, so one
batch mixes adapters and the base without merging any (`atlas_jax.serving.lora`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.config import (
  LORA_ATTENTION_TARGETS,
  LORA_MLP_TARGETS,
  ConfigError,
  LoRAConfig,
  ModelConfig,
)
from atlas_jax.quant import dequantized

Array = jax.Array


class LoRAParam(nnx.Param):
  """An adapter parameter: the only kind a LoRA run trains."""


@dataclasses.dataclass(frozen=True)
class Adapters:
  """What a model's blocks adapt: the rank, the scale and the projections (resolved names)."""

  rank: int  # A
  scale: float  # alpha / rank
  targets: frozenset[str]


def attention_targets(cfg: ModelConfig) -> tuple[str, ...]:
  """The attention projections a model has, by their Hugging Face names."""
  if cfg.mla is None:
    return ("q_proj", "k_proj", "v_proj", "o_proj")
  q = ("q_proj",) if cfg.mla.q_lora_rank is None else ("q_a_proj", "q_b_proj")
  return (*q, "kv_a_proj", "kv_b_proj", "o_proj")


def resolve(cfg: ModelConfig, lora: LoRAConfig | None) -> Adapters | None:
  """The adapters `lora` asks of a model with config `cfg` ("attn" and "mlp" expanded).

  Raises:
    ConfigError naming a target this model has no projection for, and the ones it has.
  """
  if lora is None:
    return None
  attn = attention_targets(cfg)
  names: set[str] = set()
  for t in lora.targets:
    if t == "attn":
      names.update(attn)
    elif t == "mlp":
      names.update(LORA_MLP_TARGETS)
    elif t in attn or t in LORA_MLP_TARGETS:
      names.add(t)
    else:
      kind = "MLA" if cfg.mla is not None else "GQA"
      raise ConfigError(
        f"train.lora.targets={list(lora.targets)!r} is not allowed: this model ({kind} "
        f"attention) has no {t!r}; its projections: {', '.join((*attn, *LORA_MLP_TARGETS))}, "
        "or 'attn' / 'mlp' for all of either"
      )
  assert names <= set(LORA_ATTENTION_TARGETS) | set(LORA_MLP_TARGETS)
  if cfg.moe is not None and names & set(LORA_MLP_TARGETS):
    raise ConfigError(
      f"train.lora.targets={list(lora.targets)!r} is not allowed: this model has mixture-of-"
      f"experts layers (model.moe), whose experts take no adapters; target its attention "
      f"projections ({', '.join(attn)}, or 'attn')"
    )
  return Adapters(lora.rank, lora.alpha / lora.rank, frozenset(names))


class LoRA(nnx.Module):
  """The low-rank update of one weight [*in, *out]: x [..., *in] -> s * (x a) b [..., *out].

  Args:
    shape: the adapted weight's shape; its first `n_in` dims are contracted with the input.
    axes: the weight's logical axes.
  """

  def __init__(
    self,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    n_in: int,
    adapters: Adapters,
    *,
    rngs: nnx.Rngs,
    param_dtype,
  ):
    A = adapters.rank
    fan_in = math.prod(shape[:n_in])
    # Kaiming-uniform `a` with bound 1 / sqrt(fan_in), as PEFT draws it; zero `b`.
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(rngs.params(), (*shape[:n_in], A), jnp.float32, -bound, bound)
    self.a = LoRAParam(a.astype(param_dtype), logical_axes=(*axes[:n_in], "lora"))  # [*in, A]
    b = jnp.zeros((A, *shape[n_in:]), param_dtype)
    self.b = LoRAParam(b, logical_axes=("lora", *axes[n_in:]))  # [A, *out]
    self.n_in = n_in  # static
    self.scale = adapters.scale  # static

  def __call__(self, x: Array) -> Array:
    dtype = x.dtype
    xa = jnp.tensordot(x, self.a[...].astype(dtype), axes=self.n_in)  # [..., A]
    return self.scale * jnp.tensordot(xa, self.b[...].astype(dtype), axes=1)

  def delta(self) -> Array:
    """s * a b, the update as a weight [..., *in, *out] (leading stacked axes kept)."""
    a, b = self.a[...], self.b[...]
    k = a.ndim - self.n_in - 1  # stacked axes (layers, MTP heads) in front of both
    lead, ins, outs = "abcd"[:k], "ijkl"[: self.n_in], "nopq"[: b.ndim - k - 1]
    spec = f"{lead}{ins}z,{lead}z{outs}->{lead}{ins}{outs}"
    return self.scale * jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def adapter(
  adapters: Adapters | None,
  target: str,
  weight: nnx.Param,
  n_in: int,
  *,
  rngs: nnx.Rngs,
) -> LoRA | None:
  """The adapter of `weight` when `target` is adapted, else None."""
  if adapters is None or target not in adapters.targets:
    return None
  axes = weight.get_metadata()["logical_axes"]
  return LoRA(tuple(weight.shape), axes, n_in, adapters, rngs=rngs, param_dtype=weight[...].dtype)


def plus(y: Array, lora: LoRA | None, x: Array) -> Array:
  """A projection's output y of input x, plus the adapter's update where it has one."""
  return y if lora is None else y + lora(x)


def adapted(weight: nnx.Param, lora: LoRA | None) -> Array:
  """The weight with its adapter folded in (for paths that use W itself, like MLA decoding); a
  quantized weight (QLoRA's base) is dequantized first, or kept as it is without an adapter."""
  w = weight[...]
  if lora is None:
    return w
  w = dequantized(w)
  return (w + lora.delta()).astype(w.dtype)


def merged_params(model: nnx.Module) -> dict:
  """The model's variables (its parameters, and the routers' selection biases where it has them)
  as a pure dict without adapters: each folded into its weight, W + s * a b, in the weight's
  dtype. Equal to the adapted model's function."""
  params = nnx.to_pure_dict(nnx.state(model))
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, LoRA):
      continue
    *parent, name = path
    holder = params
    for key in parent:
      holder = holder[key]
    base = name.removesuffix("_lora")
    holder[base] = (holder[base] + node.delta()).astype(holder[base].dtype)
    del holder[name]
  return params


def count(model: nnx.Module) -> int:
  """Adapter parameters (what a LoRA run trains)."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, LoRAParam)))


# -- serving many adapters at once ---------------------------------------------------------------
#
# A server holds every adapter it serves in one array per targeted weight: [n_slots, *in, A] and
# [n_slots, A, *out] (slot 0 is zeros: the base; ranks below A zero-padded; each adapter's
# alpha / r folded into its `b`), and each new token of a step names its adapter's slot. A
# targeted projection then adds, for every token, the low-rank product of its own slot's pair
# (S-LoRA and Punica's batched products), so one step mixes adapters and the base, and loading
# or freeing a slot rewrites a slice of those arrays without changing a compiled shape.

# The slot of each token of the model call being traced (`token_slots`): i32 with as many
# entries as the call has tokens, in their order.
_SLOTS: contextvars.ContextVar[Array | None] = contextvars.ContextVar("lora_slots", default=None)


@contextlib.contextmanager
def token_slots(slots: Array):
  """While tracing a served model's call: `slots` (i32[R, T], one per new token, in the token
  layout of the call) names each token's adapter for every `SlotAdapters` it meets."""
  reset = _SLOTS.set(slots)
  try:
    yield
  finally:
    _SLOTS.reset(reset)


class SlotAdapters(nnx.Module):
  """A weight's served adapters, one per slot, over a stack of layers: x [..., *in] ->
  (x a[slot]) b[slot] [..., *out], each token with its own slot (`token_slots`).

  Args:
    shape: the adapted weight's shape, its leading stacked axes ([L]) included.
    axes: the weight's logical axes (the stacked ones included).
    n_stack: its leading stacked axes; n_in: then its input dims.
    n_slots: S, the adapters it holds, slot 0 (the base: zeros) included.
    rank: A, the largest rank it takes.
  """

  def __init__(
    self,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    *,
    n_stack: int,
    n_in: int,
    n_slots: int,
    rank: int,
    param_dtype,
  ):
    cut = lambda t: (t[:n_stack], t[n_stack : n_stack + n_in], t[n_stack + n_in :])
    (stack, ins, outs), (s_axes, in_axes, out_axes) = cut(shape), cut(axes)
    # The slot axis is never split; the input and output axes are split as the weight's are.
    a = jnp.zeros((*stack, n_slots, *ins, rank), param_dtype)  # [..., S, *in, A]
    self.a = nnx.Param(a, logical_axes=(*s_axes, "lora_slots", *in_axes, "lora"))
    b = jnp.zeros((*stack, n_slots, rank, *outs), param_dtype)  # [..., S, A, *out]
    self.b = nnx.Param(b, logical_axes=(*s_axes, "lora_slots", "lora", *out_axes))
    self.n_in = n_in  # static

  def __call__(self, x: Array) -> Array:
    slots = _SLOTS.get()
    if slots is None:
      raise ValueError(
        "a model serving LoRA adapters was called without its tokens' adapter slots "
        "(`atlas_jax.model.lora.token_slots`)"
      )
    a, b = self.a[...], self.b[...]  # [S, *in, A], [S, A, *out] (one layer)
    S, A = a.shape[0], a.shape[-1]
    lead, ins, outs = x.shape[: x.ndim - self.n_in], x.shape[x.ndim - self.n_in :], b.shape[2:]
    M = math.prod(lead)
    if slots.size != M:
      raise ValueError(
        f"token_slots: {slots.size} slots for a projection over {M} tokens (input {x.shape})"
      )
    dtype = x.dtype
    x_MI = x.reshape(M, math.prod(ins))
    xa_MSA = jnp.einsum("MI,SIA->MSA", x_MI, a.reshape(S, -1, A).astype(dtype))
    # Each token keeps its own slot's product: one dense pair of matmuls over the S x A columns
    # of every slot, where a per-token gather would copy an [in, A] matrix per token.
    mine_MS = slots.reshape(M, 1) == jnp.arange(S, dtype=slots.dtype)
    xa_MSA = jnp.where(mine_MS[:, :, None], xa_MSA, 0)
    y_MO = jnp.einsum("MSA,SAO->MO", xa_MSA, b.reshape(S, A, -1).astype(dtype))
    return y_MO.reshape(*lead, *outs)


# A served target's weight and adapter attributes, and its input dims, by its Hugging Face name
# (grouped-query attention and dense MLPs).
SERVED_TARGETS = {
  "q_proj": ("attn", "wq", 1),
  "k_proj": ("attn", "wk", 1),
  "v_proj": ("attn", "wv", 1),
  "o_proj": ("attn", "wo", 2),
  "gate_proj": ("mlp", "w_gate", 1),
  "up_proj": ("mlp", "w_up", 1),
  "down_proj": ("mlp", "w_down", 1),
}


def serve_adapters(model: nnx.Module, *, n_slots: int, rank: int) -> tuple[str, ...]:
  """Gives every targetable projection of `model`'s layer stacks a `SlotAdapters` of `n_slots`
  slots of rank `rank`, all zeros (every slot the base until loaded). Returns the targets it
  holds (Hugging Face names).

  Raises:
    ConfigError for a model whose projections cannot take served adapters: MLA attention, MTP
    heads, or adapters already in it (merge them first); or slots or rank below 1.
  """
  cfg = model.cfg
  if n_slots < 2 or rank < 1:
    raise ConfigError(
      f"max_loras={n_slots - 1}, max_lora_rank={rank} are not allowed: both must be >= 1"
    )
  if cfg.mla is not None or getattr(model, "mtp", None) is not None:
    raise ConfigError(
      "--enable-lora is not allowed for this model: served adapters take grouped-query "
      "attention models without MTP heads (MLA folds its up-projections into decoding)"
    )
  if any(isinstance(node, LoRA) for _, node in nnx.iter_graph(model)):
    raise ConfigError("--enable-lora: the model already holds LoRA adapters; merge them first")
  held = []
  for stack_name in ("blocks", "dense_blocks"):
    stack = getattr(model, stack_name, None)
    if stack is None:
      continue
    for target, (part, name, n_in) in SERVED_TARGETS.items():
      holder = getattr(stack, part, None)
      weight = getattr(holder, name, None)
      if not isinstance(weight, nnx.Param) or (part == "mlp" and cfg.moe is not None):
        continue  # an MoE model's MLPs take no adapters (as `resolve` has it)
      setattr(
        holder,
        f"{name}_lora",
        nnx.data(
          SlotAdapters(
            tuple(weight.shape),
            weight.get_metadata()["logical_axes"],
            n_stack=1,
            n_in=n_in,
            n_slots=n_slots,
            rank=rank,
            param_dtype=weight[...].dtype,
          )
        ),
      )
      held.append(target)
  return tuple(dict.fromkeys(held))
