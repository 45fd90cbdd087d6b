"""Training memory per device: parameters, gradients and optimizer state under each sharding
strategy, and the activations each remat policy saves, from the config alone.

State. The trainer keeps float32 master weights whatever the compute precision, float32 gradients
(they arrive through the bf16/fp16 cast in float32) and AdamW's two float32 moments, plus two int32
step counters: 4 + 4 + 8 = 16 bytes per parameter. (The ZeRO paper's 16 bytes for mixed-precision
Adam split differently, 2 + 2 + 12: fp16 weights and gradients beside fp32 master weights and
moments; here the low-precision weight copies are made at use, and counted with the activations.)
Each strategy splits some of it over the `fsdp` mesh axis, tensor parallelism splits heads,
FFN columns (an expert's too) and the vocabulary over `tensor`, and expert parallelism splits the
routed experts over `expert` (whatever the strategy; the ways come out of the data-parallel
devices, as in `atlas_jax.training.sharding`). DeepSeek-V3's router biases are parameters here
(saved, 4 bytes each) with no gradient and no optimizer state:

  strategy   parameters  gradients  optimizer state
  dp         replicated  replicated replicated
  zero1      replicated  replicated sharded
  zero2      replicated  sharded    sharded
  zero3      sharded     sharded    sharded
  tensor     every device is a tensor-parallel shard (mesh.tensor = devices), nothing over fsdp

A dimension the mesh axis does not divide stays replicated, as in `atlas_jax.training.sharding`.

With LoRA (train.lora) the base weights are held as they are, the adapters beside them, and only
the adapters have gradients and AdamW moments: 4 bytes per frozen parameter, 16 per adapter one.

Activations. What the train step's forward pass saves for its backward pass (the residuals of
`jax.vjp`), counted tensor by tensor from the model code: per layer and token under `none`,

  Llama (GQA):  4D*c + 16D + 6F*c + 16               (residual stream, two RMSNorms, SwiGLU)
                + 2N*H*c + K*H*(c + 4) + 8N*S + 8N    (xla attention: f32 scores and probabilities)
                or 3N*H*c + 2K*H*c + 4N               (flash attention: q, k, v, out, log-sum-exp)
  MLA adds the latent and query norms (2C*c + 8C, 2Q*c + 8Q) and caches N heads of Hn + R / Hv.

with c the compute dtype's bytes, S = T the context. `full` keeps each block's input (D*c per
token), `every_k` every k-th, `selective` the eight named matmul outputs (2D + 2F + 2N*H + 2K*H,
times c; MLA keeps its query (and bottleneck), latent, K and V up-projections and output). With
bf16 compute, `none` also keeps the bf16 copy of every weight it cast. The final norm, the f32
logits and the loss add a fixed amount per token: 4V + 17 bytes for the logits and the loss, or
12 with the chunked cross-entropy (train.loss_chunk), which also keeps no compute-dtype copy of
the head. Multi-token-prediction heads run outside the remat policy and always keep their
residuals. `tests/plan` checks these against the real train step's residuals. Mixture-of-experts
layers are an estimate, not checked: the dense MLP's terms replaced by k experts' (each token's k
copies, their SwiGLU, the float32 router logits and probabilities) plus the shared experts'.
"""

from __future__ import annotations

import dataclasses
import math

from atlas_jax.config import ModelConfig
from atlas_jax.model.scan import default_every
from atlas_jax.plan.params import ParamSpec, block, inventory, lora_adapters, mtp_head

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tensor")
REMAT_POLICIES = ("none", "full", "every_k", "selective")
ATTENTION_IMPLS = ("flash", "xla")
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}  # compute dtype bytes

# Logical axis -> mesh axis. Tensor parallelism as in atlas_jax.training.sharding.TENSOR_RULES,
# expert parallelism as in its EXPERT_RULES.
TENSOR_AXES = ("q_heads", "kv_heads", "mlp", "expert_mlp", "vocab")
EXPERT_AXES = ("experts",)
# ZeRO splits the model width and MLA's low-rank bottlenecks (as training.sharding.FSDP_RULES).
FSDP_AXES = ("embed", "q_lora", "kv_lora")
_STAGE = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "tensor": 0}
_ADAM_COUNTERS = 2 * 4  # int32 step counts of scale_by_adam and the learning-rate schedule


def _check_int(name: str, value, minimum: int = 1) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def mesh_for(strategy: str, devices: int, tensor: int = 1, expert: int = 1) -> dict[str, int]:
  """(data, fsdp, expert, tensor) sizes a strategy uses on `devices` devices."""
  if strategy not in STRATEGIES:
    raise ValueError(f"--strategy={strategy!r} is not allowed; allowed: {', '.join(STRATEGIES)}")
  _check_int("devices", devices)
  _check_int("tensor", tensor)
  _check_int("expert", expert)
  if strategy == "tensor":
    if expert != 1:
      raise ValueError(f"--expert={expert} needs a strategy other than tensor (every device TP)")
    return {"data": 1, "fsdp": 1, "expert": 1, "tensor": devices}
  if devices % tensor:
    raise ValueError(f"--tensor={tensor} must divide --devices={devices}")
  if (devices // tensor) % expert:
    raise ValueError(
      f"--expert={expert} must divide --devices / --tensor = {devices // tensor} (the "
      "data-parallel devices the experts are split over)"
    )
  rest = devices // tensor // expert
  if strategy == "dp":
    return {"data": rest, "fsdp": 1, "expert": expert, "tensor": tensor}
  return {"data": 1, "fsdp": rest, "expert": expert, "tensor": tensor}


def shard_elements(spec: ParamSpec, *, fsdp: int, tensor: int, expert: int = 1) -> int:
  """Elements of `spec` one device holds when split over fsdp, expert and/or tensor ways (1: not
  split).

  As `atlas_jax.training.sharding.spec_for`: dimensions in order, each mesh axis splits the first
  dimension it divides among those whose logical axis maps to it; the rest stay replicated.
  """
  sizes = {"fsdp": fsdp, "tensor": tensor, "expert": expert}
  shape, used = list(spec.shape), set()
  for i, axis in enumerate(spec.axes):
    mesh_axis = (
      "tensor"
      if axis in TENSOR_AXES
      else "fsdp"
      if axis in FSDP_AXES
      else "expert"
      if axis in EXPERT_AXES
      else None
    )
    if mesh_axis is None or mesh_axis in used or sizes[mesh_axis] == 1:
      continue
    if shape[i] % sizes[mesh_axis] == 0:
      shape[i] //= sizes[mesh_axis]
      used.add(mesh_axis)
  return math.prod(shape)


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Per-device bytes of the training state under one strategy."""

  strategy: str
  mesh: dict[str, int]
  params: int
  grads: int
  opt_state: int
  experts: int = 0  # of `params`, the routed experts' weights (split over the expert axis)

  @property
  def total(self) -> int:
    return self.params + self.grads + self.opt_state


def state_bytes(
  cfg: ModelConfig,
  *,
  strategy: str,
  devices: int,
  tensor: int = 1,
  expert: int = 1,
  master_bytes: int = 4,
  lora: tuple[int, frozenset[str]] | None = None,
) -> StateBytes:
  """Per-device parameter, gradient and AdamW bytes (float32 master weights and moments).

  `lora`: (rank, resolved targets): the adapters are parameters too, and the only ones with
  gradients and optimizer state.
  """
  mesh = mesh_for(strategy, devices, tensor, expert)
  stage = _STAGE[strategy]
  base = inventory(cfg)
  adapters = [] if lora is None else lora_adapters(cfg, *lora)
  trained = base if lora is None else adapters

  def per_device(
    specs: list[ParamSpec], sharded: bool, *, trainable_only: bool = True, only=lambda p: True
  ) -> int:
    fsdp = mesh["fsdp"] if sharded else 1
    return master_bytes * sum(
      shard_elements(p, fsdp=fsdp, tensor=mesh["tensor"], expert=mesh["expert"])
      for p in specs
      if (p.trainable or not trainable_only) and only(p)
    )

  return StateBytes(
    strategy=strategy,
    mesh=mesh,
    params=per_device(base + adapters, stage >= 3, trainable_only=False),
    grads=per_device(trained, stage >= 2),
    opt_state=2 * per_device(trained, stage >= 1) + _ADAM_COUNTERS,
    experts=per_device(base, stage >= 3, only=lambda p: p.is_routed_expert),
  )


# ------------------------------------------------------------------------------------------------
# Activations


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
  """Per-device activation bytes of one micro-batch under one remat policy."""

  policy: str
  saved: int  # kept from the forward pass for the backward pass
  recompute: int  # the working set the backward pass rebuilds at a time (one block or group)
  per_layer_none: int  # one block's residuals without remat (what `full` recomputes)
  outside_blocks: int  # part of `saved` outside the layer stack: logits, loss, final norm, MTP

  @property
  def peak(self) -> int:
    return self.saved + self.recompute


def _split(n: int, tensor: int) -> float:
  """n / tensor when tensor parallelism splits it (heads, FFN, vocab), else n."""
  return n / tensor if tensor > 1 and n % tensor == 0 else n


def _ffn_tokens(cfg: ModelConfig, c: int, tp: int, sparse: bool) -> float:
  """Bytes a block's feed-forward saves per token: the dense SwiGLU's, or (an estimate) an MoE
  layer's: k copies of the token and k experts' SwiGLU, the float32 router logits and
  probabilities and the k weights, plus the shared experts' SwiGLU."""
  if not sparse:
    return 6 * _split(cfg.ffn_dim, tp) * c
  m, D = cfg.moe, cfg.d_model
  k, E = m.top_k, m.n_experts
  out = k * (D * c + 6 * _split(m.expert_ffn_dim, tp) * c) + 8 * E + 8 * k
  return out + (6 * _split(m.shared_ffn_dim, tp) * c + D * c if m.shared_ffn_dim else 0)


def _ffn_kept(cfg: ModelConfig, tp: int, sparse: bool) -> float:
  """Elements per token the selective policy keeps of a feed-forward's matmul outputs: a SwiGLU
  keeps its gate and up (F each) and down (D) outputs; an MoE layer k experts' and the shared."""
  swiglu = lambda F: cfg.d_model + 2 * _split(F, tp)
  if not sparse:
    return swiglu(cfg.ffn_dim)
  m = cfg.moe
  return m.top_k * swiglu(m.expert_ffn_dim) + (swiglu(m.shared_ffn_dim) if m.shared_ffn_dim else 0)


def _layer_tokens(
  cfg: ModelConfig, c: int, S: int, attention: str, tp: int, sparse: bool = False
) -> float:
  """Bytes one block saves per token without remat (see the module docstring)."""
  D, N = cfg.d_model, _split(cfg.n_heads, tp)
  n_norms = 2
  out = 4 * D * c + 16 * D + _ffn_tokens(cfg, c, tp, sparse)
  if cfg.mla is None:
    K, H = _split(cfg.n_kv_heads, tp), cfg.head_dim
    if attention == "xla":
      out += 2 * N * H * c + K * H * (c + 4) + 8 * N * S + 8 * N
    else:
      out += 3 * N * H * c + 2 * K * H * c + 4 * N
    if cfg.qk_norm:  # RMSNorm over each q and k head (Qwen3; OLMoE: all heads, an estimate)
      out += (N + K) * (H * (8 + c) + 8)
  else:
    m = cfg.mla
    C, Hv = m.kv_lora_rank, m.v_head_dim
    Hp = max(m.qk_head_dim, Hv)  # the dispatcher pads q, k and v to one head dim
    out += 2 * C * c + 8 * C
    n_norms += 1
    if m.q_lora_rank is not None:
      out += 2 * m.q_lora_rank * c + 8 * m.q_lora_rank
      n_norms += 1
    if attention == "xla":
      out += N * (2 * Hp * c + Hv * c + 4 * Hp) + 8 * N * S + 8 * N
    else:
      # q, k, v and out at the padded width; v also unpadded when padding made a new array
      out += N * (4 * Hp * c + (Hv * c if Hv != Hp else 0)) + 4 * N
  return out + 8 * n_norms


def _layer_fixed(specs: list[ParamSpec], c: int, master_bytes: int, tp: int) -> float:
  """Bytes one block saves whatever the token count: the compute-dtype copies of its weights.

  With bf16/fp16 compute every weight is cast at use and the cast kept; in float32 only the
  RMSNorm scales' broadcasts are new arrays.
  """
  cast = c != master_bytes
  total = 0.0
  for p in specs:
    if cast or p.is_norm:
      dims = [_split(n, tp) if axis in TENSOR_AXES else n for n, axis in zip(p.shape, p.axes)]
      total += c * math.prod(dims)
  return total


def _rope_dim(cfg: ModelConfig) -> int:
  return cfg.head_dim if cfg.mla is None else cfg.mla.qk_rope_head_dim


def _loss_tokens(V: float, chunked: bool) -> float:
  """Per-token bytes one cross-entropy keeps: the float32 logits and the loss's scalars, or,
  chunked, the target, the mask and log Z (`atlas_jax.training.loss.chunked_cross_entropy`)."""
  return 12 if chunked else 4 * V + 17


def _global_tokens(
  cfg: ModelConfig, c: int, S: int, attention: str, policy: str, tp: int, chunked: bool = False
) -> float:
  """Per-token bytes outside the blocks: embedding indices, final norm, logits, loss."""
  D, V = cfg.d_model, _split(cfg.vocab_size, tp)
  out = 4 + (8 * D + 2 * D * c + 8) + _loss_tokens(V, chunked)
  if policy != "none":
    return out + 4  # the positions, from which the recomputed blocks rebuild RoPE and masks
  out += 2 * _rope_dim(cfg) * c  # cos and sin for q and k
  N = _split(cfg.n_heads, tp)
  return out + (5 * N * S + 4 if attention == "xla" else 8)  # xla: the causal mask and scores


def _mtp_tokens(
  cfg: ModelConfig, c: int, S: int, attention: str, tp: int, chunked: bool = False
) -> float:
  """Per-token bytes the MTP heads keep (they run outside the remat policy)."""
  if cfg.mtp is None:
    return 0.0
  D, V, R = cfg.d_model, _split(cfg.vocab_size, tp), _rope_dim(cfg)
  # Its block (whose input is a new array here), logits and loss.
  sparse = cfg.moe is not None and cfg.moe.is_sparse(cfg.n_layers)
  head = _layer_tokens(cfg, c, S, attention, tp, sparse) + D * c + _loss_tokens(V, chunked)
  if cfg.mtp.kind == "sequential":
    # enorm, hnorm and the output norm; the [2D] concatenation; RoPE at positions t + j; the
    # shifted tokens' embedding indices.
    head += 24 * D + 5 * D * c + 24 + 2 * R * c + 4
    shared = 0
  else:
    shared = 2 * R * c + 8 * D + D * c + 8  # RoPE and the trunk's hidden state, once for all
  N = _split(cfg.n_heads, tp)
  shared += 5 * N * S + 4 if attention == "xla" else 8  # the heads' own causal mask
  return cfg.mtp.n_predict * head + shared


def activation_bytes(
  cfg: ModelConfig,
  *,
  policy: str,
  batch: int,
  seq_len: int,
  compute_bytes: int,
  attention: str = "flash",
  remat_every: int | None = None,
  tensor: int = 1,
  master_bytes: int = 4,
  loss_chunk: int = 0,
) -> ActivationBytes:
  """Activation bytes of a `batch` x `seq_len` micro-batch on one device.

  Args:
    policy: one of REMAT_POLICIES.
    compute_bytes: 4 (fp32) or 2 (bf16 / fp16 compute).
    attention: "flash" (the Pallas kernel, the default on GPU and TPU) or "xla" (the reference,
      which saves the [N, T, S] probabilities).
    remat_every: k for every_k (must divide n_layers); default the divisor nearest sqrt(L).
    tensor: tensor-parallel ways (head, FFN and vocab sized tensors split; estimate only).
    loss_chunk: train.loss_chunk; > 0, the chunked cross-entropy keeps no logits and no
      compute-dtype copy of the head (it casts the head inside, once per pass).
  """
  if policy not in REMAT_POLICIES:
    raise ValueError(f"--remat={policy!r} is not allowed; allowed: {', '.join(REMAT_POLICIES)}")
  if attention not in ATTENTION_IMPLS:
    raise ValueError(f"--attention={attention!r} is not allowed; allowed: {ATTENTION_IMPLS}")
  _check_int("batch", batch)
  _check_int("seq_len", seq_len)
  L, D, c, M, tp = cfg.n_layers, cfg.d_model, compute_bytes, batch * seq_len, tensor
  S = seq_len
  sparse_L = cfg.sparse_layers()

  def layer_bytes(sparse: bool) -> float:
    per_token = _layer_tokens(cfg, c, S, attention, tp, sparse) * M
    return per_token + _layer_fixed(block(cfg, sparse), c, master_bytes, tp)

  by_kind = {sparse: layer_bytes(sparse) for sparse in set(sparse_L)}
  all_layers = sum(by_kind[sparse] for sparse in sparse_L)
  per_layer = max(by_kind.values())  # the largest block: what one recomputation rebuilds
  fixed = D * c  # the final norm's scale, broadcast
  chunked = loss_chunk > 0
  if not chunked and (c != master_bytes or cfg.tie_embeddings):
    fixed += c * D * _split(cfg.vocab_size, tp)  # the head's compute-dtype copy, or transpose
  glob = _global_tokens(cfg, c, S, attention, policy, tp, chunked) * M + fixed
  if cfg.mtp is not None:
    head_specs = mtp_head(cfg)
    glob += _mtp_tokens(cfg, c, S, attention, tp, chunked) * M
    glob += cfg.mtp.n_predict * _layer_fixed(head_specs, c, master_bytes, tp)
    if c != master_bytes and not chunked:
      glob += c * D * _split(cfg.vocab_size, tp)  # the head is cast again for the MTP logits
  if policy == "none":
    saved, recompute = all_layers, 0.0
  elif policy == "full":
    saved, recompute = L * D * c * M, per_layer
  elif policy == "every_k":
    k = default_every(L) if remat_every is None else remat_every
    if L % k:
      raise ValueError(f"--remat-every={k} must divide the model's n_layers={L}")
    saved, recompute = (L // k) * D * c * M, k * per_layer
  else:
    if cfg.mla is None:
      kept = D  # o_proj
      kept += 2 * cfg.head_dim * (_split(cfg.n_heads, tp) + _split(cfg.n_kv_heads, tp))
    else:
      m, N = cfg.mla, _split(cfg.n_heads, tp)
      kept = D  # o_proj
      # q, the latent and rope key, K's and V's up-projections, the attention output
      kept += N * m.qk_head_dim + m.kv_lora_rank + m.qk_rope_head_dim
      kept += N * (m.qk_nope_head_dim + 2 * m.v_head_dim) + (m.q_lora_rank or 0)
    kept_L = [(kept + _ffn_kept(cfg, tp, sparse)) * c * M for sparse in sparse_L]
    saved = sum(kept_L)
    recompute = max(max(by_kind[sp] - k for sp, k in zip(sparse_L, kept_L)), 0.0)
  return ActivationBytes(
    policy=policy,
    saved=int(round(saved + glob)),
    recompute=int(round(recompute)),
    per_layer_none=int(round(per_layer)),
    outside_blocks=int(round(glob)),
  )
