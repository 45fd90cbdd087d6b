"""Published model shapes the planner knows by name (`--config llama-2-70b`).

Shapes are copied from each model's released `config.json` on the Hugging Face hub
(meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, meta-llama/Meta-Llama-3-8B,
meta-llama/Llama-3.1-8B, meta-llama/Meta-Llama-3-70B, deepseek-ai/DeepSeek-V2,
deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3, mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-30B-A3B, microsoft/Phi-4-mini-instruct, google/gemma-3-1b-pt, and the text configs
of google/gemma-3-4b-pt and google/gemma-3-27b-pt, HuggingFaceTB/SmolLM3-3B, zai-org/GLM-4.5-Air,
openai/gpt-oss-20b),
mixture-of-experts layers included: total and active parameters are the published ones
(DeepSeek-V3 671B / 37B, Mixtral-8x7B 46.7B / 12.9B, Qwen3-30B-A3B 30.5B / 3.3B, DeepSeek-V2
236B / 21B, DeepSeek-V2-Lite 15.7B / 2.4B, GLM-4.5-Air 106B / 12B, gpt-oss-20b 20.91B / 3.61B,
Phi-4-mini 3.8B, Gemma-3-1B 1.0B; `tests/plan/test_published.py`).
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
    norm_eps=extra.pop("norm_eps", 1e-5),
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

# Phi-4-mini-instruct's LongRoPE: 48 factors, one per rotated pair of its 96 rotated dims (of 128);
# the long ones from its config.json, the short ones all 1. Its sliding_window (262,144) exceeds
# its context and is left out.
# fmt: off
_PHI4_MINI_LONG = (
  1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
  2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
  5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
  11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
  25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
  32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
)
# fmt: on
PHI4_MINI_ROPE = RopeScaling(
  type="longrope",
  factor=32.0,  # max_position_embeddings 131,072 / original 4,096
  original_max_position_embeddings=4096,
  short_factor=(1.0,) * 48,
  long_factor=_PHI4_MINI_LONG,
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
  "glm-4.5-air": ReferenceModel(
    "GLM-4.5-Air (GQA-8, half of each head rotated, MoE 128 experts, top-8, MTP)",
    _llama(
      151552,
      4096,
      46,
      96,
      8,
      10944,
      131072,
      1e6,
      head_dim=128,
      qkv_bias=True,
      partial_rotary_factor=0.5,
      mtp=MTPConfig(kind="sequential", n_predict=1),
      moe=MoEConfig(
        n_experts=128,
        top_k=8,
        expert_ffn_dim=1408,
        scoring="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        shared_ffn_dim=1408,
        first_k_dense=1,
      ),
    ),
    "the published 106B total / 12B active leave out the MTP module (2.4B), which the released"
    " checkpoint stores as layer 46",
  ),
  "gpt-oss-20b": ReferenceModel(
    "gpt-oss-20b (GQA-8, attention sinks, alternating 128-token windows / full layers, YaRN, MoE"
    " 32 experts, top-4, biased experts with the clamped SwiGLU)",
    _llama(
      201088,
      2880,
      24,
      64,
      8,
      2880,
      131072,
      150000.0,
      RopeScaling(
        type="yarn",
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.0,  # as a config.json without one reads (unused without mscale_all_dim)
        truncate=False,
      ),
      head_dim=64,
      qkv_bias=True,
      attn_out_bias=True,
      attention_sinks=True,
      sliding_window=128,
      layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)),
      moe=MoEConfig(
        n_experts=32,
        top_k=4,
        expert_ffn_dim=2880,
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=7.0,
      ),
    ),
  ),
  "phi-4-mini": ReferenceModel(
    "Phi-4-mini (GQA-8, LongRoPE, 3/4 of each head rotated)",
    _llama(
      200064,
      3072,
      32,
      24,
      8,
      8192,
      131072,
      10000.0,
      PHI4_MINI_ROPE,
      tie_embeddings=True,
      partial_rotary_factor=0.75,
    ),
  ),
}


def _gemma3(V, D, L, N, K, H, F, window, scalar, max_len, scaling) -> ModelConfig:
  """Gemma 3's text model: five sliding-window layers per global one (local RoPE base 10,000,
  global 1,000,000, linearly scaled past 1B), QK-norm, post-norms, GeGLU, scaled embeddings."""
  return _llama(
    V,
    D,
    L,
    N,
    K,
    F,
    max_len,
    1e6,
    scaling,
    head_dim=H,
    norm_eps=1e-6,
    tie_embeddings=True,
    qk_norm=True,
    sliding_window=window,
    layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)),
    rope_local_theta=10000.0,
    query_pre_attn_scalar=scalar,
    post_norms=True,
    mlp_activation="gelu_tanh",
    scale_embeddings=True,
  )


GEMMA3_ROPE = RopeScaling(type="linear", factor=8.0)
REFERENCE_MODELS.update(
  {
    "gemma-3-1b": ReferenceModel(
      "Gemma-3-1B (MQA, 5:1 local 512-token windows / global layers)",
      _gemma3(262144, 1152, 26, 4, 1, 256, 6912, 512, 256, 32768, None),
    ),
    "gemma-3-4b": ReferenceModel(
      "Gemma-3-4B text (GQA-2, 5:1 local 1024-token windows / global layers)",
      _gemma3(262208, 2560, 34, 8, 4, 256, 10240, 1024, 256, 131072, GEMMA3_ROPE),
      "the language model alone (the released checkpoint adds a 0.4B vision tower)",
    ),
    "gemma-3-27b": ReferenceModel(
      "Gemma-3-27B text (GQA-2, 5:1 local 1024-token windows / global layers)",
      _gemma3(262208, 5376, 62, 32, 16, 128, 21504, 1024, 168, 131072, GEMMA3_ROPE),
      "the language model alone (the released checkpoint adds a 0.4B vision tower)",
    ),
    "smollm3-3b": ReferenceModel(
      "SmolLM3-3B (GQA-4, every 4th layer without RoPE)",
      _llama(
        128256,
        2048,
        36,
        16,
        4,
        11008,
        65536,
        5e6,
        norm_eps=1e-6,
        tie_embeddings=True,
        nope_layers=tuple(i for i in range(36) if (i + 1) % 4 == 0),
      ),
    ),
  }
)


def get_reference(name: str) -> ReferenceModel | None:
  return REFERENCE_MODELS.get(name.strip().lower())
