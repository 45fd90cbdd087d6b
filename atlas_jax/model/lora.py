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
"""

from __future__ import annotations

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
  """The weight with its adapter folded in (for paths that use W itself, like MLA decoding)."""
  w = weight[...]
  return w if lora is None else (w + lora.delta()).astype(w.dtype)


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
