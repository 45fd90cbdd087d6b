"""Ragged paged attention: every implementation against the dense reference and against jax's
own attention, on steps mixing prompt chunks, decode tokens and padding, with NaN in every slot
the kernels must not read."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.cache.paged import slot_mapping, write_slots
from atlas_jax.kernels.quantized_kv import code_dtype, dequantize, quantize
from atlas_jax.kernels.ragged_paged_attention import (
  n_blocks,
  plan_blocks,
  ragged_paged_attention,
  ragged_paged_attention_pallas,
  ragged_paged_attention_reference,
  ragged_paged_attention_xla,
)

# (tokens held before the step, new tokens): a long prompt chunk after a prefix, decode tokens,
# a fresh prompt, an empty context's single token, a padding sequence (no tokens).
SEQS = ((40, 21), (7, 1), (0, 13), (63, 1), (0, 1), (0, 0))
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def make_step(seqs=SEQS, *, N=4, K=2, H=16, Z=8, dtype=jnp.float32, latent=None, gap=2, seed=0):
  """(q [T, N, H], pools, block tables, query start/len, kv len, layer): two layers of pools
  built through permuted pages, every slot a step may not read NaN; `gap` padding tokens
  before each sequence's run."""
  rng = np.random.default_rng(seed)
  B = len(seqs)
  kv_len = np.asarray([a + n for a, n in seqs], np.int32)
  query_len = np.asarray([n for _, n in seqs], np.int32)
  query_start = np.zeros(B, np.int32)
  t = 0
  for b, (_, n) in enumerate(seqs):
    t += gap
    query_start[b] = t
    t += n
  T = t + 3  # trailing padding
  M = max(1, -(-int(kv_len.max()) // Z)) + 1  # one spare column
  held = -(-kv_len // Z)
  P = int(held.sum()) + 3
  perm = rng.permutation(P)
  table = np.full((B, M), perm[-1], np.int32)  # past a sequence's pages: a NaN page
  first = 0
  for b in range(B):
    table[b, : held[b]] = perm[first : first + held[b]]
    first += held[b]
  trailing = (K, H) if latent is None else (H,)
  S = M * Z
  positions_BS = np.where(np.arange(S)[None] < kv_len[:, None], np.arange(S)[None], -1)
  slots_BS = slot_mapping(jnp.asarray(table), jnp.asarray(positions_BS), block_size=Z)
  L = 2

  def pool():
    layers = []
    for _ in range(L):
      x = jnp.asarray(rng.normal(size=(B, S, *trailing)), dtype)
      layers.append(write_slots(jnp.full((P, Z, *trailing), jnp.nan, dtype), slots_BS, x))
    return jnp.stack(layers)

  k = pool()
  v = None if latent is not None else pool()
  q = jnp.asarray(rng.normal(size=(T, N, H)), dtype)
  ints = lambda x: jnp.asarray(x, jnp.int32)
  return q, k, v, ints(table), ints(query_start), ints(query_len), ints(kv_len), jnp.int32(1)


def dense_expected(
  q, k, v, table, start, qlen, kvlen, layer, *, window=None, value_dim=None, sinks=None
):
  """Each sequence's queries against jax.nn.dot_product_attention over its keys, masked causal
  (and windowed) by position. Sinks are one more key of zeros and value zeros, whose score is its
  head's sink through the bias."""
  out = np.zeros((q.shape[0], q.shape[1], value_dim or q.shape[2]), np.float32)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  for b in range(table.shape[0]):
    n, held, s0 = int(qlen[b]), int(kvlen[b]), int(start[b])
    if n == 0:
      continue
    keys = k[layer, table[b]].reshape(-1, *k.shape[3:])[:held]
    if v is None:  # latent: one kv head, the values its first C dims (zero-padded: jax's
      keys = keys[:, None]  # attention takes one head dim)
      vals = jnp.where(jnp.arange(keys.shape[-1]) < value_dim, keys, 0)
    else:
      vals = v[layer, table[b]].reshape(-1, *k.shape[3:])[:held]
    qpos = np.arange(held - n, held)[:, None]
    kpos = np.arange(held)[None, :]
    mask = (kpos <= qpos) & (True if window is None else kpos > qpos - window)
    bias = None
    if sinks is not None:
      keys = jnp.concatenate([keys, jnp.zeros_like(keys[:1])])
      vals = jnp.concatenate([vals, jnp.zeros_like(vals[:1])])
      mask = np.concatenate([mask, np.ones((n, 1), bool)], axis=1)
      bias = jnp.zeros((1, q.shape[1], n, held + 1)).at[..., -1].set(sinks[:, None])
    got = jax.nn.dot_product_attention(
      f32(q[s0 : s0 + n])[None],
      f32(keys)[None],
      f32(vals)[None],
      bias=bias,
      mask=jnp.asarray(mask)[None, None],
      scale=q.shape[-1] ** -0.5,
    )
    out[s0 : s0 + n] = np.asarray(got[0])[..., : out.shape[-1]]
  return jnp.asarray(out)


def check(got, want, dtype):
  tol = TOLERANCE[dtype]
  chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32), atol=tol, rtol=tol)


IMPLEMENTATIONS = {
  "xla": ragged_paged_attention_xla,
  "triton": functools.partial(ragged_paged_attention_pallas, backend="triton", interpret=True),
  "mosaic": functools.partial(ragged_paged_attention_pallas, backend="mosaic", interpret=True),
}


def test_reference_matches_jax_attention():
  case = make_step()
  check(
    ragged_paged_attention_reference(*case[:7], layer=case[7]), dense_expected(*case), jnp.float32
  )


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gqa_against_the_reference(impl, dtype):
  case = make_step(dtype=dtype)
  want = ragged_paged_attention_reference(*case[:7], layer=case[7])
  got = IMPLEMENTATIONS[impl](*case[:7], layer=case[7])
  assert got.shape == want.shape and got.dtype == dtype
  check(got, want, dtype)
  assert not jnp.isnan(got).any()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_padding_tokens_get_zeros(impl):
  q, k, v, table, start, qlen, kvlen, layer = make_step()
  got = np.asarray(IMPLEMENTATIONS[impl](q, k, v, table, start, qlen, kvlen, layer=layer))
  owned = np.zeros(q.shape[0], bool)
  for s, n in zip(np.asarray(start), np.asarray(qlen)):
    owned[s : s + n] = True
  assert (got[~owned] == 0).all() and np.abs(got[owned]).sum(-1).min() > 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(impl, window):
  case = make_step()
  want = dense_expected(*case, window=window)
  check(IMPLEMENTATIONS[impl](*case[:7], layer=case[7], sliding_window=window), want, jnp.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_soft_cap(impl):
  case = make_step()
  case = (case[0] * 8.0, *case[1:])  # large scores, so the cap changes them
  want = ragged_paged_attention_reference(*case[:7], layer=case[7], soft_cap=5.0)
  plain = ragged_paged_attention_reference(*case[:7], layer=case[7])
  assert not np.allclose(want, plain, atol=1e-3)
  check(IMPLEMENTATIONS[impl](*case[:7], layer=case[7], soft_cap=5.0), want, jnp.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_latent_pages(impl):
  """MLA's absorbed attention: one kv head, the latent scored over C + R and summed over C."""
  C, R = 32, 16
  case = make_step(N=4, H=C + R, latent=True)
  want = dense_expected(*case, value_dim=C)
  got = IMPLEMENTATIONS[impl](*case[:7], layer=case[7], value_dim=C)
  assert got.shape == (case[0].shape[0], 4, C)
  check(got, want, jnp.float32)


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
@pytest.mark.parametrize("block_q", [1, 4, 32])
def test_block_sizes(impl, block_q):
  case = make_step()
  want = ragged_paged_attention_reference(*case[:7], layer=case[7])
  check(IMPLEMENTATIONS[impl](*case[:7], layer=case[7], block_q=block_q), want, jnp.float32)


def test_triton_splits_and_pages_per_step():
  case = make_step()
  want = ragged_paged_attention_reference(*case[:7], layer=case[7])
  got = ragged_paged_attention_pallas(
    *case[:7], layer=case[7], num_splits=3, pages_per_step=2, interpret=True
  )
  check(got, want, jnp.float32)


def test_one_layer_pools_without_a_layer_index():
  q, k, v, table, start, qlen, kvlen, _ = make_step()
  want = ragged_paged_attention_reference(q, k, v, table, start, qlen, kvlen, layer=jnp.int32(0))
  for impl in IMPLEMENTATIONS.values():
    check(impl(q, k[0], v[0], table, start, qlen, kvlen), want, jnp.float32)


def test_plan_blocks_cuts_each_sequence_in_order():
  start, qlen, kvlen = (
    jnp.asarray(x, jnp.int32) for x in ([0, 5, 6, 20], [5, 1, 0, 9], [9, 3, 0, 9])
  )
  J = n_blocks(20, 4, 4, None)
  plan = plan_blocks(start, qlen, kvlen, block_q=4, n_blocks=J)
  assert J == 9
  np.testing.assert_array_equal(plan.seq_J[:6], [0, 0, 1, 3, 3, 3])
  np.testing.assert_array_equal(plan.q0_J[:6], [0, 4, 5, 20, 24, 28])
  np.testing.assert_array_equal(plan.n_J, [4, 1, 1, 4, 4, 1, 0, 0, 0])
  np.testing.assert_array_equal(plan.pos0_J[:6], [4, 8, 2, 0, 4, 8])
  assert n_blocks(64, 8, 16, max_query_len=16) == 8


def test_dispatcher_runs_xla_on_cpu_and_checks_its_arguments():
  case = make_step()
  want = ragged_paged_attention_xla(*case[:7], layer=case[7])
  np.testing.assert_array_equal(ragged_paged_attention(*case[:7], layer=case[7]), want)
  with pytest.raises(ValueError, match="implementation='cudnn' is not one of"):
    ragged_paged_attention(*case[:7], implementation="cudnn")
  with pytest.raises(ValueError, match=r"query heads N=3 must be a multiple of kv heads K=2"):
    ragged_paged_attention(case[0][:, :3], *case[1:7], layer=case[7])
  with pytest.raises(ValueError, match="sliding_window=0 must be a positive int"):
    ragged_paged_attention(*case[:7], layer=case[7], sliding_window=0)


SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.25], jnp.float32)


def test_reference_sinks_match_jax_attention():
  """A sink is a key of zeros with its logit as bias and a zero value."""
  case = make_step()
  want = dense_expected(*case, window=5, sinks=SINKS)
  check(
    ragged_paged_attention_reference(*case[:7], layer=case[7], sliding_window=5, sinks=SINKS),
    want,
    jnp.float32,
  )


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
  "options",
  [dict(sinks=SINKS), dict(sinks=SINKS, soft_cap=5.0, sliding_window=5)],
  ids=["sinks", "sinks_cap_window"],
)
def test_sinks_against_the_reference(impl, options):
  case = make_step()
  case = (case[0] * 4.0, *case[1:])  # scores of either sign beside the sinks
  want = ragged_paged_attention_reference(*case[:7], layer=case[7], **options)
  plain = ragged_paged_attention_reference(*case[:7], layer=case[7])
  assert not np.allclose(want, plain, atol=1e-3)
  got = IMPLEMENTATIONS[impl](*case[:7], layer=case[7], **options)
  check(got, want, jnp.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_latent_sinks(impl):
  case = make_step(latent=True, H=24, K=1)
  options = dict(value_dim=16, sinks=SINKS, soft_cap=3.0)
  want = ragged_paged_attention_reference(*case[:7], layer=case[7], **options)
  check(IMPLEMENTATIONS[impl](*case[:7], layer=case[7], **options), want, jnp.float32)


def test_bad_sinks_name_the_field():
  case = make_step()
  with pytest.raises(ValueError, match=r"sinks must be one logit per query head, shape \(4,\)"):
    ragged_paged_attention(*case[:7], layer=case[7], sinks=SINKS[:3])


def test_sinks_soft_cap_and_window_lower_for_cuda_and_tpu():
  q = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 128, 16, 2, 128), jnp.bfloat16)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  fn = jax.jit(
    lambda q, k, v, t, s, n, kv, l, sinks: ragged_paged_attention(
      q, k, v, t, s, n, kv, layer=l, sliding_window=32, soft_cap=30.0, sinks=sinks
    )
  )
  args = (q, pool, pool, ints(8, 32), ints(8), ints(8), ints(8), ints())
  args += (jax.ShapeDtypeStruct((8,), jnp.float32),)
  for platform, kernel in (("cuda", "xla.gpu.triton"), ("tpu", "tpu_custom_call")):
    assert kernel in fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _lowered(platform, *, latent=False):
  q = jax.ShapeDtypeStruct((64, 8, 576 if latent else 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 128, 16, 576) if latent else (2, 128, 16, 2, 128), jnp.bfloat16)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  fn = jax.jit(
    lambda q, k, v, t, s, n, kv, l: ragged_paged_attention(
      q, k, v, t, s, n, kv, layer=l, value_dim=512 if latent else None
    )
  )
  args = (q, pool, None if latent else pool, ints(8, 32), ints(8), ints(8), ints(8), ints())
  return fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("latent", [False, True])
def test_the_dispatcher_lowers_the_kernels_for_cuda_and_tpu(latent):
  """On a CPU host: the cuda lowering holds the Triton kernel, the tpu one the Mosaic kernel."""
  cuda, tpu = _lowered("cuda", latent=latent), _lowered("tpu", latent=latent)
  assert "xla.gpu.triton" in cuda and "tpu_custom_call" not in cuda
  assert "tpu_custom_call" in tpu and "triton" not in tpu


def quantized(case, fmt, *, latent=False):
  """The case with its pools as 8-bit codes and their scales (`kernels.quantized_kv`)."""
  q, k, v = case[:3]
  dtype = code_dtype(fmt)
  k8, ks = quantize(k, dtype)
  if latent:
    return (q, k8, None, *case[3:]), dict(k_scale=ks[..., None])
  v8, vs = quantize(v, dtype)
  return (q, k8, v8, *case[3:]), dict(k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_pages_dequantized_as_read(impl, fmt):
  """Every path on int8 / e4m3 pages equals the reference on the same codes dequantized (exact
  arithmetic), and the float pools' attention within the format's rounding."""
  case = make_step()
  qcase, scales = quantized(case, fmt)
  want = ragged_paged_attention_reference(*qcase[:7], layer=case[7], **scales)
  deq = (
    *qcase[:1],
    dequantize(qcase[1], scales["k_scale"]),
    dequantize(qcase[2], scales["v_scale"]),
    *qcase[3:],
  )
  np.testing.assert_array_equal(want, ragged_paged_attention_reference(*deq[:7], layer=case[7]))
  got = IMPLEMENTATIONS[impl](*qcase[:7], layer=case[7], **scales)
  check(got, want, jnp.float32)
  float_out = ragged_paged_attention_reference(*case[:7], layer=case[7])
  err = float(jnp.max(jnp.abs(got - float_out)))
  assert 0 < err < {"int8": 0.03, "fp8": 0.15}[fmt]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_8bit_latent_pages(impl):
  C, R = 32, 16
  case = make_step(N=4, H=C + R, latent=True)
  qcase, scales = quantized(case, "int8", latent=True)
  want = ragged_paged_attention_reference(*qcase[:7], layer=case[7], value_dim=C, **scales)
  got = IMPLEMENTATIONS[impl](*qcase[:7], layer=case[7], value_dim=C, **scales)
  check(got, want, jnp.float32)
  check(got, dense_expected(*case, value_dim=C), jnp.bfloat16)  # within int8's rounding


def test_8bit_pages_need_their_scales():
  case = make_step()
  qcase, scales = quantized(case, "int8")
  with pytest.raises(ValueError, match="q and the pages must share a dtype"):
    ragged_paged_attention(*qcase[:7], layer=case[7])
  with pytest.raises(ValueError, match=r"k_scale and v_scale must be \(2, \d+, 8, 2\)"):
    ragged_paged_attention(*qcase[:7], layer=case[7], k_scale=scales["k_scale"][..., :1])
  with pytest.raises(ValueError, match="scaled pages must be int8 or float8_e4m3fn"):
    ragged_paged_attention(*case[:7], layer=case[7], **scales)


@pytest.mark.parametrize("latent", [False, True])
def test_8bit_pages_lower_for_cuda_and_tpu(latent):
  q = jax.ShapeDtypeStruct((64, 8, 576 if latent else 128), jnp.bfloat16)
  shape = (2, 128, 16, 576) if latent else (2, 128, 16, 2, 128)
  pool = jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
  scale = jax.ShapeDtypeStruct(shape[:-1] + ((1,) if latent else ()), jnp.float32)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  fn = jax.jit(
    lambda q, k, v, t, s, n, kv, l, ks, vs: ragged_paged_attention(
      q, k, v, t, s, n, kv, layer=l, value_dim=512 if latent else None, k_scale=ks, v_scale=vs
    )
  )
  args = (q, pool, None if latent else pool, ints(8, 32), ints(8), ints(8), ints(8), ints())
  args += (scale, None if latent else scale)
  for platform, kernel in (("cuda", "xla.gpu.triton"), ("tpu", "tpu_custom_call")):
    text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert kernel in text
