"""Multi-token prediction: both head forms, the loss and its per-head terms, training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig, load_config
from atlas_jax.model import Transformer, build
from atlas_jax.training import mtp as mtp_loss


def tiny(kind, *, mla=True, n_predict=2):
  return ModelConfig(
    vocab_size=31,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=2,
    ffn_dim=48,
    mla=MLAConfig(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    if mla
    else None,
    mtp=MTPConfig(kind=kind, n_predict=n_predict, loss_weight=0.5),
  )


def nll(logits, targets):
  logits = np.asarray(logits, np.float64)
  z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


@pytest.mark.parametrize("kind,mla", [("sequential", True), ("parallel", False)])
def test_loss_is_main_plus_weighted_mean_of_heads(kind, mla):
  cfg = tiny(kind, mla=mla)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = np.random.RandomState(0).randint(0, 31, (2, 11)).astype(np.int32)
  segments = np.array([[0] * 6 + [1] * 4, [0] * 10], np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments)}
  loss, aux = jax.jit(lambda p, b: mtp_loss.loss_fn(graphdef, p, b))(params, batch)
  main, heads = jax.jit(lambda t, s: model.forward_mtp(t, segment_ids_BT=s))(
    tokens[:, :-1], segments
  )
  assert heads.shape == (2, 2, 10, 31)
  targets = tokens[:, 1:]
  np.testing.assert_allclose(aux["loss_main"], nll(main, targets).mean(), rtol=1e-5)
  # Head j at position t predicts tokens[t + 1 + j], only inside t's document and the window.
  for j in (1, 2):
    per_pos = nll(heads[j - 1][:, : 10 - j], targets[:, j:])
    valid = segments[:, j:] == segments[:, : 10 - j]
    np.testing.assert_allclose(aux[f"loss_mtp_{j}"], per_pos[valid].mean(), rtol=1e-5)
  want = aux["loss_main"] + 0.5 * (aux["loss_mtp_1"] + aux["loss_mtp_2"]) / 2
  np.testing.assert_allclose(loss, want, rtol=1e-6)


@pytest.mark.parametrize("kind,mla", [("sequential", True), ("parallel", False)])
def test_model_and_heads_are_causal(kind, mla):
  """At position t the main head reads tokens <= t, MTP head j tokens <= t + j (sequential:
  it embeds token t + j) or <= t (parallel)."""
  cfg = tiny(kind, mla=mla, n_predict=1)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

  def at_4(st, which):
    main, heads = nnx.merge(graphdef, st).forward_mtp(jnp.arange(10)[None])
    return (main[0, 4] if which == 0 else heads[0, 0, 4]).sum()

  # Distinct tokens: embedding row r is the input at position r.
  grads = jax.jit(lambda st: [jax.grad(at_4)(st, w)["embed"][...] for w in (0, 1)])(state)
  for g, last in zip(grads, (4, 5 if kind == "sequential" else 4), strict=True):
    g = np.abs(np.asarray(g))
    assert g[last + 1 :].max() == 0.0 and g[last].max() > 0


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
def test_training_lowers_every_head_loss(kind):
  cfg = tiny(kind, n_predict=1)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  # A repeating sequence: t+1 and t+2 are both predictable.
  tokens = jnp.asarray(np.tile(np.arange(8), (4, 3))[:, :17], jnp.int32)

  @jax.jit
  def step(params, opt_state):
    (loss, aux), grads = jax.value_and_grad(mtp_loss.loss_fn, argnums=1, has_aux=True)(
      graphdef, params, {"tokens": tokens}
    )
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, aux

  _, _, first = step(params, opt_state)
  for _ in range(20):
    params, opt_state, aux = step(params, opt_state)
  assert aux["loss_main"] < 0.5 * first["loss_main"]
  assert aux["loss_mtp_1"] < 0.5 * first["loss_mtp_1"]


def test_preset_builds_deepseek_with_mtp():
  cfg = load_config("configs/deepseek-tiny.yaml").model
  model = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
  assert isinstance(model, Transformer) and model.mtp is not None
  assert model.mtp.heads.eh_proj.shape == (1, 2 * cfg.d_model, cfg.d_model)
  plain = dataclasses.replace(cfg, mla=None, mtp=None, n_kv_heads=4, head_dim=None)
  assert isinstance(nnx.eval_shape(lambda: build(plain, rngs=nnx.Rngs(0))), Transformer)
