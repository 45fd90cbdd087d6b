"""Published model shapes the planner knows by name (`--config llama-2-70b`).

Shapes are copied from each model's released `config.json` on the Hugging Face hub
(meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, meta-llama/Meta-Llama-3-8B,
meta-llama/Llama-3.1-8B, meta-llama/Meta-Llama-3-70B, deepseek-ai/DeepSeek-V2,
deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3, mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-30B-A3B), mixture-of-experts layers included: total and active parameters are the
published ones (DeepSeek-V3 671B / 37B, Mixtral-8x7B 46.7B / 12.9B, Qwen3-30B-A3B 30.5B / 3.3B,
DeepSeek-V2 236B / 21B, DeepSeek-V2-Lite 15.7B / 2.4B; `tests/plan/test_published.py`).
"""

from __future__ import annotations

import dataclasses

from atlas_jax.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
  title: str
  model: ModelConfig
  note: str = ""  # where the planner's figures are not the released model's


def _llama(V, D, L, N, K, F, max_len, theta, scaling=None, **extra) -> ModelConfig:
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
    **extra,
  )


def _deepseek(V, D, L, N, F, q_lora, mtp: int, moe: MoEConfig) -> ModelConfig:
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
    moe=moe,
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
    "DeepSeek-V2-Lite (MLA, MoE 64 experts, top-6)",
    _deepseek(
      102400,
      2048,
      27,
      16,
      10944,
      None,
      0,
      MoEConfig(
        n_experts=64,
        top_k=6,
        expert_ffn_dim=1408,
        norm_topk_prob=False,
        shared_ffn_dim=2 * 1408,
        first_k_dense=1,
      ),
    ),
  ),
  "deepseek-v2": ReferenceModel(
    "DeepSeek-V2 (MLA, MoE 160 experts, top-6)",
    _deepseek(
      102400,
      5120,
      60,
      128,
      12288,
      1536,
      0,
      MoEConfig(
        n_experts=160,
        top_k=6,
        expert_ffn_dim=1536,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        shared_ffn_dim=2 * 1536,
        first_k_dense=1,
      ),
    ),
  ),
  "deepseek-v3": ReferenceModel(
    "DeepSeek-V3 (MLA, MoE 256 experts, top-8, MTP)",
    _deepseek(
      129280,
      7168,
      61,
      128,
      18432,
      1536,
      1,
      MoEConfig(
        n_experts=256,
        top_k=8,
        expert_ffn_dim=2048,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        shared_ffn_dim=2048,
        first_k_dense=3,
      ),
    ),
    "the published 671B total / 37B active leave out the MTP module (11.6B; 14B in the released"
    " files, which repeat the embedding and output head in it), which training adds",
  ),
  "mixtral-8x7b": ReferenceModel(
    "Mixtral-8x7B (GQA-8, MoE 8 experts, top-2)",
    _llama(
      32000,
      4096,
      32,
      32,
      8,
      14336,
      32768,
      1e6,
      moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=14336),
    ),
  ),
  "qwen3-30b-a3b": ReferenceModel(
    "Qwen3-30B-A3B (GQA-4, qk-norm, MoE 128 experts, top-8)",
    _llama(
      151936,
      2048,
      48,
      32,
      4,
      6144,
      40960,
      1e6,
      head_dim=128,
      qk_norm=True,
      moe=MoEConfig(n_experts=128, top_k=8, expert_ffn_dim=768, norm_topk_prob=True),
    ),
  ),
}


def get_reference(name: str) -> ReferenceModel | None:
  return REFERENCE_MODELS.get(name.strip().lower())
