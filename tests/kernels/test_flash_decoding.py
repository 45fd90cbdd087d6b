"""The split heuristic and the log-sum-exp combine shared by the decode kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels import flash_decoding as fd


@pytest.mark.parametrize(
  "programs,capacity,want",
  [
    (32, 4096, 5),  # 32 MLA sequences of 4k: ceil(132 / 32)
    (64 * 8, 2048, 1),  # batch 64 x 8 kv heads already fill the card
    (1, 1 << 20, fd.MAX_SPLITS),  # one long sequence: capped
    (1, 1024, 2),  # short caches: no split under MIN_SPLIT_TOKENS
    (4, 100, 1),
  ],
)
def test_choose_num_splits(programs, capacity, want):
  assert fd.choose_num_splits(programs, capacity) == want


def test_choose_num_splits_follows_the_device_size():
  assert fd.choose_num_splits(32, 4096, target_programs=264) == 8  # capped by 4096 / 512
  assert fd.choose_num_splits(16, 1 << 16, target_programs=78) == 5
  assert fd.device_programs() == fd.TARGET_PROGRAMS  # a CPU: the default


def test_plan_splits_covers_every_page_once():
  for max_blocks in (1, 5, 10, 33):
    for splits in (1, 2, 3, 7, 50):
      for step in (1, 2, 3):
        X, per_split, per_step = fd.plan_splits(
          "f",
          programs=1,
          max_blocks=max_blocks,
          page_size=16,
          num_splits=splits,
          pages_per_step=step,
        )
        assert per_split % per_step == 0 and per_step == step
        assert X <= min(splits, max_blocks)
        # The splits tile [0, X * per_split) and every page of the table lies in one of them.
        assert (X - 1) * per_split < max_blocks <= X * per_split


def test_plan_splits_rejects_bad_overrides():
  with pytest.raises(ValueError, match=r"f: num_splits must be a positive int or None, got -1"):
    fd.plan_splits("f", programs=1, max_blocks=4, page_size=16, num_splits=-1, pages_per_step=1)
  with pytest.raises(ValueError, match="pages_per_step must be a positive int or None, got True"):
    fd.plan_splits("f", programs=1, max_blocks=4, page_size=16, num_splits=1, pages_per_step=True)


def test_combine_splits_is_softmax_over_the_union():
  """Softmax-attention over a split key range, merged, equals attention over the whole range."""
  rng = np.random.default_rng(0)
  s_QS = rng.normal(size=(3, 12)) * 3
  v_SW = rng.normal(size=(12, 5))
  bounds = [(0, 4), (4, 4), (4, 9), (9, 12)]  # one empty split
  outs, lses = [], []
  for lo, hi in bounds:
    if lo == hi:
      outs.append(np.zeros((3, 5)))
      lses.append(np.full((3, 1), -np.inf))
      continue
    s = s_QS[:, lo:hi]
    p = np.exp(s - s.max(1, keepdims=True))
    outs.append(p @ v_SW[lo:hi] / p.sum(1, keepdims=True))
    lses.append(np.log(np.exp(s).sum(1, keepdims=True)))
  got = fd.combine_splits(
    jnp.asarray(np.stack(outs), jnp.float32),
    jnp.asarray(np.stack(lses), jnp.float32),
    axis=0,
    dtype=jnp.float32,
  )
  p = jax.nn.softmax(s_QS, axis=1)
  np.testing.assert_allclose(got, p @ v_SW, rtol=1e-5, atol=1e-5)
  # Every split empty: zeros, not NaN.
  empty = fd.combine_splits(
    jnp.zeros((2, 3, 5)), jnp.full((2, 3, 1), -jnp.inf), axis=0, dtype=jnp.bfloat16
  )
  assert empty.dtype == jnp.bfloat16 and not np.asarray(empty, np.float32).any()
