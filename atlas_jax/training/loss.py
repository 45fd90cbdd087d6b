"""Next-token cross-entropy, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(
  logits_BTV: Array, targets_BT: Array, mask_BT: Array | None = None, *, z_loss: float = 0.0
) -> tuple[Array, dict[str, Array]]:
  """Mean token cross-entropy over unmasked positions (and an optional z-loss on log Z).

  Args:
    logits_BTV: [B, T, V] logits (any float dtype; cast to float32 for the log-softmax).
    targets_BT: i32[B, T] next tokens.
    mask_BT: [B, T] 1 where a position counts; default all.
    z_loss: weight of mean(log(Z)^2), which keeps the softmax normaliser near 1 (PaLM).

  Returns:
    (loss, {"ce": ..., "z_loss": ..., "tokens": ...}).
  """
  logits_BTV = logits_BTV.astype(jnp.float32)
  log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  nll_BT = log_z_BT - target_logit_BT
  mask_BT = jnp.ones_like(nll_BT) if mask_BT is None else mask_BT.astype(jnp.float32)
  tokens = jnp.maximum(mask_BT.sum(), 1.0)
  ce = (nll_BT * mask_BT).sum() / tokens
  zl = (jnp.square(log_z_BT) * mask_BT).sum() / tokens
  return ce + z_loss * zl, {"ce": ce, "z_loss": zl, "tokens": mask_BT.sum()}
