"""The planner under context parallelism: attention's collective bytes against the compiled
program's collectives, the activation split, and the long-context preset by eval_shape."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from atlas_jax import measure
from atlas_jax.config import load_config
from atlas_jax.model import context_parallel as cp
from atlas_jax.plan import context as plan_context
from atlas_jax.plan import memory
from atlas_jax.training import sharding as shd
from atlas_jax.training.step import _in_mesh, make_trainer, objective

from ..training.common import tiny_config

ROOT = Path(__file__).parents[2]
_ITEM = {"f32": 4, "bf16": 2, "s32": 4}
# All-gathers and reduce-scatters the context attention's shard_map lowers to.
_GATHER = re.compile(r"= (\w+)\[([\d,]*)\]\S* all-gather\(.*replica_groups=\{\{")
_SCATTER = re.compile(r"= \w+\[[\d,]*\]\S* reduce-scatter\((?:\w+\[[\d,]*\]\S* )?%?([\w.\-]+)")


def _attention_hlo(mode, C, B=2, T=16, N=4, K=2, H=8):
  mesh = shd.make_mesh(tiny_config("mesh.fsdp=1", f"mesh.context={C}").mesh, jax.devices()[:C])
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)

  def loss(q, k, v):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jnp.sum(cp.context_attention(q, k, v, mode=mode) ** 2)

  with jax.sharding.set_mesh(mesh):
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(q, kv, kv).compile().as_text()


def _gather_bytes(hlo, C):
  """Bytes one device receives in all-gathers over C devices and sends in reduce-scatters."""
  got = 0
  for dtype, dims in _GATHER.findall(hlo):
    got += _ITEM[dtype] * int(np.prod([int(d) for d in dims.split(",")])) * (C - 1) // C
  shapes = dict(re.findall(r"%?([\w.\-]+) = (\w+\[[\d,]*\])", hlo))
  for operand in _SCATTER.findall(hlo):
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", shapes[operand]).groups()
    got += _ITEM[dtype] * int(np.prod([int(d) for d in dims.split(",")])) * (C - 1) // C
  return got


@pytest.mark.parametrize("mode,C", [("all_gather", 2), ("all_gather", 4), ("ring", 4)])
def test_collective_bytes_match_the_compiled_attention(mode, C):
  """One layer's K/V in (forward) and their gradients out (backward), per device."""
  cfg = tiny_config("model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2")
  assert cfg.model.head_dim == 8
  hlo = _attention_hlo(mode, C)
  got = measure.collective_permute_bytes(hlo) if mode == "ring" else _gather_bytes(hlo, C)
  planned = plan_context.collective_bytes(
    cfg.model, batch=2, seq_len=16, context=C, compute_bytes=4
  )
  assert got == planned


def test_activations_split_by_context():
  cfg = tiny_config().model
  common = dict(policy="none", batch=2, compute_bytes=2)
  one = plan_context.context_plan(cfg, seq_len=64, context=1, **common)
  assert one.activations == memory.activation_bytes(cfg, seq_len=64, **common)
  assert (one.remote_kv, one.collective_bytes) == (0, 0)
  four = plan_context.context_plan(cfg, seq_len=64, context=4, **common)
  assert four.activations == memory.activation_bytes(cfg, seq_len=16, **common)
  # The other 48 positions' K and V (2 kv heads of 8 dims, bf16) in each of the layers.
  assert four.remote_kv == 2 * 48 * (2 * 2 * 8 * 2) * cfg.n_layers
  assert four.peak < one.peak
  full = plan_context.context_plan(
    cfg, seq_len=64, context=4, policy="full", batch=2, compute_bytes=2
  )
  assert full.remote_kv == 0 and full.collective_bytes == four.collective_bytes * 3 // 2
  with pytest.raises(ValueError, match="divisible by 2 \\* context = 8"):
    plan_context.context_plan(cfg, seq_len=60, context=4, **common)


def test_long_context_preset_shapes():
  """configs/llama3-8b-128k.yaml on an abstract 64-device mesh (context 8, fsdp 8): the state
  fits, parameters are not split over `context`, and the loss traces at 131,072 tokens."""
  cfg = load_config(ROOT / "configs" / "llama3-8b-128k.yaml")
  assert (cfg.mesh.context, cfg.train.seq_len, cfg.train.context_parallel) == (
    8,
    131072,
    "all_gather",
  )
  sizes = {"fsdp": 8, "context": 8}
  mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in shd.AXES), shd.AXES)
  trainer = make_trainer(cfg, mesh=mesh)
  abstract = trainer.abstract_state()
  n = sum(x.size for x in jax.tree.leaves(abstract.params))
  per_device = shd.sharded_bytes(
    abstract.params, trainer.state_shardings.params
  ) + shd.sharded_bytes(abstract.opt_state, trainer.state_shardings.opt_state)
  assert per_device == pytest.approx(12 * n / 8, rel=0.01)
  rows = cfg.train.batch_size // 8  # the fsdp shard's rows
  planned = plan_context.context_plan(
    cfg.model,
    policy=cfg.train.remat,
    batch=rows,
    seq_len=cfg.train.seq_len,
    context=8,
    compute_bytes=2,
    loss_chunk=cfg.train.loss_chunk,
  )
  # Full remat: each device keeps its 16,384 tokens' block inputs; under an H200's memory.
  assert (per_device + planned.peak) / 2**30 < 141
  # The loss and its gradients trace through the context attention at the full length.
  loss = _in_mesh(trainer, objective(cfg))
  tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
  grad = lambda p, t: jax.grad(lambda p: loss(trainer.graphdef, p, {"tokens": t})[0])(p)
  grads = jax.eval_shape(grad, abstract.params, tokens)
  assert jax.tree.map(lambda g: g.shape, grads) == jax.tree.map(lambda p: p.shape, abstract.params)
