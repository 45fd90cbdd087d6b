"""Configuration: frozen dataclasses validated on construction, loaded from YAML with overrides.

    cfg = load_config("configs/tiny.yaml", ["model.n_layers=4", "train.steps=100"])

Every invalid field raises `ConfigError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
  """A configuration field holds a value that is not allowed."""


def _fail(field: str, value: Any, allowed: str) -> typing.NoReturn:
  raise ConfigError(f"{field}={value!r} is not allowed: {allowed}")


def _positive(section: str, obj: Any, *names: str) -> None:
  for name in names:
    value = getattr(obj, name)
    if value <= 0:
      _fail(f"{section}.{name}", value, "must be > 0")


LONGROPE_FREQUENCIES = ("dynamic", "short", "long")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Rotary frequency scaling. `llama3`: Llama-3.1's wavelength-dependent interpolation.

  `yarn` (DeepSeek-V2/V3, Qwen3 128k, gpt-oss): interpolate low frequencies by `factor`, keep high
  ones, ramp between `beta_slow` and `beta_fast` rotations; cos/sin are multiplied by
  `attention_factor` (default mscale(factor, mscale) / mscale(factor, mscale_all_dim)) and MLA's
  softmax scale by mscale(factor, mscale_all_dim) ** 2.

  `longrope` (Phi-3, Phi-4): each dimension pair's frequency divided by its `short_factor` entry
  while a call's positions stay inside `original_max_position_embeddings`, by its `long_factor`
  entry past it; cos/sin multiplied by `attention_factor` (default sqrt(1 + ln(factor) /
  ln(original_max_position_embeddings)), 1 when factor <= 1). `longrope_frequencies` says which
  set: "dynamic" picks per call from the call's largest position (transformers' rule: training and
  `generate`); "short" or "long" fixes one set for every call. The serving engine fixes it from
  its max_model_len (long past the original context, vLLM's rule): its call is a batch of many
  sequences, so a per-call choice would make one sequence's tokens depend on the others.
  """

  type: Literal["llama3", "linear", "yarn", "longrope"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0  # yarn
  beta_slow: float = 1.0  # yarn
  mscale: float = 1.0  # yarn
  mscale_all_dim: float = 0.0  # yarn; 0: no softmax-scale correction
  attention_factor: float | None = None  # yarn, longrope; None: derived (see above)
  truncate: bool = True  # yarn: round the correction range to whole dimensions
  short_factor: tuple[float, ...] = ()  # longrope: one per rotated dimension pair
  long_factor: tuple[float, ...] = ()  # longrope: one per rotated dimension pair
  longrope_frequencies: Literal["dynamic", "short", "long"] = "dynamic"  # longrope (see above)

  def __post_init__(self):
    _positive("model.rope_scaling", self, "factor", "original_max_position_embeddings")
    for name in ("short_factor", "long_factor"):
      object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
      if self.type == "longrope" and not (
        getattr(self, name) and all(f > 0 for f in getattr(self, name))
      ):
        _fail(
          f"model.rope_scaling.{name}",
          list(getattr(self, name)),
          "must be a non-empty list of numbers > 0 (one per rotated dimension pair) for longrope",
        )
    if self.longrope_frequencies not in LONGROPE_FREQUENCIES:
      _fail(
        "model.rope_scaling.longrope_frequencies",
        self.longrope_frequencies,
        f"must be one of {', '.join(LONGROPE_FREQUENCIES)}",
      )
    if self.type in ("yarn", "longrope") and self.attention_factor is not None:
      if self.attention_factor <= 0:
        _fail("model.rope_scaling.attention_factor", self.attention_factor, "must be > 0 or null")
    if self.type == "yarn":
      _positive("model.rope_scaling", self, "beta_fast", "beta_slow")
    if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
      _fail(
        "model.rope_scaling.high_freq_factor",
        self.high_freq_factor,
        f"must exceed low_freq_factor={self.low_freq_factor} > 0",
      )


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """DeepSeek-V2/V3 Multi-head Latent Attention: K and V are decompressed from a latent c_kv.

  Per token and layer the cache holds c_kv [C] and the shared rope key [R] only.
  """

  kv_lora_rank: int = 64  # C
  qk_rope_head_dim: int = 16  # R: decoupled RoPE dims, one key shared by every head
  qk_nope_head_dim: int = 32  # Hn: per-head query/key dims without position
  v_head_dim: int = 32  # Hv
  q_lora_rank: int | None = None  # A: low-rank query compression (None: a full D -> N*H query)

  def __post_init__(self):
    _positive("model.mla", self, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
    _positive("model.mla", self, "v_head_dim")
    if self.qk_rope_head_dim % 2:
      _fail(
        "model.mla.qk_rope_head_dim",
        self.qk_rope_head_dim,
        "must be even: RoPE rotates pairs of dimensions",
      )
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      _fail("model.mla.q_lora_rank", self.q_lora_rank, "must be a positive int or null")

  @property
  def qk_head_dim(self) -> int:  # Hn + R
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MTPConfig:
  """Multi-token prediction: extra heads predicting tokens t+2 .. t+1+n_predict.

  `parallel`: n_predict independent transformer blocks on the trunk's last hidden input (Gloeckle
  et al. 2024). `sequential`: DeepSeek-V3's chained modules (embedding of token t+j and the
  previous depth's hidden state, each RMSNormed, concatenated, projected, one block).
  Loss: L_main + loss_weight * mean_j L_j.
  """

  kind: Literal["parallel", "sequential"] = "sequential"
  n_predict: int = 1  # extra tokens predicted per position
  loss_weight: float = 0.3  # lambda

  def __post_init__(self):
    _positive("model.mtp", self, "n_predict")
    if self.loss_weight < 0:
      _fail("model.mtp.loss_weight", self.loss_weight, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Mixture-of-experts feed-forward layers (`atlas_jax.model.moe`): a router picks `top_k` of
  `n_experts` SwiGLU experts per token; optional shared experts see every token.

  Routers (the Hugging Face fields each maps from in parentheses):
    scoring: "softmax" (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3).
    topk_method: "greedy" (top-k of the scores); "group_limited_greedy" (DeepSeek-V2: the experts
      split into n_group groups, only the topk_group groups with the highest best score compete);
      "noaux_tc" (DeepSeek-V3: scores plus a per-expert selection bias, groups ranked by the sum
      of their two best biased scores; the bias changes which experts are picked, never their
      weights).
    norm_topk_prob: renormalise the k weights to sum to 1 (Mixtral always; Qwen/OLMoE/V3 by flag).
    routed_scaling_factor: multiplies the routed experts' weights (DeepSeek).

  Which layers are MoE (the rest are dense SwiGLU layers of model.ffn_dim): layer i (0-based) is
  MoE when i >= first_k_dense (first_k_dense_replace), (i + 1) % sparse_step == 0
  (decoder_sparse_step) and i is not in dense_layers (mlp_only_layers).

  capacity_factor: null computes every assignment (dropless). A number caps each expert at
  ceil(capacity_factor * tokens * top_k / n_experts) tokens per call in the uncached forward
  (training): assignments past the cap, in token order, are dropped and counted. Calls with a
  cache (generation, serving) stay dropless, so a sequence's tokens never depend on its batch.
  """

  n_experts: int = 8  # E routed experts
  top_k: int = 2  # experts per token
  expert_ffn_dim: int = 256  # F of one routed expert (moe_intermediate_size)
  scoring: Literal["softmax", "sigmoid"] = "softmax"
  topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
  n_group: int = 1  # expert groups (group_limited_greedy, noaux_tc)
  topk_group: int = 1  # groups a token may pick experts from
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  # Shared experts, one SwiGLU of this hidden width (DeepSeek: n_shared_experts x
  # moe_intermediate_size; Qwen2-MoE: shared_expert_intermediate_size); 0: none.
  shared_ffn_dim: int = 0
  shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert scaled by sigmoid(x @ w)
  first_k_dense: int = 0
  sparse_step: int = 1
  dense_layers: tuple[int, ...] = ()
  capacity_factor: float | None = None
  # gpt-oss: a bias on the router's logits (router_bias) and on each expert's gate, up and down
  # projections (expert_bias); with swiglu_limit set, the experts' activation is gpt-oss's clamped
  # SwiGLU: gate clamped to <= limit, up to [-limit, limit], out = (up + 1) * gate *
  # sigmoid(swiglu_alpha * gate). null: the plain SwiGLU, silu(gate) * up.
  router_bias: bool = False
  expert_bias: bool = False
  swiglu_limit: float | None = None
  swiglu_alpha: float = 1.702

  def __post_init__(self):
    _positive("model.moe", self, "n_experts", "top_k", "expert_ffn_dim", "n_group", "topk_group")
    _positive("model.moe", self, "sparse_step", "routed_scaling_factor")
    E = self.n_experts
    if self.top_k > E:
      _fail("model.moe.top_k", self.top_k, f"must be <= model.moe.n_experts={E}")
    if E % self.n_group:
      _fail("model.moe.n_group", self.n_group, f"must divide model.moe.n_experts={E}")
    if self.topk_group > self.n_group:
      _fail("model.moe.topk_group", self.topk_group, f"must be <= model.moe.n_group={self.n_group}")
    per_group = E // self.n_group
    if self.topk_method != "greedy" and self.top_k > self.topk_group * per_group:
      _fail(
        "model.moe.top_k",
        self.top_k,
        f"must be <= topk_group x experts per group = {self.topk_group} x {per_group}: the "
        "experts of the groups a token may use",
      )
    if self.topk_method == "noaux_tc" and per_group < 2:
      _fail(
        "model.moe.n_group",
        self.n_group,
        f"leaves {per_group} expert per group; noaux_tc ranks groups by their two best scores, "
        "so each group needs at least 2",
      )
    if self.shared_ffn_dim < 0:
      _fail("model.moe.shared_ffn_dim", self.shared_ffn_dim, "must be >= 0 (0: no shared expert)")
    if self.shared_expert_gate and not self.shared_ffn_dim:
      _fail("model.moe.shared_expert_gate", True, "needs model.moe.shared_ffn_dim > 0")
    if self.first_k_dense < 0:
      _fail("model.moe.first_k_dense", self.first_k_dense, "must be >= 0")
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      _fail("model.moe.capacity_factor", self.capacity_factor, "must be > 0 or null (dropless)")
    if self.swiglu_limit is not None and not self.swiglu_limit > 0:
      _fail("model.moe.swiglu_limit", self.swiglu_limit, "must be > 0 or null (plain SwiGLU)")
    if not self.swiglu_alpha > 0:
      _fail("model.moe.swiglu_alpha", self.swiglu_alpha, "must be > 0")

  def is_sparse(self, layer: int) -> bool:
    """Whether layer `layer` (0-based; MTP modules count on past the trunk) is an MoE layer."""
    return (
      layer >= self.first_k_dense
      and (layer + 1) % self.sparse_step == 0
      and layer not in self.dense_layers
    )


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """What differs between the attention of two layers of one model: the window (None: every
  earlier position), the chunk (Llama 4's chunked local attention: only the positions of the
  query's own chunk; None: no chunks) and the RoPE (base and scaling; base None: no rotation)."""

  sliding_window: int | None
  rope_theta: float | None
  rope_scaling: RopeScaling | None
  attention_chunk: int | None = None

  @property
  def reach(self) -> int | None:
    """How many positions, up to and including its own, a query of this kind can read: the
    window W, or for chunks of C at most C (a query at p reads from its chunk's start,
    floor(p / C) * C, which is past p - C); None: every earlier position. A sequence's cache
    for these layers need keep only its last `reach` positions."""
    return self.sliding_window if self.attention_chunk is None else self.attention_chunk


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer: the Llama family (Llama, Mistral, Qwen2, Qwen3), DeepSeek's MLA
  and MTP, and mixture-of-experts layers (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3)."""

  vocab_size: int = 259
  d_model: int = 256  # D
  n_layers: int = 4  # L
  n_heads: int = 8  # N
  n_kv_heads: int = 4  # K
  head_dim: int | None = None  # H; default d_model // n_heads
  ffn_dim: int = 768  # F
  max_seq_len: int = 512
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  # The fraction of each head's dims RoPE rotates (the leading ones; Phi-4-mini 0.75, GLM-4.5 0.5).
  partial_rotary_factor: float = 1.0
  norm_eps: float = 1e-5
  qkv_bias: bool = False  # Qwen2
  attn_out_bias: bool = False  # gpt-oss: a bias on the attention's output projection
  # gpt-oss: a learned logit per query head that joins each query's softmax denominator (a
  # "sink" key with no value), so a head can attend to nothing.
  attention_sinks: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  # What qk_norm normalises: each head ("head", Qwen3) or all heads of q (and of k) together
  # ("all_heads", OLMoE: one RMSNorm over the whole projection).
  qk_norm_scope: Literal["head", "all_heads"] = "head"
  tie_embeddings: bool = False
  # W keys per query (its own included) on the sliding layers; with layer_types None, every layer
  # slides (Mistral).
  sliding_window: int | None = None
  # Each layer's attention, Hugging Face's `layer_types` ("full_attention", "sliding_attention"
  # or "chunked_attention"): Gemma 2 alternates the first two, Gemma 3 has five sliding layers per
  # full one, Llama 4 three chunked per full one. None: every layer alike. The layers still run as
  # one scan: a layer's kind is data it reads (`ModelConfig.attention_kinds`).
  layer_types: (
    tuple[Literal["full_attention", "sliding_attention", "chunked_attention"], ...] | None
  ) = None
  # Llama 4's chunked local attention: a chunked layer's query at position q sees the keys k <= q
  # with k // C == q // C, C this size. With layer_types None, every layer is chunked.
  attention_chunk_size: int | None = None
  rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base, unscaled
  nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers that apply no RoPE
  attn_logit_softcapping: float | None = None  # Gemma 2: scores c * tanh(s / c) before softmax
  final_logit_softcapping: float | None = None  # Gemma 2: logits c * tanh(l / c)
  query_pre_attn_scalar: float | None = None  # Gemma: softmax scale its ** -0.5 (else H ** -0.5)
  # Where the blocks' RMSNorms sit: before each sublayer (`pre_norms`, Llama), on each sublayer's
  # output before the residual add (`post_norms`, OLMo 2), or both (Gemma 2/3).
  pre_norms: bool = True
  post_norms: bool = False
  mlp_activation: Literal["silu", "gelu_tanh"] = "silu"  # SwiGLU, or GeGLU (Gemma)
  scale_embeddings: bool = False  # Gemma: the embeddings times sqrt(d_model)
  init_std: float = 0.02
  dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # activations / compute
  param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  mla: MLAConfig | None = None  # DeepSeek MLA instead of GQA; n_kv_heads unused, head_dim Hn + R
  mtp: MTPConfig | None = None  # multi-token prediction heads (training; self-speculation)
  moe: MoEConfig | None = None  # mixture-of-experts feed-forward layers where moe.is_sparse(i)

  def __post_init__(self):
    _positive(
      "model",
      self,
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "ffn_dim",
      "max_seq_len",
      "rope_theta",
      "norm_eps",
      "init_std",
    )
    if self.mla is not None and self.head_dim is None:
      # MLA has no single head dim; record the query/key one (Hn + R) for code that reads it.
      object.__setattr__(self, "head_dim", self.mla.qk_head_dim)
    if self.mla is None and self.n_heads % self.n_kv_heads:
      _fail(
        "model.n_heads",
        self.n_heads,
        f"must be a multiple of model.n_kv_heads={self.n_kv_heads} (MHA: equal, GQA: a multiple, "
        "MQA: n_kv_heads=1)",
      )
    if self.head_dim is None:
      if self.d_model % self.n_heads:
        _fail(
          "model.d_model",
          self.d_model,
          f"must be divisible by model.n_heads={self.n_heads} when model.head_dim is not set",
        )
      object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
    if self.head_dim <= 0:
      _fail("model.head_dim", self.head_dim, "must be > 0")
    if self.mla is None and self.head_dim % 2:
      _fail("model.head_dim", self.head_dim, "must be even: RoPE rotates pairs of dimensions")
    if self.sliding_window is not None and self.sliding_window <= 0:
      _fail("model.sliding_window", self.sliding_window, "must be a positive int or null")
    if self.attention_chunk_size is not None and not (
      isinstance(self.attention_chunk_size, int)
      and not isinstance(self.attention_chunk_size, bool)
      and self.attention_chunk_size > 0
    ):
      _fail(
        "model.attention_chunk_size", self.attention_chunk_size, "must be a positive int or null"
      )
    self._check_layer_pattern()
    self._check_rotary()
    if self.mla is not None:
      for name in ("qkv_bias", "qk_norm", "attn_out_bias", "attention_sinks"):
        if getattr(self, name):
          _fail(f"model.{name}", True, "must be false with model.mla (MLA has no such option)")
      if self.sliding_window is not None:
        _fail("model.sliding_window", self.sliding_window, "must be null with model.mla")
      if self.attention_chunk_size is not None:
        _fail(
          "model.attention_chunk_size", self.attention_chunk_size, "must be null with model.mla"
        )
    if self.moe is not None:
      for i in self.moe.dense_layers:
        if not 0 <= i < self.n_layers:
          _fail(
            "model.moe.dense_layers",
            list(self.moe.dense_layers),
            f"every entry must be a layer index in [0, model.n_layers={self.n_layers})",
          )

  def _check_layer_pattern(self) -> None:
    L = self.n_layers
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
      if len(self.layer_types) != L:
        _fail(
          "model.layer_types",
          list(self.layer_types),
          f"must name one kind per layer: {L} entries (model.n_layers)",
        )
      for kind in self.layer_types:
        if kind not in LAYER_TYPES:
          _fail("model.layer_types", kind, f"each entry must be one of {LAYER_TYPES}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        _fail("model.sliding_window", None, "must be set: model.layer_types has sliding layers")
      if "chunked_attention" in self.layer_types and self.attention_chunk_size is None:
        _fail(
          "model.attention_chunk_size", None, "must be set: model.layer_types has chunked layers"
        )
    elif self.attention_chunk_size is not None and self.sliding_window is not None:
      _fail(
        "model.attention_chunk_size",
        self.attention_chunk_size,
        "must be null with model.sliding_window and no model.layer_types (one kind per layer: "
        "name each layer's in model.layer_types)",
      )
    for i in self.nope_layers:
      if not 0 <= i < L:
        _fail("model.nope_layers", list(self.nope_layers), f"every entry must be in [0, {L})")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        _fail(f"model.{name}", value, "must be > 0 or null")
    if self.rope_local_theta is not None and not self.rope_local_theta > 0:
      _fail("model.rope_local_theta", self.rope_local_theta, "must be > 0 or null")
    if not (self.pre_norms or self.post_norms):
      _fail("model.pre_norms", False, "needs model.post_norms: a block must have its norms")
    patterned = (
      self.layer_types is not None or self.nope_layers or self.rope_local_theta is not None
    )
    if self.mla is not None and (patterned or self.attn_logit_softcapping):
      _fail(
        "model.mla",
        "set",
        "takes no layer_types, nope_layers, rope_local_theta or attn_logit_softcapping",
      )
    if self.mtp is not None and len(self.attention_kinds()[0]) > 1:
      _fail("model.mtp", "set", "needs every layer's attention alike (model.layer_types)")

  def attention_kinds(self) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
    """(the distinct kinds of attention the layers use, each layer's index into them).

    A layer's kind is its window and its RoPE; a model whose layers are all alike has one."""
    kinds: list[AttentionKind] = []
    index = []
    for i in range(self.n_layers):
      sliding = (
        self.sliding_window is not None
        if self.layer_types is None
        else self.layer_types[i] == "sliding_attention"
      )
      chunked = (
        self.attention_chunk_size is not None
        if self.layer_types is None
        else self.layer_types[i] == "chunked_attention"
      )
      rope = i not in self.nope_layers
      local = sliding and self.rope_local_theta is not None
      kind = AttentionKind(
        sliding_window=self.sliding_window if sliding else None,
        rope_theta=(self.rope_local_theta if local else self.rope_theta) if rope else None,
        rope_scaling=None if local or not rope else self.rope_scaling,
        attention_chunk=self.attention_chunk_size if chunked else None,
      )
      if kind not in kinds:
        kinds.append(kind)
      index.append(kinds.index(kind))
    return tuple(kinds), tuple(index)

  def _check_rotary(self) -> None:
    p = self.partial_rotary_factor
    if not 0 < p <= 1:
      _fail("model.partial_rotary_factor", p, "must be in (0, 1]")
    if self.mla is not None and p != 1:
      _fail("model.partial_rotary_factor", p, "must be 1 with model.mla (it sizes its own rope)")
    if self.mla is None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
      _fail(
        "model.partial_rotary_factor",
        p,
        f"must rotate an even number of dims > 0: int(head_dim={self.head_dim} * {p}) = "
        f"{self.rotary_dim}",
      )
    s = self.rope_scaling
    if s is not None and s.type == "longrope":
      if self.mla is not None:
        _fail("model.rope_scaling.type", "longrope", "needs GQA attention (model.mla unset)")
      for name in ("short_factor", "long_factor"):
        if len(getattr(s, name)) != self.rotary_dim // 2:
          _fail(
            f"model.rope_scaling.{name}",
            list(getattr(s, name)),
            f"must have one entry per rotated dimension pair: {self.rotary_dim // 2} "
            f"(int(head_dim * partial_rotary_factor) / 2)",
          )

  @property
  def rotary_dim(self) -> int:
    """The leading dims of each head that RoPE rotates (all of them unless partial)."""
    return int(self.head_dim * self.partial_rotary_factor)

  def sparse_layers(self) -> tuple[bool, ...]:
    """Per layer, whether its feed-forward is a mixture of experts (all False without moe)."""
    return tuple(self.moe is not None and self.moe.is_sparse(i) for i in range(self.n_layers))

  def layer_runs(self) -> tuple[tuple[bool, int], ...]:
    """The layers as runs of identical ones, in order: ((sparse, length), ...). A dense model is
    one run; DeepSeek-V3 is (False, 3), (True, 58)."""
    runs: list[list] = []
    for sparse in self.sparse_layers():
      if runs and runs[-1][0] == sparse:
        runs[-1][1] += 1
      else:
        runs.append([sparse, 1])
    return tuple((sparse, n) for sparse, n in runs)

  @property
  def group_size(self) -> int:  # G
    return self.n_heads // self.n_kv_heads


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How attention is computed (not what it computes)."""

  # None: the platform's best (`atlas_jax.kernels.attention`); "reference": the plain jnp
  # reference for every call (no query blocks), the planner's "xla" activation figures.
  implementation: Literal["xla", "reference", "pallas", "cudnn"] | None = None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axes; -1 takes the devices the other axes leave.

  The batch is split over (data, fsdp, expert). `data` only replicates state; ZeRO sharding
  (train.sharding) splits state over `fsdp`; `expert` splits the routed experts of
  mixture-of-experts layers (expert parallelism; elsewhere it splits the batch like `data`);
  `stage` splits the layer stack into pipeline stages (train.pipeline_microbatches,
  train.pipeline_repeats), and outside the pipelined layers splits the batch like `data`; tensor
  parallelism splits heads and FFN columns over `tensor`; `context` splits each sequence
  (context parallelism: load-balanced striping, attention by train.context_parallel).
  """

  data: int = 1
  fsdp: int = -1
  expert: int = 1
  stage: int = 1
  tensor: int = 1
  context: int = 1
  # Multi-host: jax.distributed.initialize arguments (null: single process, or auto-detected on
  # TPU pods / SLURM when num_processes is -1).
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  def __post_init__(self):
    sizes = {
      "data": self.data,
      "fsdp": self.fsdp,
      "expert": self.expert,
      "stage": self.stage,
      "tensor": self.tensor,
      "context": self.context,
    }
    if self.num_processes is not None and (self.num_processes < -1 or self.num_processes == 0):
      _fail("mesh.num_processes", self.num_processes, "must be a positive count, -1 or null")
    for name, size in sizes.items():
      if size == 0 or size < -1:
        _fail(f"mesh.{name}", size, "must be a positive device count or -1 (the rest)")
    if list(sizes.values()).count(-1) > 1:
      _fail("mesh", sizes, "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training text and how it is tokenised.

  `format`: "text" (documents: every token counts), or supervised examples from a JSONL file
  whose loss counts only the answer: "chat" (OpenAI-style `messages`, rendered with the model's
  chat template as serve.py renders requests; the assistant messages count) or "completion"
  (`prompt` and `completion` strings; the completion and its eos count).
  """

  source: str = "stdlib"  # "stdlib", a folder of text files, or a .jsonl file with a "text" field
  format: Literal["text", "chat", "completion"] = "text"
  # "byte"; "bpe:N", a byte-level BPE of N tokens trained on the source's train split at the
  # first run (seconds); or a path to a tokenizer.json.
  tokenizer: str = "byte"
  eval_fraction: float = 0.02  # share of documents held out for eval

  def __post_init__(self):
    if not 0.0 <= self.eval_fraction < 1.0:
      _fail("data.eval_fraction", self.eval_fraction, "must be in [0, 1)")
    if self.format != "text" and not self.source.endswith(".jsonl"):
      _fail(
        "data.source",
        self.source,
        f"data.format={self.format!r} reads a .jsonl file of examples (one JSON object a line)",
      )
    n = self.tokenizer.removeprefix("bpe:")
    if self.tokenizer.startswith("bpe:") and not (n.isdigit() and int(n) >= 260):
      _fail(
        "data.tokenizer",
        self.tokenizer,
        "bpe:N needs an integer N >= 260 (256 bytes, 3 special tokens, at least one merge)",
      )


# LoRA targets: the projections of a decoder block, by their Hugging Face names. GQA attention has
# q/k/v/o_proj; MLA has q_proj (without a query bottleneck) or q_a_proj and q_b_proj, kv_a_proj
# (kv_a_proj_with_mqa) and kv_b_proj (its key and value halves, an adapter each), and o_proj.
# "attn" and "mlp" name all of a block's attention or MLP projections.
LORA_ATTENTION_TARGETS = (
  "q_proj",
  "k_proj",
  "v_proj",
  "o_proj",
  "q_a_proj",
  "q_b_proj",
  "kv_a_proj",
  "kv_b_proj",
)
LORA_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = (*LORA_ATTENTION_TARGETS, *LORA_MLP_TARGETS, "attn", "mlp")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters (Hu et al. 2021): W x + (alpha / rank) * B A x on each targeted
  projection of every block, B zero at the start; only the adapters train."""

  rank: int = 8  # A
  alpha: float = 16.0
  targets: tuple[str, ...] = ("attn", "mlp")

  def __post_init__(self):
    _positive("train.lora", self, "rank", "alpha")
    if not self.targets:
      _fail("train.lora.targets", list(self.targets), "must name at least one projection")
    for t in self.targets:
      if t not in LORA_TARGETS:
        _fail("train.lora.targets", list(self.targets), f"{t!r} is not one of {LORA_TARGETS}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 200
  batch_size: int = 8
  seq_len: int = 128
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 20
  eval_every: int = 100
  eval_batches: int = 4
  checkpoint_dir: str = "checkpoints/tiny"
  # Steps between checkpoints (0: only at the end); an interrupted run (SIGINT, SIGTERM) also
  # saves the step it stopped at.
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3
  # Save while the next steps run (MaxText's name): the save holds a host copy of the state until
  # it is written. null: on accelerators, whose state lives in device memory apart from that
  # copy; not on a CPU, where the copy would take the same memory the steps' buffers need.
  async_checkpointing: bool | None = None
  grad_accum: int = 1  # micro-batches per step, accumulated inside the jitted step
  # Pipeline parallelism (mesh.stage > 1): micro-batches in flight through the stages per
  # accumulation step (GPipe), and layer groups per stage (circular when > 1); the bubble is
  # (stage - 1) / (pipeline_repeats * pipeline_microbatches + stage - 1) of each stage's time.
  pipeline_microbatches: int = 1
  pipeline_repeats: int = 1
  z_loss: float = 0.0
  # Mixture-of-experts models: the load-balancing loss weight (Switch/Mixtral form, 1.0 at
  # perfect balance), the router z-loss weight (ST-MoE: mean log-sum-exp of the router logits,
  # squared), and DeepSeek-V3's selection-bias step per train step (outside the gradient: each
  # expert's bias moves by this much towards balance, by the sign of its load's gap to the mean).
  moe_aux_loss: float = 0.01
  moe_z_loss: float = 0.001
  moe_bias_update_rate: float = 0.001
  # Sequence positions per chunk of the chunked cross-entropy (LM head fused in, [B, T, V] float32
  # logits never held); 0: the plain loss over the whole [B, T, V] logits.
  loss_chunk: int = 0
  precision: Literal["fp32", "bf16", "fp16"] = "fp32"
  remat: Literal["none", "full", "every_k", "selective"] = "none"
  remat_every: int | None = None  # k for every_k; default round(sqrt(n_layers))
  # Run the layers as one `jax.lax.scan` (compile time flat in depth) or unrolled (one copy of
  # the block per layer: no stacked residuals to zero, write and slice, which measured ~10%
  # faster steps on CPU at 4 layers; compile time grows with depth).
  scan_layers: bool = True
  sharding: Literal["dp", "zero1", "zero2", "zero3", "fsdp"] = "dp"
  # mesh.context > 1: attention by all-gathering K/V across the axis, or a ring passing K/V
  # blocks around it (`atlas_jax.model.context_parallel`).
  context_parallel: Literal["all_gather", "ring"] = "all_gather"
  on_nan: Literal["stop", "skip"] = "stop"
  # A damaged newest checkpoint: resume from the newest intact step (set aside as <step>.corrupt)
  # or stop with the error.
  on_corrupt_checkpoint: Literal["fallback", "stop"] = "fallback"
  loss_scale: float = 2.0**15  # fp16: initial dynamic loss scale
  # Per device, for MFU; default from the device table (`atlas_jax.devices`). On a
  # device the table does not know (every CPU), MFU is not reported unless this is given.
  peak_tflops: float | None = None
  # Extra XLA flags (space-separated) set before jax starts; null: the platform's defaults
  # (`atlas_jax.training.xla_flags`), "": none of them.
  xla_flags: str | None = None
  # Fine-tuning: a Hugging Face folder or a train.py run directory whose model (config, weights
  # and tokenizer) the run starts from, at step 0 with a fresh optimizer; the config's model
  # section must agree with it or be left out (`atlas_jax.sources.load_config`).
  init_from: str | None = None
  lora: LoRAConfig | None = None  # train low-rank adapters only; the base weights stay frozen
  # QLoRA (Dettmers et al. 2023; peft/bitsandbytes' `load_in_4bit`): with train.lora, the frozen
  # base's projections held quantized on the device (`atlas_jax.quant`, as serve.py's
  # --quantization: "int8" per output channel, "int4" per channel and per
  # `base_quantization_group_size` inputs, "fp8" e4m3 per channel) and dequantized inside the
  # matmuls; the adapters train in float32. null: the base kept in float32.
  base_quantization: str | None = None
  base_quantization_group_size: int = 128
  # FP8 matmuls (`atlas_jax.model.fp8`, qwix's quantized-training dot_general): the blocks'
  # projections multiply e4m3 operands, their gradients e5m2 ones, each scaled by its current
  # absmax ("current" scaling, computed in the step itself); null: the precision's dtype.
  fp8: str | None = None
  # Supervised data (data.format chat / completion): held-out examples completed greedily before
  # and after training and scored by exact match with their answers; 0: none.
  eval_exact_match: int = 0

  def __post_init__(self):
    _positive(
      "train",
      self,
      "steps",
      "batch_size",
      "seq_len",
      "learning_rate",
      "log_every",
      "grad_accum",
      "pipeline_microbatches",
      "pipeline_repeats",
      "keep_checkpoints",
      "loss_scale",
    )
    if self.batch_size % self.grad_accum:
      _fail(
        "train.batch_size",
        self.batch_size,
        f"must be divisible by train.grad_accum={self.grad_accum} (micro-batches per step)",
      )
    if self.remat_every is not None and self.remat_every <= 0:
      _fail("train.remat_every", self.remat_every, "must be a positive int or null")
    for name in ("z_loss", "moe_aux_loss", "moe_z_loss", "moe_bias_update_rate"):
      if getattr(self, name) < 0:
        _fail(f"train.{name}", getattr(self, name), "must be >= 0")
    if self.loss_chunk < 0:
      _fail(
        "train.loss_chunk",
        self.loss_chunk,
        "must be >= 0: 0 for the plain loss, or sequence positions per chunk of the chunked "
        "cross-entropy",
      )
    for flag in (self.xla_flags or "").split():
      if not flag.startswith("--xla_"):
        _fail("train.xla_flags", self.xla_flags, f"{flag!r}: every flag must start with --xla_")
    if self.peak_tflops is not None and self.peak_tflops <= 0:
      _fail("train.peak_tflops", self.peak_tflops, "must be > 0 (TFLOP/s per device) or null")
    for name in (
      "warmup_steps",
      "weight_decay",
      "grad_clip",
      "eval_every",
      "checkpoint_every",
      "eval_batches",
      "eval_exact_match",
    ):
      if getattr(self, name) < 0:
        _fail(f"train.{name}", getattr(self, name), "must be >= 0")
    for name in ("b1", "b2", "min_lr_ratio"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        _fail(f"train.{name}", getattr(self, name), "must be in [0, 1]")
    if self.base_quantization is not None:
      if self.base_quantization not in QUANTIZATIONS:
        _fail(
          "train.base_quantization",
          self.base_quantization,
          f"must be null or one of {QUANTIZATIONS}",
        )
      if self.lora is None:
        _fail(
          "train.base_quantization",
          self.base_quantization,
          "needs train.lora (a quantized base is frozen: only adapters can train over it)",
        )
    if self.base_quantization_group_size <= 0:
      _fail("train.base_quantization_group_size", self.base_quantization_group_size, "must be > 0")
    if self.fp8 not in (None, *FP8_SCALINGS):
      _fail("train.fp8", self.fp8, f"must be null or one of {FP8_SCALINGS}")


def _power_of_two(where: str, value: int) -> None:
  if value < 1 or value & (value - 1):
    _fail(where, value, "must be a power of two")


WARMUP_LEVELS = ("none", "default", "all")
WEIGHT_LAYOUTS = ("auto", "stacked", "in_major", "out_major")
CPU_MATMULS = ("auto", "xla", "ynnpack")
CPU_REDUCTIONS = ("auto", "xla", "ynnpack")
RUNNERS = ("auto", "ragged", "cpu")
# `serve.engine.kv_cache_dtype` (`atlas_jax.kernels.quantized_kv` stores the 8-bit ones).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("int8", "int4", "fp8")  # `serve.quantization`: weights, `atlas_jax.quant`
FP8_SCALINGS = ("current",)  # `train.fp8`: how the matmuls' FP8 scales are chosen


@dataclasses.dataclass(frozen=True)
class CPUConfig:
  """serve.engine.cpu: the CPU runner's own settings (`atlas_jax.serving.cpu`), for XLA's CPU
  backend; no other runner reads them."""

  # How one device holds the weights: "stacked" as trained (each layer stack one array, which
  # the layer scan slices layer by layer); one array per layer (`model.scan.Unstacked`),
  # the projections "in_major" as trained ([in, out]) or "out_major" transposed ([out, in], each
  # output's weights contiguous, as `nn.Linear` holds them); or "auto": out-major where the
  # start-up probe times its GEMMs faster, else stacked for small layers and in-major per layer
  # above (`serving.cpu.runner.STACKED_LAYER_BYTES`).
  weight_layout: str = "auto"
  # Whose dots the step programs compile: "ynnpack" (YNNPACK's, XLA's CPU default), "xla" (XLA's
  # own), or "auto": XLA's own for the decode batch sizes where the start-up probe times them
  # faster, YNNPACK's above. Only in-major weights take XLA's dots.
  matmul: str = "auto"
  # Whose reductions a decode step of a few rows (up to `serving.cpu.compile.YNN_REDUCE_ROWS`)
  # compiles: "xla" (XLA's own loops, as every larger step's), "ynnpack" (YNNPACK's, the paged
  # decode attention then scoring 32 keys an iteration), or "auto": as the start-up probe times
  # the decode attention.
  reductions: str = "auto"

  def __post_init__(self):
    for name, allowed in (
      ("weight_layout", WEIGHT_LAYOUTS),
      ("matmul", CPU_MATMULS),
      ("reductions", CPU_REDUCTIONS),
    ):
      if getattr(self, name) not in allowed:
        _fail(
          f"serve.engine.cpu.{name}", getattr(self, name), f"must be one of {', '.join(allowed)}"
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """serve.engine: the paged pool, the scheduler's limits, speculation and the device mesh.

  Counts are per data-parallel replica: each replica holds `n_blocks` blocks of the pool on its
  devices, runs up to `max_num_seqs` requests and computes up to `max_num_batched_tokens` tokens
  per step. The fields left None are sized by the engine from the model and the devices
  (`atlas_jax.serving.sizing`).
  """

  n_blocks: int | None = None  # P per replica; None: sized from memory
  block_size: int = 16  # Z, token slots per block
  # vLLM's `--kv-cache-dtype`: "auto" stores the pool in the model's dtype; "int8" or "fp8"
  # (e4m3) store 8-bit codes with a float32 scale per token and kv head
  # (`atlas_jax.kernels.quantized_kv`), about twice the tokens of bf16 in the same memory.
  kv_cache_dtype: str = "auto"
  # Pool bytes per device (a number > 1), or a fraction in (0, 1] of the memory the weights and
  # the largest step's activations leave; None: `gpu_memory_utilization`.
  kv_cache_memory: float | None = None
  # vLLM's: the fraction of each device's memory the server may use, weights, activations and
  # pool together (the pool gets what is left).
  gpu_memory_utilization: float = 0.9
  max_num_seqs: int | None = None  # running requests at most; None: what the pool holds at
  # a typical length (`atlas_jax.serving.sizing.TYPICAL_TOKENS`)
  max_num_batched_tokens: int | None = None  # per-step token budget; None: max(512, seqs)
  prefill_chunk: int = 256  # most prompt tokens one request computes per step (a power of two)
  max_model_len: int | None = None  # default: the model's max_seq_len
  enable_prefix_caching: bool = True
  # Naive pre-allocation, PagedAttention's baseline: every admitted request reserves blocks for a
  # whole max_model_len up front, so at most n_blocks // (max_model_len / block_size) run at once
  # (per replica), none shares a block (no prefix caching) and none is preempted.
  preallocate: bool = False
  # A model mixing sliding-window and full-attention layers (Gemma 2 and 3, gpt-oss) keeps its
  # windowed layers' blocks in a pool of their own, each request holding only its window's there
  # (`atlas_jax.cache.paged.HybridPool`; n_blocks then counts blocks of every layer, split
  # between the two pools); True: one pool for every layer, as for other models (vLLM's flag).
  disable_hybrid_kv_cache_manager: bool = False
  decode_burst: int = 8  # I: decode iterations per call when no request needs the host; 1: off
  # The same while the engine is offline (`Engine.generate`, serve.py's batch mode: every
  # request added before the first step), where no arrival can wait for a burst; longer bursts
  # spread the host's work per call over more tokens. At least `decode_burst`; bursts stay off
  # with decode_burst 1.
  offline_burst: int = 32
  # Whether bursts run while a streamed request runs. Off (the default), a streamed request's
  # tokens leave one by one as they are drawn, as vLLM streams; on, they leave `decode_burst` at
  # a time (each still its own event), and the host's work is amortised over the burst.
  stream_bursts: bool = False
  # With a draft: tokens it proposes per round (None: 4, or the MTP heads' depth with "mtp"),
  # and the largest batch that speculates.
  num_speculative_tokens: int | None = None
  speculative_max_batch: int = 8  # measured: bench/speculative.py --engine
  # The same for a batch with a guided row, whose rounds pay a host walk of the drafts and
  # accept fewer of them; measured: bench/speculative.py --engine-guided.
  guided_speculative_max_batch: int = 4
  # A burst's or speculative round's rows are padded to a power of two, at least this many:
  # each bucket is one more compiled shape of every program (warm-up time), each padded row
  # wasted work. None: the runner's (8 on the ragged runner, whose decode steps read every
  # weight once whatever their rows; 1 on the CPU runner, whose rows each cost their own work).
  min_batch_bucket: int | None = None
  tensor_parallel_size: int = 1  # devices per replica: heads, FFN and vocabulary split over them
  data_parallel_size: int = 1  # replicas, each with its own requests and pages of the pool
  # Devices per replica that split a step's tokens between them (vLLM's prefill context
  # parallelism): each computes its share of a long prompt's chunk, its queries reading the
  # whole pool, which every one of them holds; decode steps run whole on each.
  prefill_context_parallel_size: int = 1
  # Which step shapes `Engine.warmup` compiles at start-up (`Engine.warmup_shapes` lists them):
  # "none"; "default": every shape a step, burst or speculative round can take (the CPU runner:
  # every decode, burst and speculative shape and every batch of fresh prompts); "all": on the
  # CPU runner also prefills over a context already in the pool. The first few compile before
  # the server answers, the rest on a background thread.
  warmup: str = "default"
  # Which model runner: "ragged" (`serving.runner.ModelRunner`: one ragged step per engine
  # iteration over the ragged paged-attention kernels, the accelerator path), "cpu"
  # (`serving.cpu.CPUModelRunner`: its specialisation for XLA's CPU backend), or "auto": the CPU
  # runner on a CPU backend, the ragged one elsewhere.
  runner: str = "auto"
  cpu: CPUConfig = dataclasses.field(default_factory=CPUConfig)

  def __post_init__(self):
    where = lambda name: f"serve.engine.{name}"
    if self.warmup not in WARMUP_LEVELS:
      _fail(where("warmup"), self.warmup, f"must be one of {', '.join(WARMUP_LEVELS)}")
    if self.runner not in RUNNERS:
      _fail(where("runner"), self.runner, f"must be one of {', '.join(RUNNERS)}")
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      _fail(
        where("kv_cache_dtype"), self.kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}"
      )
    for name in (
      "n_blocks",
      "block_size",
      "max_num_seqs",
      "max_num_batched_tokens",
      "max_model_len",
      "decode_burst",
      "offline_burst",
      "num_speculative_tokens",
      "speculative_max_batch",
      "guided_speculative_max_batch",
      "tensor_parallel_size",
      "data_parallel_size",
      "prefill_context_parallel_size",
    ):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        _fail(where(name), value, "must be a positive integer")
    for name in ("enable_prefix_caching", "stream_bursts", "disable_hybrid_kv_cache_manager"):
      if not isinstance(getattr(self, name), bool):
        _fail(where(name), getattr(self, name), "must be true or false")
    for name in ("prefill_chunk", "min_batch_bucket"):
      value = getattr(self, name)
      if value is None and name == "min_batch_bucket":
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        _fail(where(name), value, "must be a power of two")
      _power_of_two(where(name), value)
    m = self.kv_cache_memory
    if m is not None and (isinstance(m, bool) or not isinstance(m, int | float) or not m > 0):
      _fail(
        where("kv_cache_memory"),
        m,
        "must be bytes per device (a number > 1) or a fraction in (0, 1] of the memory the "
        "weights and activations leave",
      )
    if m is not None and m > 1 and m != int(m):
      _fail(where("kv_cache_memory"), m, "bytes must be a whole number")
    u = self.gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
      _fail(where("gpu_memory_utilization"), u, "must be a fraction in (0, 1]")
    seqs, budget = self.max_num_seqs, self.max_num_batched_tokens
    if seqs is not None and budget is not None and budget < seqs:
      _fail(
        where("max_num_batched_tokens"),
        budget,
        f"must be >= serve.engine.max_num_seqs={seqs} (one decode token per running request)",
      )


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """serve.limits: what one HTTP request (or batch-mode line) may ask for."""

  max_prompt_tokens: int | None = None  # default: the engine's context length
  max_tokens: int | None = None  # the most `max_tokens` may ask for; default: the context length
  max_n: int = 4  # choices per request
  max_body_bytes: int = 1 << 20
  max_logprobs: int = 20  # the most `logprobs` / `top_logprobs` may ask for (vLLM's default)

  def __post_init__(self):
    for name in ("max_prompt_tokens", "max_tokens", "max_n", "max_body_bytes"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        _fail(f"serve.limits.{name}", value, "must be a positive integer")
    v = self.max_logprobs
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20:
      _fail("serve.limits.max_logprobs", v, "must be an integer in [0, 20]")


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
  """serve.sampling: how a request samples where it does not say (a Hugging Face folder's
  generation_config.json replaces these; serve.py's flags replace both)."""

  max_new_tokens: int = 64
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  seed: int = 0

  def __post_init__(self):
    _positive("serve.sampling", self, "max_new_tokens", "repetition_penalty")
    if self.temperature < 0:
      _fail("serve.sampling.temperature", self.temperature, "must be >= 0 (0 is greedy)")
    if self.top_k < -1:
      _fail("serve.sampling.top_k", self.top_k, "must be >= -1 (0 or -1 disables top-k)")
    if not 0.0 < self.top_p <= 1.0:
      _fail("serve.sampling.top_p", self.top_p, "must be in (0, 1]")
    if not 0.0 <= self.min_p <= 1.0:
      _fail("serve.sampling.min_p", self.min_p, "must be in [0, 1]")
    if self.seed < 0:
      _fail("serve.sampling.seed", self.seed, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """How serve.py serves: the engine, the request limits and the sampling defaults."""

  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
  sampling: SamplingDefaults = dataclasses.field(default_factory=SamplingDefaults)
  # Weight-only quantization of the loaded model's projections (`atlas_jax.quant`): None (as
  # loaded), "int8" (per channel), "int4" (per channel and group of `quantization_group_size`
  # inputs) or "fp8" (e4m3, per channel); the LM head too with `quantize_lm_head`.
  quantization: str | None = None
  quantization_group_size: int = 128
  quantize_lm_head: bool = False

  def __post_init__(self):
    if self.quantization is not None and self.quantization not in QUANTIZATIONS:
      _fail("serve.quantization", self.quantization, f"must be one of {', '.join(QUANTIZATIONS)}")
    if self.quantization_group_size <= 0:
      _fail("serve.quantization_group_size", self.quantization_group_size, "must be positive")


# Run directories written before `serve:` had sections hold these flat fields.
LEGACY_SERVE_FIELDS = {
  "max_new_tokens": "sampling",
  "temperature": "sampling",
  "top_k": "sampling",
  "top_p": "sampling",
  "seed": "sampling",
  "max_batch": "engine.max_num_seqs",
}


# Engine fields that moved into `serve.engine.cpu`, by their old names.
LEGACY_ENGINE_FIELDS = {"weight_layout": "weight_layout", "cpu_matmul": "matmul"}
LEGACY_ENGINE_FIELDS["cpu_reductions"] = "reductions"


def migrate_serve(data: dict[str, Any]) -> None:
  """Moves a flat `serve:` section's fields into their sections, and the CPU runner's old
  engine fields into `serve.engine.cpu`, in place."""
  serve = data.get("serve")
  if not isinstance(serve, dict):
    return
  engine = serve.get("engine")
  if isinstance(engine, dict):
    for old, new in LEGACY_ENGINE_FIELDS.items():
      if old in engine:
        cpu = engine.setdefault("cpu", {})
        if isinstance(cpu, dict):
          cpu.setdefault(new, engine.pop(old))
  for name, target in LEGACY_SERVE_FIELDS.items():
    if name in serve:
      section, _, field = target.partition(".")
      node = serve.setdefault(section, {})
      if isinstance(node, dict):
        node.setdefault(field or name, serve.pop(name))


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)

  def __post_init__(self):
    k = self.train.remat_every
    runs = [n for _, n in self.model.layer_runs()]
    if k is not None and any(n % k for n in runs):
      where = (
        f"model.n_layers={self.model.n_layers}"
        if len(runs) == 1
        else (f"every run of identical layers (dense and MoE runs of {runs} layers)")
      )
      _fail("train.remat_every", k, f"must divide {where} (groups of k)")
    if self.train.eval_exact_match and self.data.format == "text":
      _fail(
        "train.eval_exact_match",
        self.train.eval_exact_match,
        "needs supervised examples to score (data.format chat or completion); 0 for text",
      )
    if self.mesh.stage != -1:  # -1: checked once the mesh is built
      check_pipeline(self.model, self.train, stages=self.mesh.stage)
    if self.train.seq_len > self.model.max_seq_len:
      _fail(
        "train.seq_len",
        self.train.seq_len,
        f"must be <= model.max_seq_len={self.model.max_seq_len}",
      )
    check_context(self.model, self.train, self.mesh)

  def to_dict(self) -> dict[str, Any]:
    """Plain YAML-ready data: nested dicts, tuples as lists (YAML's safe dumper writes only
    plain types)."""
    return dataclasses.asdict(self, dict_factory=lambda kv: {k: _plain(v) for k, v in kv})


def _plain(value: Any) -> Any:
  return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def check_context(model: ModelConfig, train: TrainConfig, mesh: MeshConfig) -> None:
  """Raises ConfigError for a `mesh.context` split the run cannot take."""
  C = mesh.context
  if train.context_parallel not in ("all_gather", "ring"):
    _fail("train.context_parallel", train.context_parallel, "must be one of all_gather, ring")
  if C == 1 or C == -1:  # -1: checked once the mesh is built (`atlas_jax.training.step`)
    return
  if train.seq_len % (2 * C):
    _fail(
      "train.seq_len",
      train.seq_len,
      f"must be divisible by 2 * mesh.context = {2 * C} (each device holds two chunks)",
    )
  for name, value, why in (
    ("model.mla", model.mla, "MLA attention has no context-parallel path"),
    ("model.mtp", model.mtp, "the MTP heads shift along the sequence"),
  ):
    if value is not None:
      _fail("mesh.context", C, f"must be 1 with {name} ({why})")
  if mesh.stage > 1:
    _fail("mesh.context", C, f"must be 1 with mesh.stage={mesh.stage} (pipeline stages)")


def check_pipeline(
  model: ModelConfig, train: TrainConfig, *, stages: int, batch_shards: int | None = None
) -> None:
  """Raises ConfigError for a pipeline the layers or the batch cannot be split into.

  The stages split one stack of identical layers: every layer of a dense model, the MoE layers of
  a mixture-of-experts model (its dense layers, which must all come first, run before the
  pipeline; `pipelined_layers`).

  Args:
    stages: the mesh's `stage` size (p).
    batch_shards: data-parallel devices (data x fsdp x expert), where known: checks the batch
      split.
  """
  U, r = train.pipeline_microbatches, train.pipeline_repeats
  if stages == 1:
    # Micro-batches without stages would only repeat what train.grad_accum does.
    for name, value in (("pipeline_microbatches", U), ("pipeline_repeats", r)):
      if value != 1:
        _fail(
          f"train.{name}",
          value,
          "must be 1 with mesh.stage=1 (no pipeline); set mesh.stage > 1 to pipeline the layers, "
          "or use train.grad_accum for micro-batches without stages",
        )
    return
  L = pipelined_layers(model, stages=stages)
  if L % (stages * r):
    if L == model.n_layers:
      _fail(
        "model.n_layers",
        L,
        f"must be divisible by mesh.stage x train.pipeline_repeats = {stages} x {r} (each stage "
        "runs n_layers / (stage x repeats) contiguous layers per repeat)",
      )
    _fail(
      "model.n_layers",
      model.n_layers,
      f"leaves {L} MoE layers after the {model.n_layers - L} dense ones, and the pipeline stages "
      f"split the MoE layers: their count must be divisible by mesh.stage x "
      f"train.pipeline_repeats = {stages} x {r}",
    )
  if r > 1 and U < stages:
    _fail(
      "train.pipeline_microbatches",
      U,
      f"must be >= mesh.stage={stages} with train.pipeline_repeats={r} > 1: a circular pipeline "
      "feeds each micro-batch back to the first stage, which must not still be busy",
    )
  k = train.remat_every
  per_stage = L // (stages * r)
  if k is not None and train.remat == "every_k" and per_stage % k:
    _fail(
      "train.remat_every",
      k,
      f"must divide the layers a stage runs at a time, "
      f"{'n_layers' if L == model.n_layers else f'the {L} MoE layers'} / (stage x repeats) = "
      f"{per_stage}",
    )
  if batch_shards is None:
    return
  A, B = train.grad_accum, train.batch_size
  rows = B // A // batch_shards if B % (A * batch_shards) == 0 else None
  if rows is None or rows % U or rows % stages:
    _fail(
      "train.batch_size",
      B,
      f"must split into train.grad_accum={A} x {batch_shards} data-parallel shards (mesh.data x "
      f"mesh.fsdp x mesh.expert) whose rows divide by train.pipeline_microbatches={U} and by "
      f"mesh.stage={stages}: a multiple of {A * batch_shards * math.lcm(U, stages)}",
    )


def pipelined_layers(model: ModelConfig, *, stages: int) -> int:
  """The layers pipeline stages split: all of a dense model's, the MoE layers of an MoE model.

  Raises ConfigError when an MoE model's dense layers do not all come before its MoE ones
  (`stages` names the mesh.stage the error is for)."""
  runs = model.layer_runs()
  kinds = [sparse for sparse, _ in runs]
  if kinds in ([False], [True], [False, True]):
    return runs[-1][1]
  moe = model.moe
  field, value = (
    ("model.moe.sparse_step", moe.sparse_step)
    if moe.sparse_step != 1
    else ("model.moe.dense_layers", list(moe.dense_layers))
  )
  layout = ", ".join(f"{'MoE' if sparse else 'dense'} x{n}" for sparse, n in runs)
  _fail(
    field,
    value,
    f"with mesh.stage={stages} the dense layers must all come before the MoE ones (the stages "
    "split the MoE layers; the dense ones run before the pipeline): model.moe.sparse_step=1 and "
    f"model.moe.dense_layers only among the first layers (or model.moe.first_k_dense); these "
    f"layers run as {layout}",
  )


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with a type check per field.


def _describe(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  if tp is type(None):
    return "null"
  if dataclasses.is_dataclass(tp):
    return f"a mapping of {tp.__name__} fields"
  return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, field: str) -> Any:
  """Returns `value` as type `tp`, or raises ConfigError naming `field`."""
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own, more precise error
      return _coerce(options[0], value, field)
    for arg in options:
      try:
        return _coerce(arg, value, field)
      except ConfigError:
        pass
    _fail(field, value, f"expected {_describe(tp)}")
  if origin is Literal:
    if value not in typing.get_args(tp):
      _fail(field, value, f"expected {_describe(tp)}")
    return value
  if origin is tuple:
    (item, _) = typing.get_args(tp)  # tuple[X, ...]
    if not isinstance(value, list | tuple):
      _fail(field, value, f"expected a list of {_describe(item)}")
    return tuple(_coerce(item, v, f"{field}[{i}]") for i, v in enumerate(value))
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, Mapping):
      _fail(field, value, f"expected {_describe(tp)}")
    return build(tp, value, prefix=field)
  if tp is bool:
    if not isinstance(value, bool):
      _fail(field, value, "expected true or false")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      _fail(field, value, "expected an integer")
    return value
  if tp is float:
    if isinstance(value, str):
      # YAML 1.1 reads "1e-3" (no dot) as a string; accept any string Python parses as a float.
      try:
        return float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, int | float):
      _fail(field, value, "expected a number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      _fail(field, value, "expected a string")
    return value
  if origin is tuple:  # tuple[X, ...]: a YAML list
    (item, _) = typing.get_args(tp)
    if not isinstance(value, list | tuple):
      _fail(field, value, f"expected a list of {_describe(item)}")
    return tuple(_coerce(item, v, f"{field}[{i}]") for i, v in enumerate(value))
  raise TypeError(f"unsupported config field type {tp!r} for {field}")


def build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
  """Builds dataclass `cls` from a mapping, rejecting unknown keys and ill-typed values."""
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in data:
    if key not in names:
      where = f"{prefix}.{key}" if prefix else str(key)
      raise ConfigError(f"{where} is not a known field; allowed: {', '.join(names)}")
  kwargs = {}
  for key, value in data.items():
    where = f"{prefix}.{key}" if prefix else key
    kwargs[key] = _coerce(hints[key], value, where)
  return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """Applies `a.b=value` overrides (values parsed as YAML) to a nested dict, in place."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like section.field=value")
    path, raw = item.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
      raise ConfigError(f"override {item!r} has an empty field name")
    node = data
    for key in keys[:-1]:
      child = node.get(key)
      if child is None:
        child = node[key] = {}
      if not isinstance(child, dict):
        raise ConfigError(f"override {item!r}: {key} is not a section")
      node = child
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None
  return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
  """Loads a YAML preset (or the defaults when `path` is None) and applies overrides.

  A preset that fine-tunes (train.init_from) takes its model from the source: see
  `atlas_jax.sources.load_config`, which reads it.
  """
  return build(Config, read_config(path, overrides))


def read_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """The plain data of a YAML preset with the overrides applied, before any check."""
  data: dict[str, Any] = {}
  if path is not None:
    path = Path(path)
    if not path.is_file():
      raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
      loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
      detail = " ".join(str(e).split())
      raise ConfigError(f"config file {str(path)!r} is not valid YAML: {detail}") from None
    if not isinstance(loaded, dict):
      raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    data = loaded
  apply_overrides(data, overrides)
  migrate_serve(data)
  return data


def dump_config(cfg: Config) -> str:
  return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
