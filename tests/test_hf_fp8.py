"""FP8 Hugging Face folders (config.json's `quantization_config` with `quant_method: fp8`): tiny
random models whose projections are quantized here to e4m3 with DeepSeek-V3's 128 x 128 block
scales (`weight_scale_inv`, partial edge blocks included) or one scale per tensor, loaded and
checked against transformers running the same model on the dequantized weights."""

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from atlas_jax import hf  # noqa: E402

from .test_hf import V, build_hf  # noqa: E402

# As DeepSeek-V3's config.json writes it.
DEEPSEEK_FP8 = {
  "activation_scheme": "dynamic",
  "fmt": "e4m3",
  "quant_method": "fp8",
  "weight_block_size": [128, 128],
}
E4M3_MAX = 448.0
# A tiny DeepSeek-V3 with a dense layer and a MoE one; 160 = 128 + a partial block, whose kept
# scales are the 32-wide tiles the edge cuts.
DEEPSEEK_MOE = dict(
  hidden_size=160,
  intermediate_size=288,
  moe_intermediate_size=136,
  first_k_dense_replace=1,
  n_routed_experts=4,
  num_experts_per_tok=2,
  n_group=1,
  topk_group=1,
)


def quantize(w: torch.Tensor, block: tuple[int, int] | None):
  """(e4m3 codes, float32 scale, the dequantized weight) of `w` [..., out, in]: one scale per
  block of the last two dimensions (edge blocks partial), or per tensor (block None)."""
  if block is None:
    scale = w.abs().max() / E4M3_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, scale.reshape(()), q.float() * scale
  bn, bk = block
  out, inp = w.shape[-2:]
  nb_out, nb_in = -(-out // bn), -(-inp // bk)
  padded = torch.nn.functional.pad(w, (0, nb_in * bk - inp, 0, nb_out * bn - out))
  blocks = padded.unflatten(-1, (nb_in, bk)).unflatten(-3, (nb_out, bn))  # [.., no, bn, ni, bk]
  scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / E4M3_MAX  # [..., no, ni]
  q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
  deq = (q.float() * scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)
  q = q.flatten(-2).flatten(-3, -2)
  return q[..., :out, :inp].contiguous(), scale, deq[..., :out, :inp].contiguous()


def write_fp8(folder, model, qconfig, *, scale_name="weight_scale_inv", extra=None):
  """The folder `model` was saved in, its projections rewritten as FP8 with their scales and
  config.json's `quantization_config` set; `model` then holds the dequantized weights."""
  block = qconfig.get("weight_block_size")
  tensors, deq = {}, {}
  for name, t in model.state_dict().items():
    projection = name.endswith(("_proj.weight", "_mqa.weight", "gate_up_proj", "experts.down_proj"))
    if projection and "lm_head" not in name and t.ndim >= 2:
      q, scale, d = quantize(t.float(), tuple(block) if block else None)
      scale_key = (
        f"{name.removesuffix('.weight')}.{scale_name}"
        if name.endswith(".weight")
        else f"{name}_scale_inv"  # transformers v5's fused experts
      )
      tensors[name], tensors[scale_key], deq[name] = q, scale.contiguous(), d
    else:
      tensors[name] = t.contiguous()
  tensors.update(extra or {})
  for f in folder.glob("*.safetensors*"):
    f.unlink()
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  cfg = json.loads((folder / "config.json").read_text())
  cfg["quantization_config"] = qconfig
  (folder / "config.json").write_text(json.dumps(cfg))
  model.load_state_dict({**model.state_dict(), **deq})
  return deq


def logits(model, toks):
  with torch.no_grad():
    return model(torch.tensor(toks)).logits.numpy()


def check_logits(folder, model, **load_kw):
  ours = hf.load(folder, **load_kw)
  toks = np.random.RandomState(0).randint(0, V, (2, 24))
  got = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
  return ours, np.abs(got - logits(model, toks)).max()


def test_deepseek_v3_block_scaled_folder_matches_transformers(tmp_path, caplog):
  from .test_hf_deepseek import build_hf as build_deepseek

  model = build_deepseek(tmp_path, **DEEPSEEK_MOE)
  deq = write_fp8(tmp_path, model, DEEPSEEK_FP8)
  assert any("experts" in n for n in deq) and any("kv_a_proj" in n for n in deq)
  with caplog.at_level(logging.INFO, logger="atlas_jax.hf.fp8"):
    ours, err = check_logits(tmp_path, model)
  assert ours.cfg.moe is not None and err <= 1e-4, err
  assert (
    "FP8 checkpoint (128x128 block scales, activation_scheme dynamic): 21 parameters kept in FP8 "
    "(weight-only: codes dequantized in the step's matmuls; backend cpu); 0 dequantized"
  ) in caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="atlas_jax.hf.fp8"):
    _, err = check_logits(tmp_path, model, fp8_weights="dequantize")
  assert err <= 1e-4, err
  assert (
    f"FP8 checkpoint (128x128 block scales, activation_scheme dynamic): {len(deq)} weights "
    "dequantized to float32 at load (weight-only)"
  ) in caplog.text


def test_llama_block_and_per_tensor_scales_match_transformers(tmp_path, caplog):
  model = build_hf("Llama", tmp_path / "b", hidden_size=192, intermediate_size=320)
  write_fp8(tmp_path / "b", model, DEEPSEEK_FP8)
  assert check_logits(tmp_path / "b", model)[1] <= 1e-4
  # one scale per tensor, under its per-tensor name, and static activation scales left unused
  # (the folder loads; a W8A8 step scales activations per token), which the log counts
  model = build_hf("Qwen2", tmp_path / "t")
  extra = {
    f"model.layers.{i}.self_attn.{p}_proj.input_scale": torch.tensor(0.5)
    for i in range(2)
    for p in "qkv"
  }
  qconfig = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}
  write_fp8(tmp_path / "t", model, qconfig, scale_name="weight_scale", extra=extra)
  with caplog.at_level(logging.INFO, logger="atlas_jax.hf.fp8"):
    assert check_logits(tmp_path / "t", model)[1] <= 1e-4
  assert (
    "activation_scheme static): 14 parameters kept in FP8 (weight-only: codes dequantized in "
    "the step's matmuls; backend cpu); 0 dequantized to float32 at load; 6 static activation "
    "scales unused"
  ) in caplog.text
  w8a8 = hf.load(tmp_path / "t", fp8_activations="dynamic")
  assert w8a8.blocks.attn.ops.w8a8 is True
  assert len(_f8_dots(_lowered(w8a8, "cuda"))) >= 7
  with pytest.raises(hf.HFLoadError, match="fp8_activations='static' needs an input_scale.*o_proj"):
    hf.load(tmp_path / "t", fp8_activations="static")
  ours, _ = check_logits(tmp_path / "t", model, dtype="bfloat16")
  assert ours.embed[...].dtype == jnp.bfloat16
  stray = {**extra, "model.layers.0.self_attn.x_proj.input_scale": torch.tensor(0.5)}
  write_fp8(tmp_path / "t", model, qconfig, scale_name="weight_scale", extra=stray)
  with pytest.raises(hf.HFLoadError, match=r"x_proj.input_scale has no weight .*x_proj.weight"):
    hf.load(tmp_path / "t")


def test_bad_fp8_folders_are_named(tmp_path):
  model = build_hf("Llama", tmp_path, hidden_size=192, intermediate_size=320)
  write_fp8(tmp_path, model, DEEPSEEK_FP8)
  cfg = json.loads((tmp_path / "config.json").read_text())
  bad = {**cfg, "quantization_config": {**DEEPSEEK_FP8, "weight_block_size": [64, 64]}}
  (tmp_path / "config.json").write_text(json.dumps(bad))
  shapes = (
    r"down_proj.weight: scale of shape \(2, 3\) for a weight of shape \(192, 320\) in 64 x 64"
  )
  with pytest.raises(hf.HFLoadError, match=shapes + r" blocks; expected \(3, 5\)"):
    hf.load(tmp_path)
  bad["quantization_config"] = {"quant_method": "gptq"}
  (tmp_path / "config.json").write_text(json.dumps(bad))
  with pytest.raises(hf.HFLoadError, match="quant_method'='gptq' is not supported; supported: fp8"):
    hf.load(tmp_path)
  del bad["quantization_config"]
  (tmp_path / "config.json").write_text(json.dumps(bad))
  with pytest.raises(hf.HFLoadError, match="unexpected tensors.*weight_scale_inv"):
    hf.load(tmp_path)


def qarrays(model):
  """The model's parameters held as QArrays, by dotted path."""
  from flax import nnx

  from atlas_jax.quant import QArray

  return {
    ".".join(map(str, path)): node.get_value()
    for path, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Param) and isinstance(node.get_value(), QArray)
  }


def test_fp8_folder_served_as_it_ships(tmp_path):
  """Every projection keeps its e4m3 codes and 128 x 128 block scales: the device holds the
  checkpoint's bytes, and the logits are the dequantized load's and transformers'."""
  from safetensors import safe_open

  model = build_hf("Llama", tmp_path, hidden_size=256, intermediate_size=384)
  write_fp8(tmp_path, model, DEEPSEEK_FP8)
  ours, err = check_logits(tmp_path, model)
  assert err <= 1e-4, err
  kept = qarrays(ours)
  names = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")
  assert sorted(kept) == sorted(f"blocks.{n}" for n in names)
  stored = {"codes": 0, "scales": 0}
  with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
    for name in f.keys():
      t = f.get_tensor(name)
      if t.dtype == torch.float8_e4m3fn:
        stored["codes"] += t.numel()
      elif name.endswith("weight_scale_inv"):
        stored["scales"] += t.numel() * t.element_size()
  held = {
    "codes": sum(q.qvalue.nbytes for q in kept.values()),
    "scales": sum(q.scale.nbytes for q in kept.values()),
  }
  assert all(q.qvalue.dtype == jnp.float8_e4m3fn for q in kept.values())
  assert held == stored, (held, stored)
  # q_proj [N * H, D] = [256, 256] held as [D, N, H]: a 128-row block is two 64-wide heads.
  assert {q.scale.shape for p, q in kept.items() if p.endswith("wq")} == {(2, 2, 2, 1)}
  toks = jnp.asarray(np.random.RandomState(1).randint(0, V, (2, 16)), jnp.int32)
  expanded = hf.load(tmp_path, fp8_weights="dequantize")
  assert not qarrays(expanded)
  np.testing.assert_allclose(ours(toks), expanded(toks), atol=2e-5, rtol=1e-5)


def w8a8_bound(x, w_deq, contract):
  """The W8A8 product's error bound: each activation rounded to e4m3 (3 mantissa bits: a
  relative error of at most 2^-4, subnormals aside) against the exact weights."""
  C = int(np.prod(w_deq.shape[:contract]))
  return 2.0**-4 * np.abs(x.reshape(-1, C)) @ np.abs(w_deq.reshape(C, -1)) + 1e-6


def test_w8a8_product_against_float_reference(tmp_path):
  """The e4m3 x e4m3 product (the accelerator path, run here on the CPU) against the float
  product with the same weights: within e4m3's rounding of the activations, per output; per
  channel, 128 x 128 blocks and an output projection's two contracted axes."""
  import qwix

  from atlas_jax.quant import QArray, dequantized, quantized_product, w8a8_product

  rng = np.random.RandomState(0)
  x = rng.randn(3, 5, 256).astype(np.float32)
  x[0, 0] = 0.0  # an all-zero token keeps a finite scale
  w = jnp.asarray(rng.randn(256, 384).astype(np.float32))
  per_channel = qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=(1,))
  blocks = qwix.quantize(w, jnp.float8_e4m3fn, tiled_axes={0: 128, 1: 128})
  assert blocks.scale.shape == (2, 3)
  for q in (per_channel, blocks):
    ref = np.asarray(x.reshape(-1, 256) @ np.asarray(dequantized(q))).reshape(3, 5, 384)
    got = np.asarray(w8a8_product(jnp.asarray(x), q, 1))
    err = np.abs(got - ref).reshape(-1, 384)
    assert (err <= w8a8_bound(x, np.asarray(dequantized(q)), 1)).all()
    assert err.max() > 0  # the activations were quantized: not the float product
    np.testing.assert_array_equal(got, quantized_product(jnp.asarray(x), q, 1, w8a8=True))
  # W_O [N, H, D]: blocks of 128 over the flattened N * H (two 64-wide heads per scale)
  wo = jnp.asarray(rng.randn(4, 64, 256).astype(np.float32))
  q = qwix.quantize(wo, jnp.float8_e4m3fn, tiled_axes={0: 2, 1: 64, 2: 128})
  xo = rng.randn(2, 3, 4, 64).astype(np.float32)
  ref = np.einsum("btnh,nhd->btd", xo, np.asarray(dequantized(q)))
  got = np.asarray(w8a8_product(jnp.asarray(xo), q, 2))
  assert (np.abs(got - ref).reshape(-1, 256) <= w8a8_bound(xo, np.asarray(dequantized(q)), 2)).all()
  # e5m2 codes cannot run W8A8: quantized_product falls back to weight-only
  q5 = QArray(per_channel.qvalue.astype(jnp.float8_e5m2), per_channel.scale, qtype=jnp.float8_e5m2)
  np.testing.assert_allclose(
    quantized_product(jnp.asarray(x), q5, 1, w8a8=True),
    np.asarray(x.reshape(-1, 256) @ np.asarray(dequantized(q5))).reshape(3, 5, 384),
    rtol=1e-5,
    atol=1e-4,
  )


def _lowered(model, platform):
  import jax
  from flax import nnx

  graphdef, state = nnx.split(model)
  toks = jnp.zeros((1, 8), jnp.int32)
  fn = jax.jit(lambda state, toks: nnx.merge(graphdef, state)(toks))
  return fn.trace(state, toks).lower(lowering_platforms=(platform,)).as_text()


def _f8_dots(text):
  return [ln for ln in text.splitlines() if "dot_general" in ln and "f8E4M3FN" in ln]


def test_fp8_folder_runs_w8a8_where_asked_and_logs_it(tmp_path, caplog):
  """fp8_activations="dynamic": the step lowered for cuda multiplies e4m3 operands; the CPU
  default (no FP8 matmuls) dequantizes the weights, with no f8 dot; the log says which."""
  # std 0.05: a random model whose activations do not grow from layer to layer (at 0.2 the
  # activations' rounding is amplified into logits no trained model would give).
  model = build_hf("Llama", tmp_path, std=0.05, hidden_size=256, intermediate_size=384)
  write_fp8(tmp_path, model, DEEPSEEK_FP8)
  with caplog.at_level(logging.INFO, logger="atlas_jax.hf.fp8"):
    w8a8, err = check_logits(tmp_path, model, fp8_activations="dynamic")
  assert "14 parameters kept in FP8 (W8A8: activations quantized to e4m3 per token" in caplog.text
  assert err <= 0.15 * np.abs(logits(model, np.zeros((1, 4), np.int64))).max(), err
  assert len(_f8_dots(_lowered(w8a8, "cuda"))) >= 7
  weight_only = hf.load(tmp_path)
  assert weight_only.blocks.attn.ops.w8a8 is False
  assert not _f8_dots(_lowered(weight_only, "cpu"))
  with pytest.raises(hf.HFLoadError, match="fp8_activations='static' needs an input_scale"):
    hf.load(tmp_path, fp8_activations="static")
  with pytest.raises(hf.HFLoadError, match="fp8_activations='per-token' is not one of"):
    hf.load(tmp_path, fp8_activations="per-token")


def held_bytes(model):
  """Bytes of every variable `model` holds: a QArray's codes and scales, any other array."""
  import jax
  from flax import nnx

  from atlas_jax.quant import QArray

  leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, QArray))
  return sum(
    x.qvalue.nbytes + x.scale.nbytes if isinstance(x, QArray) else x.nbytes for x in leaves
  )


@pytest.mark.parametrize("case", ["llama-blocks", "deepseek-partial-blocks", "qwen2-per-tensor"])
def test_planner_counts_what_the_fp8_load_holds(tmp_path, case):
  """atlas-plan's serving weight bytes for an FP8 folder are the bytes of the arrays `hf.load`
  returns, exactly: codes and scales with --fp8-weights keep, the serving dtype with dequantize."""
  from atlas_jax.plan.cli import build_plan, parser
  from atlas_jax.plan.report import render

  if case == "llama-blocks":
    model = build_hf("Llama", tmp_path, hidden_size=256, intermediate_size=384)
    qconfig = DEEPSEEK_FP8
  elif case == "qwen2-per-tensor":
    model = build_hf("Qwen2", tmp_path)
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}
  else:
    from .test_hf_deepseek import build_hf as build_deepseek

    model = build_deepseek(tmp_path, **DEEPSEEK_MOE)
    qconfig = DEEPSEEK_FP8
  write_fp8(tmp_path, model, qconfig)
  argv = ["--config", str(tmp_path), "--devices", "1", "--tensor", "1"]
  for how in ("keep", "dequantize"):
    plan = build_plan(parser().parse_args([*argv, "--fp8-weights", how]))
    loaded = hf.load(tmp_path, fp8_weights=how)
    assert plan["serving"]["fp8_weights"] == how
    assert plan["serving"]["weight_bytes_per_device"] == held_bytes(loaded), how
    if how == "keep":
      assert qarrays(loaded)
      assert "weights per device (FP8 codes and scales kept)" in render(plan)
      kept = plan["serving"]["weight_bytes_per_device"]
  assert kept < plan["serving"]["weight_bytes_per_device"] / 2


def test_kept_weight_maps_block_indices_a_byte_per_element(tmp_path):
  """`kept_weight` moves the block indices through the family's mapping as uint8 tables of the
  codes' shape, one byte of the index at a time (experts' E x blocks indices need two here): no
  array handed to the mapping holds more bytes than its codes. The kept QArray dequantizes to
  the stored weights', mapped; a mapping that interleaves blocks (tiles too small to keep)
  falls back to dequantizing, per element."""
  from atlas_jax.hf import fp8
  from atlas_jax.quant import dequantized

  E, O, I = 50, 64, 96  # 50 x 2 x 3 = 300 blocks of 32 x 32: indices of two bytes
  rng = np.random.RandomState(0)
  stored = [torch.tensor(rng.randn(O, I).astype(np.float32)) for _ in range(E)]
  codes, scales, deq = zip(*[quantize(w, (32, 32)) for w in stored], strict=True)
  codes = [c.view(torch.uint8).numpy().view(jnp.float8_e4m3fn) for c in codes]
  scales = [s.numpy() for s in scales]
  seen = []

  def load(*ws):  # the experts stacked as [E, in, out], as the families lay them out
    seen.append([(w.dtype, w.nbytes) for w in ws])
    return {("w",): jnp.stack([w.T for w in ws])}

  kw = dict(keep=lambda p: True, dtype=jnp.float32, names=[f"e{i}" for i in range(E)])
  out, done = fp8.kept_weight(load, codes, scales, (32, 32), **kw)
  assert done == [(("w",), True)] and out["w",].scale.shape == (E, 3, 2)
  want = np.stack([d.numpy().T for d in deq])
  np.testing.assert_array_equal(np.asarray(dequantized(out["w",])), want)
  # the codes once, then the index's two bytes twice (where it changes; its value per tile)
  assert len(seen) == 5
  assert seen[0] == [(np.dtype(jnp.float8_e4m3fn), O * I)] * E
  assert all(call == [(np.dtype(np.uint8), O * I)] * E for call in seen[1:])

  # rows and columns interleaved across blocks: a tile of one element, dequantized
  rows, cols = np.arange(O).reshape(2, -1).T.ravel(), np.arange(I).reshape(3, -1).T.ravel()
  interleave = lambda *ws: {("w",): jnp.stack([w[rows][:, cols] for w in ws])}
  out, done = fp8.kept_weight(interleave, codes, scales, (32, 32), **kw)
  assert done == [(("w",), False)]
  np.testing.assert_array_equal(
    np.asarray(out["w",]), np.stack([d.numpy()[rows][:, cols] for d in deq])
  )


def test_w8a8_product_with_a_static_input_scale():
  """A StaticQArray's product quantizes every row by its input scale, not its own amax: within
  e4m3's rounding of x / scale (relative 2^-4, subnormals 2^-10 absolute) of the float product,
  and values past 448 x scale clipped to it."""
  import qwix

  from atlas_jax.quant import StaticQArray, dequantized, w8a8_product

  rng = np.random.RandomState(0)
  x = rng.randn(3, 5, 256).astype(np.float32)
  x[0, 0] *= 1e-3  # a small token: under a per-tensor scale its values fall to subnormals
  w = jnp.asarray(rng.randn(256, 384).astype(np.float32))
  q = qwix.quantize(w, jnp.float8_e4m3fn, tiled_axes={0: 128, 1: 128})
  w_deq = np.asarray(dequantized(q))
  s = float(np.abs(x).max()) / E4M3_MAX
  static = StaticQArray(q.qvalue, q.scale, qtype=q.qtype, input_scale=jnp.full((1, 1), s))
  got = np.asarray(w8a8_product(jnp.asarray(x), static, 1)).reshape(-1, 384)
  ref = x.reshape(-1, 256) @ w_deq
  bound = w8a8_bound(x, w_deq, 1) + 2.0**-10 * s * np.abs(w_deq).sum(0)
  assert (np.abs(got - ref) <= bound).all()
  # exactly the float product of x rounded to e4m3 by the one scale (not per token)
  x_q = np.asarray(jnp.asarray(x / s).astype(jnp.float8_e4m3fn), np.float32) * s
  np.testing.assert_allclose(got, x_q.reshape(-1, 256) @ w_deq, rtol=1e-4, atol=1e-4)
  # a scale 1/4 of the calibrated one: the largest values clip at 448 x scale
  small = StaticQArray(q.qvalue, q.scale, qtype=q.qtype, input_scale=jnp.full((1, 1), s / 4))
  clipped = np.clip(x, -E4M3_MAX * s / 4, E4M3_MAX * s / 4)
  got = np.asarray(w8a8_product(jnp.asarray(x), small, 1)).reshape(-1, 384)
  ref = clipped.reshape(-1, 256) @ w_deq
  assert (
    np.abs(got - ref) <= w8a8_bound(clipped, w_deq, 1) + 2.0**-10 * s * np.abs(w_deq).sum(0)
  ).all()


def test_static_activation_scales_run_w8a8(tmp_path, caplog):
  """A folder with activation_scheme "static" and an input_scale per projection (calibrated
  here, as amax / 448 of each linear layer's inputs in transformers): fp8_activations="static"
  (auto's pick on cuda and tpu) quantizes the activations by them; the logits stay within the
  rounding the dynamic W8A8 test allows, and the cuda step multiplies e4m3 operands."""
  model = build_hf("Llama", tmp_path, std=0.05, hidden_size=256, intermediate_size=384)
  amax = {}
  hooks = [
    m.register_forward_pre_hook(
      lambda m, args, name=name: amax.__setitem__(
        name, max(amax.get(name, 0.0), float(args[0].abs().max()))
      )
    )
    for name, m in model.named_modules()
    if isinstance(m, torch.nn.Linear) and "lm_head" not in name
  ]
  toks = np.random.RandomState(0).randint(0, V, (2, 24))
  logits(model, toks)
  for h in hooks:
    h.remove()
  extra = {f"{n}.input_scale": torch.tensor(a / E4M3_MAX) for n, a in amax.items()}
  qconfig = {**DEEPSEEK_FP8, "activation_scheme": "static"}
  write_fp8(tmp_path, model, qconfig, extra=extra)
  with caplog.at_level(logging.INFO, logger="atlas_jax.hf.fp8"):
    ours, err = check_logits(tmp_path, model, fp8_activations="static")
  assert (
    "14 parameters kept in FP8 (W8A8: activations quantized to e4m3 by the checkpoint's static"
    in caplog.text
  )
  assert "unused" not in caplog.text
  assert err <= 0.15 * np.abs(logits(model, np.zeros((1, 4), np.int64))).max(), err
  wq = ours.blocks.attn.wq[...]
  assert wq.input_scale.shape == (2, 1, 1, 1)
  np.testing.assert_allclose(
    np.asarray(wq.input_scale).ravel(),
    [amax[f"model.layers.{i}.self_attn.q_proj"] / E4M3_MAX for i in range(2)],
    rtol=1e-6,
  )
  assert len(_f8_dots(_lowered(ours, "cuda"))) >= 7
  dynamic = hf.load(tmp_path, fp8_activations="dynamic")
  toks = jnp.asarray(toks, jnp.int32)
  assert np.abs(np.asarray(ours(toks)) - np.asarray(dynamic(toks))).max() > 0


def test_w8a8_grouped_product_against_float_reference():
  """Rows grouped by expert against e4m3 expert stacks (per channel, and 32 x 32 tiles as a
  partial 128-block leaves them): each row within e4m3's rounding of its activations of the
  float product with its expert's weights; rows past the groups are zeros."""
  import qwix

  from atlas_jax.quant import dequantized, w8a8_experts, w8a8_grouped_product

  rng = np.random.RandomState(1)
  E, C, O = 3, 96, 64
  w = jnp.asarray(rng.randn(E, C, O).astype(np.float32))
  sizes = np.array([4, 0, 3], np.int32)
  x = rng.randn(9, C).astype(np.float32)  # 7 rows in groups, 2 past them
  ids = np.array([0] * 4 + [2] * 3 + [3] * 2, np.int32)
  for q in (
    qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=(0, 2)),
    qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=(0,), tiled_axes={1: 32, 2: 32}),
  ):
    assert w8a8_experts(q)
    got = np.asarray(w8a8_grouped_product(jnp.asarray(x), q, jnp.asarray(sizes), jnp.asarray(ids)))
    w_deq = np.asarray(dequantized(q))
    for r in range(7):
      ref = x[r] @ w_deq[ids[r]]
      err = np.abs(got[r] - ref)
      assert (err <= w8a8_bound(x[r : r + 1], w_deq[ids[r]], 1)[0]).all(), err.max()
    assert not got[7:].any()
  assert not w8a8_experts(qwix.quantize(w, jnp.int8, channelwise_axes=(0, 2)))


def test_fp8_experts_run_w8a8_where_asked(tmp_path, monkeypatch):
  """A DeepSeek-V3 FP8 folder with fp8_activations="dynamic": the routed experts' stacks stay
  e4m3 into FP8 ragged matmuls (the cuda lowering has them; weight-only has none). Their
  logits differ from the same model's with the experts dequantized in the step (the other
  projections W8A8 in both) by the experts' activations' e4m3 rounding alone."""
  import atlas_jax.model.moe as moe

  from .test_hf_deepseek import build_hf as build_deepseek

  model = build_deepseek(tmp_path, std=0.05, **DEEPSEEK_MOE)
  write_fp8(tmp_path, model, DEEPSEEK_FP8)
  toks = jnp.asarray(np.random.RandomState(0).randint(0, V, (2, 24)), jnp.int32)
  w8a8 = hf.load(tmp_path, fp8_activations="dynamic")
  got = np.asarray(w8a8(toks))
  ragged_f8 = lambda text: [
    ln for ln in text.splitlines() if "ragged_dot" in ln and "f8E4M3FN" in ln
  ]
  assert len(ragged_f8(_lowered(w8a8, "cuda"))) == 3  # gate, up, down of the one MoE layer
  assert not ragged_f8(_lowered(hf.load(tmp_path, fp8_activations="none"), "cuda"))
  monkeypatch.setattr(moe, "w8a8_experts", lambda w: False)
  experts_weight_only = hf.load(tmp_path, fp8_activations="dynamic")
  assert not ragged_f8(_lowered(experts_weight_only, "cuda"))
  diff = np.abs(got - np.asarray(experts_weight_only(toks))).max()
  assert 0 < diff <= 0.05 * np.abs(got).max(), diff
