"""The PyTorch peer of our train step: the same Llama-style architecture, trained the PyTorch way.

Pre-norm blocks of GQA attention (`scaled_dot_product_attention`, RoPE) and a SwiGLU MLP,
RMSNorm, a tied or untied head as the config says; q, k and v in one GEMM and the gate and up
projections in another, as tuned PyTorch Llamas do. The step is fused AdamW with the config's
hyperparameters and gradient clipping, optionally under bf16 autocast and `torch.compile`; on
CUDA attention runs on SDPA's flash backend. `bench/train.py` (float32, eager, CPU) and
`bench/gpu_training.py` (bf16, compiled, GPU) time it beside `bench/train_step.py`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from timing import seconds_for
from torch import nn

from atlas_jax.config import Config, ModelConfig, TrainConfig
from atlas_jax.hf import llama
from atlas_jax.hf.weights import tensors_from_params
from atlas_jax.model.transformer import Transformer


def rope(x, cos, sin):
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_stand_in(q, k, v):
  """q + k + v, the kv heads repeated: what `bench/train.py --without attention` runs in place of
  attention, so the projections, RoPE and the gradients into q, k and v stay and the attention's
  own work goes."""
  G = q.shape[1] // k.shape[1]
  return q + k.repeat_interleave(G, dim=1) + v.repeat_interleave(G, dim=1)


class Norm(nn.RMSNorm):
  """RMSNorm, or with `normalise=False` only its scale (`--without norm`)."""

  def __init__(self, dim: int, eps: float, normalise: bool):
    super().__init__(dim, eps=eps)
    self.normalise = normalise

  def forward(self, x):
    return super().forward(x) if self.normalise else self.weight * x


class Block(nn.Module):
  """`without`: the pieces (`train_step.PIECES`) run as the stand-ins `train_step.without`
  puts in our step."""

  def __init__(self, c: ModelConfig, without: frozenset[str] = frozenset()):
    super().__init__()
    D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    self.N, self.K, self.H = N, K, H
    self.without = without
    self.attn_norm = Norm(D, c.norm_eps, "norm" not in without)
    self.mlp_norm = Norm(D, c.norm_eps, "norm" not in without)
    self.wqkv = nn.Linear(D, (N + 2 * K) * H, bias=False)  # one GEMM for q, k and v
    self.wo = nn.Linear(N * H, D, bias=False)
    self.w_gate_up = nn.Linear(D, 2 * c.ffn_dim, bias=False)
    self.w_down = nn.Linear(c.ffn_dim, D, bias=False)

  def forward(self, x, cos, sin):
    B, T, _ = x.shape
    N, K, H = self.N, self.K, self.H
    q, k, v = self.wqkv(self.attn_norm(x)).split([N * H, K * H, K * H], dim=-1)
    q, k = q.view(B, T, N, H).transpose(1, 2), k.view(B, T, K, H).transpose(1, 2)
    if "rope" not in self.without:
      q, k = rope(q, cos, sin), rope(k, cos, sin)
    v = v.view(B, T, K, H).transpose(1, 2)
    if "attention" in self.without:
      o = attention_stand_in(q, k, v)
    else:
      o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=K != N)
    x = x + self.wo(o.transpose(1, 2).reshape(B, T, N * H))
    gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
    gate = gate if "activation" in self.without else F.silu(gate)
    return x + self.w_down(gate * up)


class Llama(nn.Module):
  """forward(tokens [B, T], targets [B, T]) -> the mean next-token cross-entropy.

  `without`: pieces (`train_step.PIECES`) replaced by the stand-ins our step runs for them
  under `train_step.without`."""

  def __init__(self, c: ModelConfig, without: frozenset[str] = frozenset()):
    super().__init__()
    self.without = without
    self.embed = nn.Embedding(c.vocab_size, c.d_model)
    self.blocks = nn.ModuleList([Block(c, without) for _ in range(c.n_layers)])
    self.norm = Norm(c.d_model, c.norm_eps, "norm" not in without)
    self.head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
    H = c.head_dim
    # Plain RoPE frequencies: Llama-3 scaling changes the numbers, not the work.
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, H, 2, dtype=torch.float32) / H))
    self.register_buffer("inv_freq", inv, persistent=False)

  def forward(self, tokens, targets):
    T = tokens.shape[1]
    ang = torch.arange(T, device=tokens.device, dtype=torch.float32)[:, None] * self.inv_freq
    cos, sin = ang.cos(), ang.sin()
    if "embedding" in self.without:  # row 0 at every position
      x = self.embed.weight[0].expand(*tokens.shape, -1)
    else:
      x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, cos, sin)
    x = self.norm(x)
    logits = x @ self.embed.weight.T if self.head is None else self.head(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

  @torch.no_grad()
  def load_params(self, model: Transformer) -> Llama:
    """Our model's weights copied in, named as `atlas_jax.hf` exports them for transformers
    (whose layout is PyTorch's), so both stacks compute the same function: the tests compare
    losses."""
    t = tensors_from_params(model, llama.spec(model.cfg))
    copy = lambda dst, *names: dst.copy_(torch.from_numpy(np.concatenate([t[n] for n in names])))
    copy(self.embed.weight, "model.embed_tokens.weight")
    copy(self.norm.weight, "model.norm.weight")
    if self.head is not None:
      copy(self.head.weight, "lm_head.weight")
    for i, block in enumerate(self.blocks):
      at = f"model.layers.{i}."
      copy(block.wqkv.weight, *(f"{at}self_attn.{w}_proj.weight" for w in "qkv"))
      copy(block.wo.weight, f"{at}self_attn.o_proj.weight")
      copy(block.w_gate_up.weight, f"{at}mlp.gate_proj.weight", f"{at}mlp.up_proj.weight")
      copy(block.w_down.weight, f"{at}mlp.down_proj.weight")
      copy(block.attn_norm.weight, f"{at}input_layernorm.weight")
      copy(block.mlp_norm.weight, f"{at}post_attention_layernorm.weight")
    return self


def train_step(model: Llama, t: TrainConfig, *, device: str, bf16: bool, compile_backend):
  """step(tokens i32[B, T + 1] as numpy) -> loss: one AdamW update of `model`, in place.

  `compile_backend`: None (eager) or `torch.compile`'s backend ("inductor"; "eager" traces
  without generating code)."""
  opt = torch.optim.AdamW(
    model.parameters(),
    lr=t.learning_rate,
    betas=(t.b1, t.b2),
    weight_decay=t.weight_decay,
    fused=True,
  )
  forward = model if compile_backend is None else torch.compile(model, backend=compile_backend)
  if device == "cuda":
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
  else:
    attention = contextlib.nullcontext()
  precision = torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

  def step(batch: np.ndarray):
    tokens = torch.from_numpy(batch).to(device, non_blocking=True).long()
    with attention, precision:
      loss = forward(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  return step


def run(cfg: Config, batches, warmup: int, *, device: str, bf16: bool, compile_backend) -> dict:
  """Trains a fresh peer on `batches` (the first `warmup` untimed): its seconds, last loss and,
  on CUDA, peak memory over the timed steps."""
  torch.manual_seed(0)
  model = Llama(cfg.model).to(device)
  step = train_step(model, cfg.train, device=device, bf16=bf16, compile_backend=compile_backend)
  cuda = device == "cuda"
  wait = (lambda _: torch.cuda.synchronize()) if cuda else (lambda _: None)
  warmup_s, _ = seconds_for(step, batches[:warmup], wait=wait)
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  seconds, loss = seconds_for(step, batches[warmup:], wait=wait)
  return {
    "seconds": seconds,
    "warmup_s": warmup_s,
    "loss": float(loss.detach()),
    "peak_memory": torch.cuda.max_memory_allocated() if cuda else None,
  }
