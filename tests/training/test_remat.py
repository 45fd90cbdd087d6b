"""Remat policies: identical gradients, and the memory/compute trade-off in the expected order."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from atlas_jax.model.scan import default_every
from atlas_jax.model.transformer import Transformer
from atlas_jax.training.step import loss_fn

from .common import tiny_config

POLICIES = ("none", "full", "every_k", "selective")


def grads_and_costs(policy: str, n_layers: int = 4, *, compile: bool = True):
  cfg = tiny_config(f"model.n_layers={n_layers}")
  # Unrolled layers: XLA's cost analysis counts a loop body once, whatever the trip count.
  model = Transformer(cfg.model, rngs=nnx.Rngs(0), remat=policy, unroll_layers=compile)
  graphdef, params = nnx.split(model)
  batch = {"tokens": jax.random.randint(jax.random.key(1), (4, 17), 0, 64, dtype=jnp.int32)}
  f = lambda p: loss_fn(graphdef, p, batch)[0]
  residuals = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(f, p)[1]), params)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  activation_bytes = sum(x.size * x.dtype.itemsize for x in residuals) - param_bytes
  if not compile:
    return None, activation_bytes, None
  compiled = jax.jit(jax.grad(f)).lower(params).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return compiled(params), activation_bytes, cost["flops"]


@pytest.fixture(scope="module")
def results():
  return {p: grads_and_costs(p) for p in POLICIES}


def test_every_policy_gives_the_same_gradients(results):
  for policy in POLICIES[1:]:
    chex.assert_trees_all_close(results[policy][0], results["none"][0], atol=1e-6, rtol=1e-5)


def test_memory_and_compute_ordering(results):
  mem = {p: r[1] for p, r in results.items()}
  flops = {p: r[2] for p, r in results.items()}
  # Keeping less means recomputing more.
  assert mem["every_k"] <= mem["full"] < mem["selective"] < mem["none"]
  assert flops["none"] < flops["selective"] < flops["full"]
  assert flops["full"] <= flops["every_k"] * 1.01
  # Selective remat keeps matmul outputs, so it recomputes only cheap elementwise work.
  assert flops["selective"] < 1.1 * flops["none"]


def test_every_k_memory_grows_like_sqrt_layers():
  """With k = sqrt(L) the kept activations grow ~sqrt(L); with none they grow ~L."""
  _, none_4, _ = grads_and_costs("none", 4, compile=False)
  _, none_16, _ = grads_and_costs("none", 16, compile=False)
  _, every_4, _ = grads_and_costs("every_k", 4, compile=False)
  _, every_16, _ = grads_and_costs("every_k", 16, compile=False)
  assert none_16 / none_4 > 3.0
  assert every_16 / every_4 < 2.5


def test_default_every_is_a_divisor_near_sqrt():
  assert [default_every(n) for n in (1, 4, 12, 16, 32, 80)] == [1, 2, 3, 4, 4, 8]


def test_mla_policies_give_the_same_gradients_and_selective_keeps_its_projections():
  """MLA names its matmul and attention outputs, so selective keeps them (and recomputes norms,
  RoPE and SwiGLU): between full and none in bytes, with the gradients of none."""
  from atlas_jax.config import MLAConfig, ModelConfig

  cfg = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    ffn_dim=48,
    mla=MLAConfig(
      kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=12
    ),
  )
  batch = {"tokens": jax.random.randint(jax.random.key(1), (2, 13), 0, 64, dtype=jnp.int32)}
  grads, saved = {}, {}
  for policy in POLICIES:
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), remat=policy))
    f = lambda p, g=graphdef: loss_fn(g, p, batch)[0]
    residuals = jax.eval_shape(lambda p, f=f: jax.tree.leaves(jax.vjp(f, p)[1]), params)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    saved[policy] = sum(x.size * x.dtype.itemsize for x in residuals) - param_bytes
    grads[policy] = jax.jit(jax.grad(f))(params)
  for policy in POLICIES[1:]:
    chex.assert_trees_all_close(grads[policy], grads["none"], atol=1e-6, rtol=1e-5)
  assert saved["full"] < saved["selective"] < saved["none"]
  # The named outputs per token and layer: q (N x 12), q bottleneck 12, latent + rope key 20,
  # K and V up-projections (N x 8 each), attention output (N x 8), o_proj and the MLP's
  # gate, up and down (2D + 2F), all float32, at B x T = 24 tokens over 2 layers; full keeps
  # only each block's input (D).
  named = 4 * 12 + 12 + 20 + 4 * 8 * 3 + 2 * 32 + 2 * 48
  assert saved["selective"] - saved["full"] >= 24 * 2 * 4 * (named - 32)
