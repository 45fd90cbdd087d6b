"""`dense`: the projections' matmul, and its gradient with the activation transposed first."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax import platforms
from atlas_jax.model.layers import Ops, dense


@pytest.mark.parametrize(
  "x_shape, w_shape, contract, einsum",
  [
    ((2, 5, 6), (6, 3, 4), 1, "btd,dnh->btnh"),  # q, k, v
    ((2, 5, 3, 4), (3, 4, 6), 2, "btnh,nhd->btd"),  # o
    ((10, 6), (6, 7), 1, "md,df->mf"),  # the MLP's
  ],
)
def test_dense_and_its_gradients_equal_the_einsums(x_shape, w_shape, contract, einsum):
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
  y, vjp = jax.vjp(functools.partial(dense, contract=contract), x, w)
  want, want_vjp = jax.vjp(lambda x, w: jnp.einsum(einsum, x, w), x, w)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  dy = jax.random.normal(ky, y.shape)
  for got, expected in zip(vjp(dy), want_vjp(dy), strict=True):
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def compiled_dots(f, *args) -> list[str]:
  text = jax.jit(f).lower(*args).compile().as_text()
  return [line for line in text.splitlines() if " dot(" in line]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the transpose is copied on a CPU only")
def test_copied_weight_grads_contract_no_major_axis():
  # x^T dy with the transpose folded into the dot contracts x's major axis, which XLA's CPU
  # backend runs with its own loops, not a GEMM library's: `Ops.copied_weight_grads` copies x
  # transposed first, and a CPU model is built with it (`platforms.model_ops`).
  x, w, dy = jnp.ones((64, 32)), jnp.ones((32, 48)), jnp.ones((64, 48))
  folded = compiled_dots(lambda x, dy: x.T @ dy, x, dy)
  assert any("lhs_contracting_dims={0}" in line for line in folded)  # what the copy avoids
  copied = Ops(copied_weight_grads=True)
  weight_grad = lambda x, w, dy: jax.vjp(lambda w: dense(x, w, 1, copied), w)[1](dy)[0]
  assert not any(
    "lhs_contracting_dims={0}" in line for line in compiled_dots(weight_grad, x, w, dy)
  )
  assert Ops(**platforms.model_ops("cpu")) == Ops(True, True)
  assert Ops(**platforms.model_ops("gpu")) == Ops() == Ops(**platforms.model_ops("tpu"))
