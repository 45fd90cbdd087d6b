"""The CPU runner's weight layouts (`atlas_jax.serving.cpu.weights`): layers one array each,
projections out-major, and the logits those of the model as trained."""

import jax
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, MoEConfig
from atlas_jax.serving.cpu.weights import OutMajor, out_major_candidates, unstack_layers

from ..model.test_transformer import make, tokens


@pytest.mark.parametrize(
  "kw, held",
  [
    ({}, 7),  # wq wk wv wo, gate up down
    (dict(mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24)), 7),  # wq_a wq_b wkv_a wo, the MLP
    (dict(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32)), 4),  # experts left stacked
  ],
)
def test_served_layers_out_major_equal_the_model(kw, held):
  """`unstack_layers(out_major=True)`: the named projections held transposed, the experts' and
  MLA's W_UK/W_UV left as they are, and the logits those of the stacked model."""
  model = make(**kw)
  graphdef, state = nnx.split(model)
  served = unstack_layers(nnx.state(model), out_major=True)
  leaves = jax.tree.leaves(served, is_leaf=lambda x: isinstance(x, OutMajor))
  assert sum(isinstance(x, OutMajor) for x in leaves) == held * model.cfg.n_layers
  t = tokens(2, 11)
  served_logits = jax.jit(lambda st: nnx.merge(graphdef, st)(t))(served)
  np.testing.assert_allclose(served_logits, model(t), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
  "kw, held", [({}, 7), (dict(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32)), 4)]
)
def test_out_major_candidates_are_the_held_projections_in_layer_order(kw, held):
  """What the engine's layout probe times: the matrices `unstack_layers(out_major=True)` holds
  transposed, as [in, out], layer 0's first; with a byte limit, the fewest that reach it."""
  model = make(**kw)
  state = nnx.state(model)
  mats = out_major_candidates(state)
  served = unstack_layers(nnx.state(model), out_major=True)
  held_t = [
    x.t
    for x in jax.tree.leaves(served, is_leaf=lambda x: isinstance(x, OutMajor))
    if isinstance(x, OutMajor)
  ]
  assert len(mats) == len(held_t) == held * model.cfg.n_layers
  assert sorted(m.T.shape for m in mats) == sorted(t.shape for t in held_t)
  wq = state["blocks"]["attn"]["wq"][...]
  first = wq[0].reshape(wq.shape[1], -1)  # layer 0's W_Q among layer 0's, not later ones
  assert [np.array_equal(m, first) for m in mats].index(True) < held
  limit = sum(m.nbytes for m in mats[: held + 1])  # layer 0's and one more
  some = out_major_candidates(state, limit_bytes=limit)
  assert len(some) == held + 1 and sum(m.nbytes for m in some) >= limit
