"""Published model shapes the planner knows by name (`--config llama-2-70b`).

Shapes are copied from each model's released `config.json` on the Hugging Face hub
(meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, meta-llama/Meta-Llama-3-8B,
meta-llama/Llama-3.1-8B, meta-llama/Meta-Llama-3-70B, deepseek-ai/DeepSeek-V2,
deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3).

DeepSeek-V2/V3 are mixture-of-experts models, which `ModelConfig` does not express: here every
layer is the dense layer of their first `first_k_dense_replace` layers. Their attention (MLA) and
so their KV cache are exact; parameter counts, FLOPs and training memory are those of that dense
stand-in, not of the released models (DeepSeek-V3: 671B total, 37B active per token).
"""

from __future__ import annotations

import dataclasses

from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
  title: str
  model: ModelConfig
  note: str = ""  # where the planner's figures are not the released model's


_MOE_NOTE = (
  "mixture-of-experts layers are modelled as the dense layer of its first layers: the KV cache "
  "is exact, parameter counts, FLOPs and training memory are those of a dense stand-in"
)


def _llama(V, D, L, N, K, F, max_len, theta, scaling=None) -> ModelConfig:
  return ModelConfig(
    vocab_size=V,
    d_model=D,
    n_layers=L,
    n_heads=N,
    n_kv_heads=K,
    ffn_dim=F,
    max_seq_len=max_len,
    rope_theta=theta,
    rope_scaling=scaling,
    norm_eps=1e-5,
    dtype="bfloat16",
    param_dtype="bfloat16",
  )


def _deepseek(V, D, L, N, F, q_lora, mtp: int) -> ModelConfig:
  return ModelConfig(
    vocab_size=V,
    d_model=D,
    n_layers=L,
    n_heads=N,
    n_kv_heads=N,
    ffn_dim=F,
    max_seq_len=163840,
    rope_theta=10000.0,
    norm_eps=1e-6,
    dtype="bfloat16",
    param_dtype="bfloat16",
    mla=MLAConfig(
      kv_lora_rank=512,
      qk_rope_head_dim=64,
      qk_nope_head_dim=128,
      v_head_dim=128,
      q_lora_rank=q_lora,
    ),
    mtp=MTPConfig(kind="sequential", n_predict=mtp) if mtp else None,
  )


_LLAMA3_ROPE = RopeScaling(
  type="llama3",
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=8192,
)

REFERENCE_MODELS: dict[str, ReferenceModel] = {
  "llama-2-7b": ReferenceModel(
    "Llama-2-7B (MHA)", _llama(32000, 4096, 32, 32, 32, 11008, 4096, 10000.0)
  ),
  "llama-2-70b": ReferenceModel(
    "Llama-2-70B (GQA-8)", _llama(32000, 8192, 80, 64, 8, 28672, 4096, 10000.0)
  ),
  "llama-3-8b": ReferenceModel(
    "Llama-3-8B (GQA-8)", _llama(128256, 4096, 32, 32, 8, 14336, 8192, 500000.0)
  ),
  "llama-3.1-8b": ReferenceModel(
    "Llama-3.1-8B (GQA-8)",
    _llama(128256, 4096, 32, 32, 8, 14336, 131072, 500000.0, _LLAMA3_ROPE),
  ),
  "llama-3-70b": ReferenceModel(
    "Llama-3-70B (GQA-8)", _llama(128256, 8192, 80, 64, 8, 28672, 8192, 500000.0)
  ),
  "deepseek-v2-lite": ReferenceModel(
    "DeepSeek-V2-Lite (MLA)", _deepseek(102400, 2048, 27, 16, 10944, None, 0), _MOE_NOTE
  ),
  "deepseek-v2": ReferenceModel(
    "DeepSeek-V2 (MLA)", _deepseek(102400, 5120, 60, 128, 12288, 1536, 0), _MOE_NOTE
  ),
  "deepseek-v3": ReferenceModel(
    "DeepSeek-V3 (MLA, MTP)", _deepseek(129280, 7168, 61, 128, 18432, 1536, 1), _MOE_NOTE
  ),
}


def get_reference(name: str) -> ReferenceModel | None:
  return REFERENCE_MODELS.get(name.strip().lower())
