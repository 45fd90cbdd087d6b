"""Next-token cross-entropy, computed in float32: from logits, or chunked from hidden states.

`cross_entropy` takes [B, T, V] logits. `chunked_cross_entropy` takes the final hidden states
[B, T, D] and the output head and never holds more than one chunk of the sequence's float32 logits
([B, C, V]): the forward pass runs the LM-head matmul and the log-softmax chunk by chunk and keeps
only log Z per token; the backward pass recomputes each chunk's logits from the hidden states and
turns them straight into the chunk's gradients. At a 128k vocabulary the [B, T, V] float32 logits
(and their gradient) are the largest tensors of a training step; chunked, the saved residuals are
the hidden states, the targets, the mask and one float per token.
"""

from __future__ import annotations

import functools

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
  # Named, so a step's profile (`bench/step_profile.py`) can tell the loss's work apart.
  with jax.named_scope("loss"):
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    nll_BT = log_z_BT - target_logit_BT
    return _reduce(nll_BT, log_z_BT, mask_BT, z_loss)


def _reduce(nll_BT, log_z_BT, mask_BT, z_loss):
  mask_BT = jnp.ones_like(nll_BT) if mask_BT is None else mask_BT.astype(jnp.float32)
  tokens = jnp.maximum(mask_BT.sum(), 1.0)
  ce = (nll_BT * mask_BT).sum() / tokens
  zl = (jnp.square(log_z_BT) * mask_BT).sum() / tokens
  return ce + z_loss * zl, {"ce": ce, "z_loss": zl, "tokens": mask_BT.sum()}


def chunked_cross_entropy(
  h_BTD: Array,
  targets_BT: Array,
  mask_BT: Array | None = None,
  *,
  head_DV: Array | None = None,
  embed_VD: Array | None = None,
  chunk: int,
  z_loss: float = 0.0,
  soft_cap: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  """`cross_entropy(h @ head, ...)` without materialising the [B, T, V] logits.

  Args:
    h_BTD: [B, T, D] final (normalised) hidden states, in the compute dtype.
    targets_BT, mask_BT, z_loss: as `cross_entropy`.
    head_DV: [D, V] the output head; or, for tied embeddings, embed_VD: [V, D] the embedding
      table (used as is: its transpose is never made). Either is cast once to h's dtype; its
      gradient comes back in its own dtype, accumulated over chunks in float32.
    chunk: sequence positions per chunk (C). T need not be a multiple: the last chunk is padded
      with masked positions.
    soft_cap: the logits capped as c * tanh(l / c) (Gemma 2's final_logit_softcapping), or None.

  Returns:
    (loss, aux) as `cross_entropy`, equal to it up to float rounding, with the same gradients.
  """
  if (head_DV is None) == (embed_VD is None):
    raise ValueError("chunked_cross_entropy: give exactly one of head_DV and embed_VD")
  if not isinstance(chunk, int) or chunk <= 0:
    raise ValueError(f"chunked_cross_entropy: chunk={chunk!r} must be a positive int")
  tied = head_DV is None
  head = embed_VD if tied else head_DV
  with jax.named_scope("loss"):  # as in `cross_entropy`
    mask_BT = (
      jnp.ones(targets_BT.shape, jnp.float32) if mask_BT is None else mask_BT.astype(jnp.float32)
    )
    nll_sum, zl_sum = _masked_sums(h_BTD, head, targets_BT, mask_BT, chunk, tied, soft_cap)
    tokens = jnp.maximum(mask_BT.sum(), 1.0)
    ce, zl = nll_sum / tokens, zl_sum / tokens
    return ce + z_loss * zl, {"ce": ce, "z_loss": zl, "tokens": mask_BT.sum()}


def _to_chunks(x_BT, n: int, C: int) -> Array:
  """[B, T, ...] -> [n, B, C, ...], zero-padding T up to n * C."""
  B, T = x_BT.shape[:2]
  pad = [(0, 0), (0, n * C - T)] + [(0, 0)] * (x_BT.ndim - 2)
  x_BT = jnp.pad(x_BT, pad)
  return jnp.moveaxis(x_BT.reshape(B, n, C, *x_BT.shape[2:]), 1, 0)


def _from_chunks(x_nBC, T: int) -> Array:
  """[n, B, C, ...] -> [B, T, ...], dropping the padding."""
  n, B, C = x_nBC.shape[:3]
  return jnp.moveaxis(x_nBC, 0, 1).reshape(B, n * C, *x_nBC.shape[3:])[:, :T]


def _chunk_logits(h_BCD: Array, w: Array, tied: bool, soft_cap: float | None = None) -> Array:
  """f32[B, C, V]: the chunk's logits, compute-dtype operands with float32 accumulation, capped
  as c * tanh(l / c) with `soft_cap`."""
  spec = "BCD,VD->BCV" if tied else "BCD,DV->BCV"
  logits_BCV = jnp.einsum(spec, h_BCD, w, preferred_element_type=jnp.float32)
  return logits_BCV if soft_cap is None else soft_cap * jnp.tanh(logits_BCV / soft_cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _masked_sums(h_BTD, head, targets_BT, mask_BT, chunk, tied, soft_cap=None):
  """(sum of mask * nll, sum of mask * log(Z)^2), both f32[]."""
  return _masked_sums_fwd(h_BTD, head, targets_BT, mask_BT, chunk, tied, soft_cap)[0]


def _masked_sums_fwd(h_BTD, head, targets_BT, mask_BT, chunk, tied, soft_cap=None):
  T = h_BTD.shape[1]
  C = min(chunk, T)
  n = -(-T // C)
  w = head.astype(h_BTD.dtype)  # cast once, not per chunk

  def body(sums, xs):
    h_BCD, t_BC, m_BC = xs
    logits_BCV = _chunk_logits(h_BCD, w, tied, soft_cap)
    log_z_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_BC = jnp.take_along_axis(logits_BCV, t_BC[..., None], axis=-1)[..., 0]
    nll, zl = sums
    nll = nll + ((log_z_BC - target_BC) * m_BC).sum()
    zl = zl + (jnp.square(log_z_BC) * m_BC).sum()
    return (nll, zl), log_z_BC

  xs = (_to_chunks(h_BTD, n, C), _to_chunks(targets_BT, n, C), _to_chunks(mask_BT, n, C))
  zero = jnp.zeros((), jnp.float32)
  sums, log_z_nBC = jax.lax.scan(body, (zero, zero), xs)
  # Saved for the backward pass: the hidden states, targets, mask and log Z per position.
  return sums, (h_BTD, head, targets_BT, mask_BT, _from_chunks(log_z_nBC, T))


def _masked_sums_bwd(chunk, tied, soft_cap, residuals, cotangents):
  h_BTD, head, targets_BT, mask_BT, log_z_BT = residuals
  g_nll, g_zl = cotangents
  T = h_BTD.shape[1]
  C = min(chunk, T)
  n = -(-T // C)
  dtype = h_BTD.dtype
  w = head.astype(dtype)

  def body(dw, xs):
    h_BCD, t_BC, m_BC, lz_BC = xs
    logits_BCV = _chunk_logits(h_BCD, w, tied, soft_cap)
    p_BCV = jnp.exp(logits_BCV - lz_BC[..., None])  # softmax from the saved log Z
    # d(nll)/dlogits = p - onehot(target); d(log Z^2)/dlogits = 2 log Z p.
    scale_BC = m_BC * (g_nll + 2.0 * g_zl * lz_BC)
    onehot_BCV = jax.nn.one_hot(t_BC, p_BCV.shape[-1], dtype=jnp.float32)
    d_BCV = p_BCV * scale_BC[..., None] - onehot_BCV * (m_BC * g_nll)[..., None]
    if soft_cap is not None:  # through the cap: d(c tanh(l / c))/dl = 1 - tanh(l / c)^2
      d_BCV = d_BCV * (1.0 - jnp.square(logits_BCV / soft_cap))
    d_BCV = d_BCV.astype(dtype)
    if tied:
      dh_BCD = jnp.einsum("BCV,VD->BCD", d_BCV, w, preferred_element_type=jnp.float32)
      dw = dw + jnp.einsum("BCV,BCD->VD", d_BCV, h_BCD, preferred_element_type=jnp.float32)
    else:
      dh_BCD = jnp.einsum("BCV,DV->BCD", d_BCV, w, preferred_element_type=jnp.float32)
      dw = dw + jnp.einsum("BCD,BCV->DV", h_BCD, d_BCV, preferred_element_type=jnp.float32)
    return dw, dh_BCD.astype(dtype)

  xs = (
    _to_chunks(h_BTD, n, C),
    _to_chunks(targets_BT, n, C),
    _to_chunks(mask_BT, n, C),
    _to_chunks(log_z_BT, n, C),
  )
  dw, dh_nBCD = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), xs)
  return _from_chunks(dh_nBCD, T), dw.astype(head.dtype), None, None


_masked_sums.defvjp(_masked_sums_fwd, _masked_sums_bwd)
