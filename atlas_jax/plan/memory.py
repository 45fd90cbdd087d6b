"""Training memory per device: parameters, gradients and optimizer state under each sharding
strategy, and the activations each remat policy saves, from the config alone.

State. The trainer keeps float32 master weights whatever the compute precision, float32 gradients
(they arrive through the bf16/fp16 cast in float32) and AdamW's two float32 moments, plus an int32
update count: 4 + 4 + 8 = 16 bytes per parameter. (The ZeRO paper's 16 bytes for mixed-precision
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

Pipeline stages (mesh.stage) split the stacked-layer axis under every strategy (of an MoE model,
the MoE layers' stack; its dense layers' is whole on every stage). A dimension the mesh axis does
not divide stays replicated, as in `atlas_jax.training.sharding`.

With LoRA (train.lora) the base weights are held as they are, the adapters beside them, and only
the adapters have gradients and AdamW moments: 4 bytes per frozen parameter, 16 per adapter one.
QLoRA (train.base_quantization) holds the base's projections quantized: a byte per int8 or fp8
value, half a byte per int4 one, and their float32 scales (`quantized_parts`).

Activations. What the train step's forward pass saves for its backward pass (the residuals of
`jax.vjp`), counted tensor by tensor from the model code: per layer and token under `none`,

  Llama (GQA):  4D*c + 16D + 6F*c + 16               (residual stream, two RMSNorms, SwiGLU)
                + 2N*H*c + K*H*(c + 4) + 8N*S + 8N    (xla attention: f32 scores and probabilities)
                or 3N*H*c + 2K*H*c + 4N               (flash attention: q, k, v, out, log-sum-exp)
  MLA adds the latent and query norms (2C*c + 8C, 2Q*c + 8Q) and caches N heads of Hn + R / Hv.

with c the compute dtype's bytes, S = T the context. `full` keeps each block's input (D*c per
token), `every_k` every k-th, `selective` the eight named matmul outputs (2D + 2F + 2N*H + 2K*H,
times c; MLA keeps its query (and bottleneck), latent, K and V up-projections and output). With bf16
compute, `none` also keeps the bf16 copy of every weight it cast (of a QLoRA base's quantized
projections, only their scales'). The final norm, the f32 logits and the loss add a fixed amount per
token: 4V + 17 bytes for the logits and the loss, or 12 with the chunked cross-entropy
(train.loss_chunk), which also keeps no compute-dtype copy of the head. Multi-token-prediction heads
run outside the remat policy and always keep their residuals. A pipelined step
(`activation_bytes(schedule=...)`) keeps, on each stage, its layers' residuals for every one of the
schedule's iterations (one micro-batch each). `tests/plan` checks these against the real train
step's residuals (per device, for the pipelined step).
Mixture-of-experts layers are an estimate, not checked: the dense MLP's terms replaced by k
experts' (each token's k copies, their SwiGLU, the float32 router logits and probabilities) plus
the shared experts'.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from atlas_jax import quant
from atlas_jax.config import ModelConfig, pipelined_layers
from atlas_jax.model.scan import default_every
from atlas_jax.plan.kv import cached_vector_bytes
from atlas_jax.plan.params import ParamSpec, block, inventory, lora_adapters, mtp_head
from atlas_jax.schedule import Schedule

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
# Pipeline stages split the stacked-layer axis (as training.sharding.STAGE_RULES).
STAGE_AXIS = "layers"
_ZERO = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "tensor": 0}
_ADAM_COUNTERS = 4  # the int32 update count (`training.optimizer.AdamWState`)


def _check_int(name: str, value, minimum: int = 1) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def mesh_for(
  strategy: str, devices: int, tensor: int = 1, stage: int = 1, expert: int = 1
) -> dict[str, int]:
  """(data, fsdp, expert, stage, tensor) sizes a strategy uses on `devices` devices, `stage` of
  them pipeline stages (`tensor` then takes what the stages leave, `expert` what tensor leaves)."""
  if strategy not in STRATEGIES:
    raise ValueError(f"--strategy={strategy!r} is not allowed; allowed: {', '.join(STRATEGIES)}")
  _check_int("devices", devices)
  _check_int("tensor", tensor)
  _check_int("pipeline", stage)
  _check_int("expert", expert)
  if devices % stage:
    raise ValueError(f"--pipeline={stage} must divide --devices={devices}")
  per_stage = devices // stage
  if strategy == "tensor":
    if expert != 1:
      raise ValueError(f"--expert={expert} needs a strategy other than tensor (every device TP)")
    return {"data": 1, "fsdp": 1, "expert": 1, "stage": stage, "tensor": per_stage}
  if per_stage % tensor:
    raise ValueError(
      f"--tensor={tensor} must divide --devices={devices}"
      + (f" / --pipeline={stage}" if stage > 1 else "")
    )
  if (per_stage // tensor) % expert:
    raise ValueError(
      f"--expert={expert} must divide --devices / --tensor"
      + (" / --pipeline" if stage > 1 else "")
      + f" = {per_stage // tensor} (the data-parallel devices the experts are split over)"
    )
  rest = per_stage // tensor // expert
  if strategy == "dp":
    return {"data": rest, "fsdp": 1, "expert": expert, "stage": stage, "tensor": tensor}
  return {"data": 1, "fsdp": rest, "expert": expert, "stage": stage, "tensor": tensor}


def shard_elements(
  spec: ParamSpec, *, fsdp: int, tensor: int, stage: int = 1, expert: int = 1
) -> int:
  """Elements of `spec` one device holds when split over fsdp, tensor, stage and expert ways (1:
  not split).

  As `atlas_jax.training.sharding.spec_for`: dimensions in order, each mesh axis splits the first
  dimension it divides among those whose logical axis maps to it; the rest stay replicated.
  Pipeline stages split the stacked-layer axis ("layers").
  """
  sizes = {"fsdp": fsdp, "tensor": tensor, "stage": stage, "expert": expert}
  shape, used = list(spec.shape), set()
  for i, axis in enumerate(spec.axes):
    mesh_axis = (
      "tensor"
      if axis in TENSOR_AXES
      else "fsdp"
      if axis in FSDP_AXES
      else "stage"
      if axis == STAGE_AXIS
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
  stage: int = 1,
  expert: int = 1,
  master_bytes: int = 4,
  lora: tuple[int, frozenset[str]] | None = None,
  base_quantization: tuple[str, int] | None = None,
) -> StateBytes:
  """Per-device parameter, gradient and AdamW bytes (float32 master weights and moments);
  `stage` pipeline stages split the layer stack under every strategy, `expert` ways the routed
  experts.

  `lora`: (rank, resolved targets): the adapters are parameters too, and the only ones with
  gradients and optimizer state. `base_quantization`: (format, group size), QLoRA's frozen base
  (train.base_quantization): its projections held as quantized values and float32 scales
  (`quantized_parts`).
  """
  mesh = mesh_for(strategy, devices, tensor, stage, expert)
  zero = _ZERO[strategy]
  base = inventory(cfg)
  adapters = [] if lora is None else lora_adapters(cfg, *lora)
  trained = base if lora is None else adapters
  held = []  # (array, bytes per element, the parameter it holds): a quantized weight's parts
  for p in base + adapters:
    parts = None if base_quantization is None else quantized_parts(p, *base_quantization)
    held += [(p, float(master_bytes), p)] if parts is None else [(a, b, p) for a, b in parts]

  def per_device(
    specs: list[tuple], sharded: bool, *, trainable_only: bool = True, only=lambda p: True
  ) -> int:
    """Bytes of (array, bytes per element, the parameter it holds) on one device: each array's
    shard rounded up to whole bytes."""
    ways = dict(fsdp=mesh["fsdp"] if sharded else 1, tensor=mesh["tensor"], stage=mesh["stage"])
    return sum(
      math.ceil(b * shard_elements(a, **ways, expert=mesh["expert"]))
      for a, b, p in specs
      if (p.trainable or not trainable_only) and only(p)
    )

  as_held = lambda specs: [(p, float(master_bytes), p) for p in specs]
  return StateBytes(
    strategy=strategy,
    mesh=mesh,
    params=per_device(held, zero >= 3, trainable_only=False),
    grads=per_device(as_held(trained), zero >= 2),
    opt_state=2 * per_device(as_held(trained), zero >= 1) + _ADAM_COUNTERS,
    experts=per_device(held, zero >= 3, only=lambda p: p.is_routed_expert),
  )


# QLoRA's quantized values: bits each (int4 two to a byte, as XLA holds it on GPU and TPU; its
# CPU backend keeps one int4 a byte).
QUANT_BITS = {"int8": 8, "int4": 4, "fp8": 8}


def quantized_parts(spec: ParamSpec, fmt: str, group_size: int) -> list | None:
  """How a QLoRA run holds a base weight (`atlas_jax.quant.quantize_model`'s projections): its
  values [(the weight's shape), bits / 8 bytes each] and float32 scales (their shape as qwix
  makes them, found by `jax.eval_shape`: one per output channel and stacked slice, and for int4
  per group of `group_size` inputs), split by the weight's logical axes where they divide; None
  for a weight kept in float32 (embeddings, norms, the LM head, adapters)."""
  if spec.path.rsplit("/", 1)[-1] not in quant.PROJECTIONS or "_lora/" in spec.path:
    return None
  if fmt not in QUANT_BITS:
    raise ValueError(f"--base-quantization={fmt!r} is not one of {tuple(QUANT_BITS)}")
  float_weight = jax.ShapeDtypeStruct(spec.shape, jnp.float32)
  q = jax.eval_shape(
    lambda w: quant.quantize_weight(
      w, spec.axes, fmt, group_size=group_size, name=spec.path, field="--base-quantization"
    ),
    float_weight,
  )
  scales = ParamSpec(f"{spec.path}/scale", tuple(q.scale.shape), spec.axes, trainable=False)
  return [(spec, QUANT_BITS[fmt] / 8), (scales, 4.0)]


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


def _layer_fixed(
  specs: list[ParamSpec],
  c: int,
  master_bytes: int,
  tp: int,
  base_quantization: tuple[str, int] | None = None,
) -> float:
  """Bytes one block saves whatever the token count: the compute-dtype copies of its weights.

  With bf16/fp16 compute every weight is cast at use and the cast kept; in float32 only the
  RMSNorm scales' broadcasts are new arrays. A QLoRA base's quantized projection
  (`base_quantization`) keeps only its scales' cast: its product's backward pass dequantizes the
  held values afresh (`atlas_jax.quant.quantized_product`).
  """
  cast = c != master_bytes
  total = 0.0
  for p in specs:
    if cast or p.is_norm:
      parts = None if base_quantization is None else quantized_parts(p, *base_quantization)
      held = p if parts is None else parts[1][0]  # a quantized weight: its scales
      dims = [_split(n, tp) if a in TENSOR_AXES else n for n, a in zip(held.shape, held.axes)]
      total += c * math.prod(dims)
  return total


def _rope_dim(cfg: ModelConfig) -> int:
  return cfg.head_dim if cfg.mla is None else cfg.mla.qk_rope_head_dim


def _loss_tokens(V: float, chunked: bool) -> float:
  """Per-token bytes one cross-entropy keeps: the float32 logits and the loss's scalars, or,
  chunked, the target, the mask and log Z (`atlas_jax.training.loss.chunked_cross_entropy`)."""
  return 12 if chunked else 4 * V + 17


def _head_tokens(cfg: ModelConfig, c: int, tp: int, chunked: bool) -> float:
  """Per-token bytes after the blocks: the final norm, the logits and the loss."""
  D, V = cfg.d_model, _split(cfg.vocab_size, tp)
  return (8 * D + 2 * D * c + 8) + _loss_tokens(V, chunked)


def _scan_input_tokens(
  cfg: ModelConfig, c: int, S: int, attention: str, policy: str, tp: int
) -> tuple[float, float]:
  """Per-token bytes the blocks read from outside them, kept once per layer scan: (what the
  rows' positions make: the positions themselves under remat, from which the recomputed blocks
  rebuild RoPE and masks, else the RoPE tables; what only the shapes make: the mask)."""
  if policy != "none":
    return 4, 0
  N = _split(cfg.n_heads, tp)
  # cos and sin for q and k; xla: the causal mask and scores
  return 2 * _rope_dim(cfg) * c, (5 * N * S + 4 if attention == "xla" else 8)


def _global_tokens(
  cfg: ModelConfig, c: int, S: int, attention: str, policy: str, tp: int, chunked: bool = False
) -> float:
  """Per-token bytes outside the blocks: embedding indices, final norm, logits, loss."""
  head = _head_tokens(cfg, c, tp, chunked)
  return 4 + head + sum(_scan_input_tokens(cfg, c, S, attention, policy, tp))


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
    shared = 8 * D + D * c + 8  # the trunk's hidden state, once for all
  return cfg.mtp.n_predict * head + shared + _mtp_position_tokens(cfg, c, S, attention, tp)


def _mtp_position_tokens(cfg: ModelConfig, c: int, S: int, attention: str, tp: int) -> float:
  """Per-token bytes the MTP heads build from the positions alone: their causal mask, and the
  parallel heads' shared RoPE tables."""
  if cfg.mtp is None:
    return 0.0
  out = 5 * _split(cfg.n_heads, tp) * S + 4 if attention == "xla" else 8
  return out + (2 * _rope_dim(cfg) * c if cfg.mtp.kind == "parallel" else 0)


def _selective_tokens(cfg: ModelConfig, tp: int, sparse: bool = False) -> float:
  """Elements per token and block the selective policy keeps: the named matmul outputs."""
  kept = cfg.d_model + _ffn_kept(cfg, tp, sparse)  # o_proj; the feed-forward's matmuls
  if cfg.mla is None:
    return kept + 2 * cfg.head_dim * (_split(cfg.n_heads, tp) + _split(cfg.n_kv_heads, tp))
  m, N = cfg.mla, _split(cfg.n_heads, tp)
  # q, the latent and rope key, K's and V's up-projections, the attention output
  kept += N * m.qk_head_dim + m.kv_lora_rank + m.qk_rope_head_dim
  return kept + N * (m.qk_nope_head_dim + 2 * m.v_head_dim) + (m.q_lora_rank or 0)


def _blocks(
  cfg: ModelConfig,
  policy: str,
  layers: int,
  M: int,
  per_layer: float,
  c: int,
  tp: int,
  k: int,
  sparse: bool = False,
) -> tuple[float, float]:
  """(saved, recomputed at a time) of `layers` block applications on M tokens; `per_layer`:
  one block's residuals without remat (what `full` recomputes); k: every_k's group; `sparse`:
  MoE blocks."""
  D = cfg.d_model
  if policy == "none":
    return layers * per_layer, 0.0
  if policy == "full":
    return layers * D * c * M, per_layer
  if policy == "every_k":
    return (layers // k) * D * c * M, k * per_layer
  kept = _selective_tokens(cfg, tp, sparse) * c * M
  return layers * kept, max(per_layer - kept, 0.0)


def _after_blocks(
  cfg: ModelConfig,
  c: int,
  S: int,
  attention: str,
  tp: int,
  chunked: bool,
  M: int,
  master: int,
  base_quantization: tuple[str, int] | None = None,
) -> float:
  """Bytes kept after the layer stack for M tokens: final norm, head and loss, MTP heads."""
  D, V = cfg.d_model, _split(cfg.vocab_size, tp)
  out = _head_tokens(cfg, c, tp, chunked) * M + D * c  # + the final norm's scale, broadcast
  if not chunked and (c != master or cfg.tie_embeddings):
    out += c * D * V  # the head's compute-dtype copy, or transpose
  if cfg.mtp is not None:
    out += _mtp_tokens(cfg, c, S, attention, tp, chunked) * M
    out += cfg.mtp.n_predict * _layer_fixed(mtp_head(cfg), c, master, tp, base_quantization)
    if c != master and not chunked:
      out += c * D * V  # the head is cast again for the MTP logits
  return out


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
  schedule: Schedule | None = None,
  base_quantization: tuple[str, int] | None = None,
) -> ActivationBytes:
  """Activation bytes of a `batch` x `seq_len` micro-batch on one device.

  Args:
    policy: one of REMAT_POLICIES.
    compute_bytes: 4 (fp32) or 2 (bf16 / fp16 compute).
    attention: "flash" (the Pallas kernel, the default on GPU and TPU) or "xla" (the reference,
      which saves the [N, T, S] scores and probabilities; the CPU's default, causal
      self-attention in query blocks with a written-out backward, keeps only the probabilities
      it computed and a head-major copy of q, k and v: measured 3% to 27% under this figure on
      the test models at T = 24 and 40, so the figure is an upper bound for it).
    remat_every: k for every_k (must divide n_layers); default the divisor nearest sqrt(L).
    tensor: tensor-parallel ways (head, FFN and vocab sized tensors split; estimate only).
    loss_chunk: train.loss_chunk; > 0, the chunked cross-entropy keeps no logits and no
      compute-dtype copy of the head (it casts the head inside, once per pass).
    schedule: pipeline stages (`atlas_jax.training.pipeline.Schedule`, more than one stage):
      one stage's bytes, `batch` then being a data-parallel shard's rows of an accumulation
      step (`_pipelined`).
    base_quantization: (format, group size) of a QLoRA base: its projections keep no
      compute-dtype copies, only their scales' (not applied to a pipelined step's figure, which
      counts the float copies: an upper bound there).
  """
  if policy not in REMAT_POLICIES:
    raise ValueError(f"--remat={policy!r} is not allowed; allowed: {', '.join(REMAT_POLICIES)}")
  if attention not in ATTENTION_IMPLS:
    raise ValueError(f"--attention={attention!r} is not allowed; allowed: {ATTENTION_IMPLS}")
  _check_int("batch", batch)
  _check_int("seq_len", seq_len)
  args = (cfg, policy, batch, seq_len, compute_bytes, attention, remat_every, tensor)
  if schedule is not None and schedule.stages > 1:
    return _pipelined(*args, master_bytes, loss_chunk, schedule)
  c, M, tp = compute_bytes, batch * seq_len, tensor
  S = seq_len
  chunked = loss_chunk > 0
  glob = (4 + sum(_scan_input_tokens(cfg, c, S, attention, policy, tp))) * M
  quantized = base_quantization
  glob += _after_blocks(cfg, c, S, attention, tp, chunked, M, master_bytes, quantized)
  saved, recompute, per_layer = _runs(
    cfg, cfg.layer_runs(), policy, M, c, S, attention, tp, master_bytes, remat_every, quantized
  )
  return ActivationBytes(
    policy=policy,
    saved=int(round(saved + glob)),
    recompute=int(round(recompute)),
    per_layer_none=int(round(per_layer)),
    outside_blocks=int(round(glob)),
  )


def _per_layer(
  cfg: ModelConfig,
  sparse: bool,
  M: int,
  c: int,
  S: int,
  attention: str,
  tp: int,
  master: int,
  base_quantization: tuple[str, int] | None = None,
) -> float:
  """One block's residuals on M tokens without remat (dense or MoE)."""
  per_token = _layer_tokens(cfg, c, S, attention, tp, sparse) * M
  return per_token + _layer_fixed(block(cfg, sparse), c, master, tp, base_quantization)


def _runs(cfg, runs, policy, M, c, S, attention, tp, master, remat_every, quantized=None):
  """(saved, recomputed at a time, the largest block's residuals) of runs of identical layers
  ((sparse, layers), ...), each its own layer scan (`atlas_jax.model.transformer`) on M
  tokens."""
  saved, recompute, largest = 0.0, 0.0, 0.0
  for sparse, n in runs:
    per_layer = _per_layer(cfg, sparse, M, c, S, attention, tp, master, quantized)
    k = default_every(n) if remat_every is None else remat_every
    if policy == "every_k" and n % k:
      where = f"the model's n_layers={n}" if n == cfg.n_layers else f"each run of {n} layers"
      raise ValueError(f"--remat-every={k} must divide {where}")
    s, r = _blocks(cfg, policy, n, M, per_layer, c, tp, k, sparse)
    saved, recompute, largest = saved + s, max(recompute, r), max(largest, per_layer)
  return saved, recompute, largest


def _pipelined(
  cfg: ModelConfig,
  policy: str,
  batch: int,
  seq_len: int,
  c: int,
  attention: str,
  remat_every: int | None,
  tp: int,
  master_bytes: int,
  loss_chunk: int,
  schedule: Schedule,
) -> ActivationBytes:
  """One stage's activation bytes of a pipelined step (`atlas_jax.training.pipeline`) whose
  data-parallel shard of an accumulation micro-batch is `batch` rows.

  Each of the I = U r + p - 1 iterations runs L / (p r) blocks on one micro-batch of
  batch / U rows and keeps their residuals (bubble iterations too, on idle data): GPipe keeps
  every micro-batch's stage inputs, and what the remat policy saves inside the stage, until the
  backward pass; with the micro-batch's positions (or, without remat, its RoPE tables and mask).
  Without remat the circular schedule also keeps each iteration's slice of the weights. Every
  stage embeds its shard's rows (their token ids are kept); the final norm, head, loss and MTP
  heads run on batch / p rows (stages split the batch there). An MoE model's stages split its
  MoE layers; its dense layers, first, run before the pipeline on batch / p rows (an estimate:
  the gather of their output over the stages is left out).
  """
  p, U, r = schedule.stages, schedule.microbatches, schedule.repeats
  try:
    L = pipelined_layers(cfg, stages=p)
  except ValueError as e:
    raise ValueError(f"--pipeline={p}: {e}") from None
  sparse = any(cfg.sparse_layers())  # the pipelined stack is the MoE layers'
  if L % (p * r) or batch % U or batch % p:
    what = "n_layers" if L == cfg.n_layers else "the MoE layers"
    raise ValueError(
      f"{what}={L} must divide by --pipeline x --repeats = {p} x {r}, and the {batch} rows "
      f"of a data-parallel shard by --microbatches={U} and by --pipeline={p}"
    )
  T = seq_len
  iterations, per_stage = schedule.iterations, L // (p * r)
  Mb = batch // U * T  # tokens of one micro-batch
  k = default_every(per_stage) if remat_every is None else remat_every
  if policy == "every_k" and per_stage % k:
    raise ValueError(f"--remat-every={k} must divide the {per_stage} layers a stage runs at a time")
  specs = block(cfg, sparse)
  per_layer = _layer_tokens(cfg, c, T, attention, tp, sparse) * Mb
  blocks, recompute = _blocks(cfg, policy, per_stage, Mb, per_layer, c, tp, k, sparse)
  saved = iterations * blocks
  if policy == "none":
    # The norm scales' broadcasts, once per layer of the stage; the weights' compute-dtype casts:
    # GPipe once per layer (loop-invariant; none in float32), circular each iteration's slice.
    tp_size = lambda sp: math.prod(
      _split(n, tp) if axis in TENSOR_AXES else n for n, axis in zip(sp.shape, sp.axes)
    )
    saved += (L // p) * sum(c * tp_size(sp) for sp in specs if sp.is_norm)
    if r > 1:
      saved += iterations * per_stage * c * sum(tp_size(sp) for sp in specs)
    elif c != master_bytes:
      saved += (L // p) * c * sum(tp_size(sp) for sp in specs if not sp.is_norm)
  rope, mask = _scan_input_tokens(cfg, c, T, attention, policy, tp)
  outside = (iterations * rope + mask) * Mb  # the rows' inputs per iteration; the mask once
  # The token ids; what the MTP heads build from the positions alone (XLA builds it on every
  # stage, for all of the shard's rows).
  outside += (4 + (1 - 1 / p) * _mtp_position_tokens(cfg, c, T, attention, tp)) * batch * T
  outside += _after_blocks(cfg, c, T, attention, tp, loss_chunk > 0, batch // p * T, master_bytes)
  if L != cfg.n_layers:  # the dense layers before the pipeline
    dense = [(False, cfg.n_layers - L)]
    d_saved, d_recompute, _ = _runs(
      cfg, dense, policy, batch // p * T, c, T, attention, tp, master_bytes, remat_every
    )
    outside, recompute = outside + d_saved, max(recompute, d_recompute)
  return ActivationBytes(
    policy=policy,
    saved=int(round(saved + outside)),
    recompute=int(round(recompute)),
    per_layer_none=int(round(per_layer)),
    outside_blocks=int(round(outside)),
  )


# ------------------------------------------------------------------------------------------------
# Serving on a (data, tensor) mesh: every replica holds the weights and its own pool pages


def served_config(cfg: ModelConfig, tensor: int) -> ModelConfig:
  """The config as served over `tensor` devices: a GQA model's kv heads repeated up to the tensor
  size when fewer (`atlas_jax.serving.mesh.repeat_kv_heads`)."""
  if cfg.mla is None and cfg.n_kv_heads < tensor:
    return dataclasses.replace(cfg, n_kv_heads=tensor)
  return cfg


@dataclasses.dataclass(frozen=True)
class FP8Folder:
  """A Hugging Face FP8 folder's scales (config.json's `quantization_config.weight_block_size`):
  one per [out, in] block of a stored projection, or None: one per tensor."""

  block: tuple[int, int] | None


def fp8_kept_parts(spec: ParamSpec, fp8: FP8Folder) -> list | None:
  """How serve.py holds a projection of an FP8 folder with `--fp8-weights keep`
  (`atlas_jax.hf.fp8.kept_weight`): its e4m3 codes [(the weight's shape), a byte each] and its
  float32 scales, one per tile of the blocks in the model's layout (`fp8.kept_scales`); None for
  a weight held in the serving dtype (not a projection, or one whose blocks tile no grid).

  The stored [out, in] weight is taken to be the model's output axes by its contracted ones, each
  row-major in the model's order, as the families' mappings lay out every projection but those
  cut from a fused tensor (MLA's kv_b_proj into W_UK and W_UV, fused gate_up experts: counted as
  if stored apart, the same when the cut falls on a block's edge). The folder's FP8 tensors are
  taken to be its projections (every linear layer but the LM head, as DeepSeek-V3's and
  transformers' quantizer write them)."""
  from atlas_jax.hf import fp8 as hf_fp8
  from atlas_jax.quant.weights import STACK_AXES

  if spec.path.rsplit("/", 1)[-1] not in quant.PROJECTIONS or "_lora/" in spec.path:
    return None
  # The planner's "dense_layers" (an MoE model's dense layers) is the model's "layers" stack.
  axes = tuple("layers" if a == "dense_layers" else a for a in spec.axes)
  contracted = quant.contracted_axes(axes)
  stacked = [i for i, a in enumerate(axes) if a in STACK_AXES]
  outputs = [i for i in range(len(spec.shape)) if i not in contracted and i not in stacked]
  n = hf_fp8.kept_scales(
    [spec.shape[i] for i in outputs], [spec.shape[i] for i in contracted], fp8.block
  )
  if n is None:
    return None
  shape = (*(spec.shape[i] for i in stacked), n)
  axes = (*(spec.axes[i] for i in stacked), None)
  scales = ParamSpec(f"{spec.path}/scale", shape, axes, trainable=False)
  return [(spec, 1.0), (scales, 4.0)]


def serving_weight_bytes(
  cfg: ModelConfig,
  *,
  tensor: int,
  dtype_bytes: int,
  attention_only: bool = False,
  fp8: FP8Folder | None = None,
) -> int:
  """Weight bytes each device holds when served over `tensor` devices (the serving rules split
  heads, the FFN and the vocabulary as training's tensor rules do); `attention_only`: the
  attention layers' alone (the trunk's, MTP heads' excluded). `fp8`: an FP8 folder served with
  its projections kept (`fp8_kept_parts`; their scales counted whole on every device), the
  other weights in the serving dtype."""
  specs = inventory(served_config(cfg, tensor))
  if attention_only:
    specs = [p for p in specs if p.path.startswith("blocks/attn/")]
  total = 0
  for p in specs:
    parts = None if fp8 is None else fp8_kept_parts(p, fp8)
    if parts is None:
      total += dtype_bytes * shard_elements(p, fsdp=1, tensor=tensor)
    else:
      (codes, _), (scales, scale_bytes) = parts
      total += math.ceil(shard_elements(codes, fsdp=1, tensor=tensor))
      total += int(scale_bytes) * scales.size
  return total


def serving_kv_bytes_per_token(
  cfg: ModelConfig, *, tensor: int, dtype_bytes: int, kv_cache_dtype: str = "auto"
) -> int:
  """Pool bytes one token takes on each device of its replica: a KV pool's kv heads split over
  the tensor axis (repeated up to it when fewer); an MLA latent held whole by every device.
  `kv_cache_dtype` "int8" / "fp8": a byte a value and a float32 scale per vector."""
  L = cfg.n_layers
  if cfg.mla is not None:
    m = cfg.mla
    return L * cached_vector_bytes(m.kv_lora_rank + m.qk_rope_head_dim, dtype_bytes, kv_cache_dtype)
  K = served_config(cfg, tensor).n_kv_heads
  vector = cached_vector_bytes(cfg.head_dim, dtype_bytes, kv_cache_dtype)
  return 2 * L * (K // tensor if K % tensor == 0 else K) * vector
