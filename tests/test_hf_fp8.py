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

  model = build_deepseek(
    tmp_path,
    hidden_size=160,  # 128 + a partial block
    intermediate_size=288,
    moe_intermediate_size=136,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
  )
  deq = write_fp8(tmp_path, model, DEEPSEEK_FP8)
  assert any("experts" in n for n in deq) and any("kv_a_proj" in n for n in deq)
  with caplog.at_level(logging.INFO, logger="atlas_jax.hf.fp8"):
    ours, err = check_logits(tmp_path, model)
  assert ours.cfg.moe is not None and err <= 1e-4, err
  assert (
    f"FP8 checkpoint (128x128 block scales, activation_scheme dynamic): {len(deq)} weights "
    "dequantized to float32 at load (weight-only)"
  ) in caplog.text


def test_llama_block_and_per_tensor_scales_match_transformers(tmp_path):
  model = build_hf("Llama", tmp_path / "b", hidden_size=192, intermediate_size=320)
  write_fp8(tmp_path / "b", model, DEEPSEEK_FP8)
  assert check_logits(tmp_path / "b", model)[1] <= 1e-4
  # one scale per tensor, under its per-tensor name, and a static activation scale left unused
  model = build_hf("Qwen2", tmp_path / "t")
  extra = {"model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.5)}
  qconfig = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}
  write_fp8(tmp_path / "t", model, qconfig, scale_name="weight_scale", extra=extra)
  assert check_logits(tmp_path / "t", model)[1] <= 1e-4
  ours, _ = check_logits(tmp_path / "t", model, dtype="bfloat16")
  assert ours.embed[...].dtype == jnp.bfloat16


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
