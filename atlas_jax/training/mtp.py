"""The multi-token-prediction training loss: L = L_main + lambda * mean_j L_j.

A drop-in for `atlas_jax.training.step.loss_fn` (same signature) for models with MTP heads (a
`Transformer` whose config sets `mtp`). Head j (1-based) at input position t
predicts token t + 1 + j; positions whose target lies past the window, in another packed
document, or under a zero of the loss mask do not count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.training.experts import router_terms
from atlas_jax.training.loss import chunked_cross_entropy, cross_entropy

Array = jax.Array


def shifted_targets(
  targets_BT: Array, mask_BT: Array, segment_ids_BT: Array | None, j: int
) -> tuple[Array, Array]:
  """Targets i32[B, T] and mask f32[B, T] of the head predicting j tokens past the next one.

  Position t's target is targets[t + j]; it counts if t + j < T, the next-token mask counts it,
  and (packed data) it lies in t's document.
  """
  T = targets_BT.shape[1]
  tgt_BT = jnp.roll(targets_BT, -j, axis=1)
  valid_BT = (jnp.arange(T) < T - j)[None, :] & (jnp.roll(mask_BT, -j, axis=1) > 0)
  if segment_ids_BT is not None:
    valid_BT &= jnp.roll(segment_ids_BT, -j, axis=1) == segment_ids_BT
  return tgt_BT, valid_BT.astype(jnp.float32)


def loss_fn(
  graphdef: nnx.GraphDef,
  params,
  batch: dict[str, Array],
  *,
  loss_chunk: int = 0,
  moe_aux_loss: float = 0.0,
  moe_z_loss: float = 0.0,
) -> tuple[Array, dict]:
  """MTP loss on batch["tokens"] i32[B, T + 1]; aux has loss_main and loss_mtp_{j} per head.

  `loss_chunk` > 0: every head's cross-entropy is the chunked one (no [B, T, V] logits).
  Mixture-of-experts models add the trunk routers' losses (`atlas_jax.training.experts`).
  """
  tokens_BT1 = batch["tokens"]
  inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
  segment_ids_BT = batch.get("segment_ids")
  mask_BT = batch.get("loss_mask")
  mask_BT = jnp.ones(targets_BT.shape, jnp.float32) if mask_BT is None else mask_BT
  model = nnx.merge(graphdef, params)
  # Logits [B, T, V] and [J, B, T, V], or with `loss_chunk` the hidden states [.., D] that the
  # chunked loss projects itself.
  outputs = model.forward_train(
    inputs_BT,
    positions_BT=batch.get("positions"),
    segment_ids_BT=segment_ids_BT,
    hidden=bool(loss_chunk),
  )
  out, mtp_J = outputs.main, outputs.mtp
  if loss_chunk:
    head = model.output_head()
    ce = lambda h_BTD, t_BT, m_BT: chunked_cross_entropy(
      h_BTD, t_BT, m_BT, chunk=loss_chunk, **head
    )
  else:
    ce = cross_entropy
  main, aux = ce(out, targets_BT, mask_BT)
  aux = {**aux, "loss_main": main}
  head_losses = []
  for j in range(1, mtp_J.shape[0] + 1):
    tgt_BT, m_BT = shifted_targets(targets_BT, mask_BT, segment_ids_BT, j)
    loss_j, _ = ce(mtp_J[j - 1], tgt_BT, m_BT)
    aux[f"loss_mtp_{j}"] = loss_j
    head_losses.append(loss_j)
  weight = model.cfg.mtp.loss_weight
  routers, router_aux = router_terms(outputs.router, aux_loss=moe_aux_loss, z_loss=moe_z_loss)
  return main + weight * jnp.mean(jnp.stack(head_losses)) + routers, {**aux, **router_aux}
