"""Mixture-of-experts layers: routers against hand-built logits, the layer against a per-token loop,
the grouped matmul and the capacity slots against the dense one-hot reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig, MoEConfig
from atlas_jax.model import build
from atlas_jax.model.moe import (
  MoE,
  capacity_experts,
  dense_experts,
  grouped_experts,
  route,
)


def logit(p):
  """The logit whose sigmoid is p."""
  p = np.asarray(p, np.float64)
  return np.log(p / (1 - p)).astype(np.float32)


def routed(logits, bias=None, **cfg):
  experts, weights, probs = route(
    jnp.asarray(logits, jnp.float32),
    MoEConfig(**cfg),
    None if bias is None else jnp.asarray(bias, jnp.float32),
  )
  order = np.argsort(-np.asarray(weights), axis=-1, kind="stable")
  take = lambda a: np.take_along_axis(np.asarray(a), order, axis=-1)
  return take(experts), take(weights), np.asarray(probs)


# --- routers against hand-built logits ------------------------------------------------------------


def test_softmax_top_k_renormalised_and_not():
  logits = [[0.0, 1.0, 3.0, 2.0], [4.0, 0.0, 0.0, 4.5]]
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  experts, weights, probs = routed(logits, n_experts=4, top_k=2, norm_topk_prob=True)
  assert experts.tolist() == [[2, 3], [3, 0]]
  np.testing.assert_allclose(weights[0], p[0, [2, 3]] / p[0, [2, 3]].sum(), rtol=1e-6)
  np.testing.assert_allclose(weights[1], p[1, [3, 0]] / p[1, [3, 0]].sum(), rtol=1e-6)
  np.testing.assert_allclose(probs, p, rtol=1e-6)
  experts, weights, _ = routed(logits, n_experts=4, top_k=2, norm_topk_prob=False)
  assert experts.tolist() == [[2, 3], [3, 0]]
  np.testing.assert_allclose(weights, np.take_along_axis(p, experts, -1), rtol=1e-6)


def test_group_limited_greedy_picks_only_inside_the_best_groups():
  # Groups {0,1} {2,3} {4,5} {6,7}. Unlimited, the top two are experts 0 and 4; with one group
  # allowed (ranked by its best expert), both come from group {0, 1}.
  logits = [[5.0, 4.9, 4.8, 0.0, 4.95, 0.0, 1.0, 1.0]]
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  kw = dict(n_experts=8, top_k=2, norm_topk_prob=False, routed_scaling_factor=2.0)
  free, _, _ = routed(logits, topk_method="greedy", **kw)
  assert free.tolist() == [[0, 4]]
  limited, weights, _ = routed(
    logits, topk_method="group_limited_greedy", n_group=4, topk_group=1, **kw
  )
  assert limited.tolist() == [[0, 1]]
  # DeepSeek-V2: the softmax over every expert, not renormalised, times the scaling factor.
  np.testing.assert_allclose(weights, 2.0 * p[:, [0, 1]], rtol=1e-6)
  two_groups, _, _ = routed(
    logits, topk_method="group_limited_greedy", n_group=4, topk_group=2, **kw
  )
  assert two_groups.tolist() == [[0, 4]]


def test_noaux_tc_ranks_groups_by_their_two_best_and_the_bias_moves_only_the_choice():
  # Group {0, 1} has the single best expert, group {2, 3} the best pair: noaux_tc takes the pair's
  # group (group_limited_greedy, ranking by the best one, would take expert 0).
  scores = [[0.9, 0.05, 0.6, 0.65]]
  kw = dict(n_experts=4, top_k=1, scoring="sigmoid", n_group=2, topk_group=1)
  experts, weights, _ = routed(logit(scores), np.zeros(4), topk_method="noaux_tc", **kw)
  assert experts.tolist() == [[3]]
  v2, _, _ = routed(logit(scores), topk_method="group_limited_greedy", **kw)
  assert v2.tolist() == [[0]]

  scores = [[0.5, 0.6, 0.55, 0.52]]
  kw = dict(n_experts=4, top_k=2, scoring="sigmoid", topk_method="noaux_tc")
  kw.update(routed_scaling_factor=2.5, norm_topk_prob=True)
  experts, weights, probs = routed(logit(scores), np.zeros(4), **kw)
  assert experts.tolist() == [[1, 2]]
  np.testing.assert_allclose(weights, 2.5 * np.array([[0.6, 0.55]]) / 1.15, rtol=1e-5)
  np.testing.assert_allclose(probs, np.array(scores) / np.sum(scores), rtol=1e-5)
  # A bias on expert 0 makes it chosen; the weights stay the unbiased scores, renormalised.
  experts, weights, _ = routed(logit(scores), [0.2, 0.0, 0.0, 0.0], **kw)
  assert experts.tolist() == [[1, 0]]
  np.testing.assert_allclose(weights, 2.5 * np.array([[0.6, 0.5]]) / 1.1, rtol=1e-5)


# --- the experts' computation ---------------------------------------------------------------------

T, D, F, E, K = 24, 16, 12, 6, 2


@pytest.fixture(scope="module")
def expert_inputs():
  keys = jax.random.split(jax.random.key(0), 6)
  x_tD = jax.random.normal(keys[0], (T, D))
  experts_tk = jax.random.randint(keys[1], (T, K), 0, E)
  experts_tk = experts_tk.at[3, 1].set(E).at[7, 0].set(-1)  # ids outside [0, E): no contribution
  weights_tk = jax.random.uniform(keys[2], (T, K))
  w = [0.3 * jax.random.normal(k, s) for k, s in zip(keys[3:], [(E, D, F), (E, D, F), (E, F, D)])]
  return x_tD, experts_tk, weights_tk, w


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
def test_grouped_matmul_equals_the_dense_reference(expert_inputs, dtype, tol):
  x_tD, experts_tk, weights_tk, w = expert_inputs
  args = (x_tD.astype(dtype), experts_tk, weights_tk, *[a.astype(dtype) for a in w])
  got = jax.jit(grouped_experts)(*args)
  want = jax.jit(dense_experts)(*args)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)
  # The invalid ids really contribute nothing: dropping them changes nothing.
  weights_tk = weights_tk.at[3, 1].set(0.0).at[7, 0].set(0.0)
  clean = jnp.where((experts_tk >= 0) & (experts_tk < E), experts_tk, 0)
  again = jax.jit(dense_experts)(args[0], clean, weights_tk, *args[3:])
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(again, np.float32), atol=tol)


def test_grouped_matmul_gradients_equal_the_dense_reference(expert_inputs):
  x_tD, experts_tk, weights_tk, w = expert_inputs

  def loss(fn, x, weights, *w):
    return jnp.sum(jnp.sin(fn(x, experts_tk, weights, *w)))

  grads = lambda fn: jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4, 5)), static_argnums=0)(
    fn, x_tD, weights_tk, *w
  )
  for got, want in zip(grads(grouped_experts), grads(dense_experts)):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_capacity_slots_drop_in_token_order_and_count_the_drops(expert_inputs):
  x_tD, experts_tk, weights_tk, w = expert_inputs
  args = (x_tD, experts_tk, weights_tk, *w)
  ample, dropped = capacity_experts(*args, slots=T * K)
  assert int(dropped) == 0
  np.testing.assert_allclose(ample, dense_experts(*args), atol=1e-5)
  slots = 3
  y, dropped = jax.jit(capacity_experts, static_argnames="slots")(*args, slots=slots)
  # By hand: walk the assignments token by token; an expert's fourth and later are dropped.
  seen, keep = np.zeros(E, int), np.zeros((T, K), bool)
  for t in range(T):
    for j in range(K):
      e = int(experts_tk[t, j])
      if 0 <= e < E:
        keep[t, j] = seen[e] < slots
        seen[e] += 1
  assert int(dropped) == int(np.maximum(seen - slots, 0).sum()) > 0
  assert int(dropped) == int(np.sum(~keep & (np.asarray(experts_tk) >= 0) & (experts_tk < E)))
  want = dense_experts(x_tD, experts_tk, jnp.where(keep, weights_tk, 0.0), *w)
  np.testing.assert_allclose(y, want, atol=1e-5)


# --- the layer against a per-token loop ---------------------------------------------------------


def tiny_cfg(**moe) -> ModelConfig:
  return ModelConfig(
    vocab_size=61,
    d_model=D,
    n_layers=3,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=20,
    init_std=0.3,
    moe=MoEConfig(n_experts=E, top_k=K, expert_ffn_dim=F, **moe),
  )


def float64(module) -> dict:
  """A module's own arrays (not its submodules'), float64."""
  state = nnx.to_pure_dict(nnx.state(module))
  return {k: np.asarray(v, np.float64) for k, v in state.items() if not isinstance(v, dict)}


def swiglu(x, w_gate, w_up, w_down):
  g = x @ w_gate
  return (g / (1 + np.exp(-g)) * (x @ w_up)) @ w_down


def test_qwen2_moe_layer_equals_a_per_token_loop():
  """Softmax top-k without renormalisation, plus a sigmoid-gated shared expert."""
  cfg = tiny_cfg(norm_topk_prob=False, shared_ffn_dim=10, shared_expert_gate=True)
  layer = MoE(cfg, rngs=nnx.Rngs(1))
  x_BTD = jax.random.normal(jax.random.key(2), (2, 5, D))
  y_BTD, stats = layer(x_BTD)
  p, sh = float64(layer), float64(layer.shared)
  counts = np.zeros(E)
  for b in range(2):
    for t in range(5):
      x = np.asarray(x_BTD[b, t], np.float64)
      logits = x @ p["router"]
      probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
      top = np.argsort(-probs)[:K]
      counts[top] += 1
      want = sum(probs[e] * swiglu(x, p["w_gate"][e], p["w_up"][e], p["w_down"][e]) for e in top)
      gate = 1 / (1 + np.exp(-(x @ p["shared_gate"])))
      want = want + gate * swiglu(x, sh["w_gate"], sh["w_up"], sh["w_down"])
      np.testing.assert_allclose(np.asarray(y_BTD[b, t]), want, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats.counts_E), counts)
  assert float(stats.dropped) == 0


def test_deepseek_v3_layer_equals_a_per_token_loop():
  """Sigmoid scores, noaux_tc groups with a nonzero bias, renormalised and scaled, shared expert."""
  cfg = tiny_cfg(
    scoring="sigmoid",
    topk_method="noaux_tc",
    n_group=3,
    topk_group=2,
    routed_scaling_factor=2.5,
    shared_ffn_dim=10,
  )
  layer = MoE(cfg, rngs=nnx.Rngs(3))
  layer.score_bias[...] = jnp.linspace(-0.3, 0.3, E)
  x_BTD = jax.random.normal(jax.random.key(4), (1, 7, D))
  y_BTD, _ = layer(x_BTD)
  p, sh = float64(layer), float64(layer.shared)
  for t in range(7):
    x = np.asarray(x_BTD[0, t], np.float64)
    scores = 1 / (1 + np.exp(-(x @ p["router"])))
    choice = scores + p["score_bias"]
    groups = choice.reshape(3, 2)
    best = np.argsort(-np.sort(groups, axis=1)[:, -2:].sum(1))[:2]
    allowed = np.concatenate([[2 * g, 2 * g + 1] for g in best])
    top = allowed[np.argsort(-choice[allowed])[:K]]
    w = 2.5 * scores[top] / scores[top].sum()
    want = sum(
      wi * swiglu(x, p["w_gate"][e], p["w_up"][e], p["w_down"][e]) for wi, e in zip(w, top)
    )
    want = want + swiglu(x, sh["w_gate"], sh["w_up"], sh["w_down"])
    np.testing.assert_allclose(np.asarray(y_BTD[0, t]), want, atol=1e-5)


# --- the decoder with MoE layers -----------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek_like():
  """Dense first layer, then MoE layers with shared experts: two runs over two stacks."""
  cfg = tiny_cfg(first_k_dense=1, shared_ffn_dim=10)
  return build(cfg, rngs=nnx.Rngs(0))


def test_dense_prefix_then_moe_layers_run_in_order(deepseek_like):
  model = deepseek_like
  assert model.runs == (("dense_blocks", 0, 1, 0), ("blocks", 0, 2, 1))
  state = nnx.state(model)
  assert state["blocks"]["mlp"]["w_gate"][...].shape == (2, E, D, F)
  assert state["dense_blocks"]["mlp"]["w_gate"][...].shape == (1, D, 20)
  assert state["blocks"]["mlp"]["w_gate"].get_metadata()["logical_axes"] == (
    "layers",
    "experts",
    "embed",
    "expert_mlp",
  )
  # The dense layers' stack has its own axis: pipeline stages split only the MoE layers'.
  assert state["dense_blocks"]["mlp"]["w_gate"].get_metadata()["logical_axes"] == (
    "dense_layers",
    "embed",
    "mlp",
  )


def test_cached_decode_equals_the_full_forward(deepseek_like):
  model = deepseek_like
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 61, (2, 9)), jnp.int32)
  want = jax.jit(lambda t: model(t))(tokens)
  cache = model.init_cache(2, 16)
  step = jax.jit(lambda t, c: model(t, cache=c))
  out, cache = step(tokens[:, :5], cache)
  outs = [out]
  for t in range(5, 9):
    out, cache = step(tokens[:, t : t + 1], cache)
    outs.append(out)
  np.testing.assert_allclose(np.concatenate(outs, 1), want, atol=2e-5)


@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_remat_policies_equal_no_remat_over_runs(deepseek_like, policy):
  graphdef, state = nnx.split(deepseek_like)
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, 61, (2, 8)), jnp.int32)

  def loss(state, remat):
    model = nnx.merge(graphdef, state)
    model.remat = (remat, None, False)
    out = model.forward_train(tokens)
    return jnp.mean(out.main**2) + jnp.mean(out.router.balance_loss())

  want = jax.jit(jax.grad(lambda s: loss(s, "none")))(state)
  got = jax.jit(jax.grad(lambda s: loss(s, policy)))(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_capacity_applies_to_the_uncached_forward_only():
  cfg = tiny_cfg()
  capped = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=0.5))
  model = build(capped, rngs=nnx.Rngs(0))
  free = build(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, 61, (2, 12)), jnp.int32)
  stats = model.forward_train(tokens).router
  slots = int(np.ceil(0.5 * 24 * K / E))
  counts = np.asarray(stats.counts_E)
  np.testing.assert_array_equal(np.asarray(stats.dropped), np.maximum(counts - slots, 0).sum(-1))
  assert float(stats.dropped.sum()) > 0
  assert not np.allclose(model(tokens), free(tokens), atol=1e-3)
  cached, _ = model(tokens, cache=model.init_cache(2, 12))
  np.testing.assert_allclose(cached, free(tokens), atol=2e-5)


# --- gpt-oss's experts: biases and the clamped SwiGLU -------------------------------------------


def test_biased_clamped_experts_equal_a_per_assignment_loop_in_every_form(expert_inputs):
  """Gate/up/down biases and gpt-oss's clamped SwiGLU: the dense reference against a numpy loop,
  and the grouped, capacity and expert-parallel (expert 2 x tensor 2, the down bias added once
  across the tensor shards) forms against it."""
  from functools import partial

  from atlas_jax.model.moe import clamped_swiglu, expert_parallel

  x_tD, experts_tk, weights_tk, w = expert_inputs
  keys = jax.random.split(jax.random.key(5), 3)
  biases = tuple(0.5 * jax.random.normal(k, s) for k, s in zip(keys, [(E, F), (E, F), (E, D)]))
  limit, alpha = 0.8, 1.702  # low enough that both clamps act here
  act = partial(clamped_swiglu, limit=limit, alpha=alpha)
  args = (x_tD, experts_tk, weights_tk, *w)
  want = np.zeros((T, D))
  x, ids, wts = np.asarray(x_tD, np.float64), np.asarray(experts_tk), np.asarray(weights_tk)
  wg, wu, wd = (np.asarray(a, np.float64) for a in w)
  bg, bu, bd = (np.asarray(b, np.float64) for b in biases)
  clamped = 0
  for t in range(T):
    for j in range(K):
      e = ids[t, j]
      if not 0 <= e < E:
        continue
      g, u = x[t] @ wg[e] + bg[e], x[t] @ wu[e] + bu[e]
      clamped += int(np.sum(g > limit) + np.sum(np.abs(u) > limit))
      g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
      h = (u + 1) * g / (1 + np.exp(-alpha * g))
      want[t] += wts[t, j] * (h @ wd[e] + bd[e])
  assert clamped > 0
  dense = dense_experts(*args, biases=biases, act=act)
  np.testing.assert_allclose(dense, want, atol=1e-5)
  np.testing.assert_allclose(grouped_experts(*args, biases=biases, act=act), want, atol=1e-5)
  ample, _ = capacity_experts(*args, slots=T * K, biases=biases, act=act)
  np.testing.assert_allclose(ample, want, atol=1e-5)
  auto = (jax.sharding.AxisType.Auto,) * 3
  mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"), axis_types=auto)
  F_even = [a[..., : F // 2 * 2] if i < 2 else a[:, : F // 2 * 2] for i, a in enumerate(w)]
  b_even = (biases[0][:, : F // 2 * 2], biases[1][:, : F // 2 * 2], biases[2])
  with jax.set_mesh(mesh):
    run = jax.jit(lambda *a: expert_parallel(mesh.abstract_mesh)(*a, biases=b_even, act=act))
    got, dropped = run(x_tD[:T], experts_tk % E, weights_tk, *F_even)
  ref = dense_experts(x_tD, experts_tk % E, weights_tk, *F_even, biases=b_even, act=act)
  assert int(dropped) == 0
  np.testing.assert_allclose(got, ref, atol=1e-5)


def test_gpt_oss_router_is_a_softmax_over_the_top_k_of_biased_logits():
  """gpt-oss: top-k of x @ W + b, then a softmax over the k (renormalised softmax scores)."""
  cfg = tiny_cfg(router_bias=True, expert_bias=True, swiglu_limit=7.0)
  layer = MoE(cfg, rngs=nnx.Rngs(1))
  layer.router_bias[...] = jax.random.normal(jax.random.key(3), (E,))
  x_tD = np.asarray(jax.random.normal(jax.random.key(2), (7, D)), np.float64)
  logits = x_tD @ np.asarray(layer.router[...], np.float64) + np.asarray(layer.router_bias[...])
  experts_tk, weights_tk, _ = route(jnp.asarray(logits, jnp.float32), cfg.moe)
  top = np.argsort(-logits, axis=-1)[:, :K]
  np.testing.assert_array_equal(np.asarray(experts_tk), top)
  chosen = np.take_along_axis(logits, top, axis=-1)
  soft = np.exp(chosen - chosen.max(-1, keepdims=True))
  np.testing.assert_allclose(weights_tk, soft / soft.sum(-1, keepdims=True), atol=1e-6)
