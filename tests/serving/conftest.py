"""Tiny models shared by the serving tests (random weights: logits far from ties).

`tiny_model` is Llama-style (GQA); `mla_model` is DeepSeek-style MLA with and without the query
bottleneck (q_lora), so every engine test can run on both cache kinds. `byte_model` and
`serving` are what the HTTP tests build their servers from.
"""

import contextlib
import socket
import threading
import time

import pytest
import uvicorn
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig, MoEConfig
from atlas_jax.data.tokenizer import ByteTokenizer
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig
from atlas_jax.serving.server import EngineRunner, build_app

TINY = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128)
# Experts for tiny MoE models: Mixtral-like (GQA; softmax top-2) and DeepSeek-V3-like (MLA;
# sigmoid scores, noaux_tc group-limited top-k, a shared expert, a dense first layer).
MOE = {
  "gqa": MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24),
  "mla": MoEConfig(
    n_experts=8,
    top_k=2,
    expert_ffn_dim=24,
    scoring="sigmoid",
    topk_method="noaux_tc",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    shared_ffn_dim=24,
    first_k_dense=1,
  ),
}


@pytest.fixture(scope="package")
def tiny_model():
  cfg = ModelConfig(**TINY, n_kv_heads=2, init_std=0.3)
  return build(cfg, rngs=nnx.Rngs(0))


def mla_config(q_lora_rank: int | None) -> ModelConfig:
  mla = MLAConfig(
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=q_lora_rank
  )
  return ModelConfig(**TINY, n_kv_heads=4, mla=mla, init_std=0.3)


@pytest.fixture(scope="package", params=[None, 12], ids=["mla", "mla_qlora"])
def mla_model(request):
  return build(mla_config(request.param), rngs=nnx.Rngs(1))


@pytest.fixture(scope="package", params=["gqa", "mla"])
def any_model(request, tiny_model):
  """Both cache kinds: the GQA model (KV pool) and the MLA model with q_lora (latent pool)."""
  if request.param == "gqa":
    return tiny_model
  return build(mla_config(12), rngs=nnx.Rngs(1))


def byte_model(seed: int):
  """(model, tokenizer): a tiny GQA model over the byte tokenizer's vocabulary."""
  tok = ByteTokenizer()
  cfg = ModelConfig(**{**TINY, "vocab_size": tok.vocab_size}, n_kv_heads=2, init_std=0.3)
  return build(cfg, rngs=nnx.Rngs(seed)), tok


@contextlib.contextmanager
def serving(model, tok, config: EngineConfig, log_level="warning", **app_kw):
  """An engine over `model` behind the HTTP app on a free loopback port, served from a thread:
  yields (base url, engine, runner); stops the server and the runner on exit."""
  engine = Engine(model, config, eos_id=tok.eos_id, detokenize=tok.decode)
  runner = EngineRunner(engine)
  with serving_app(build_app(runner, tokenizer=tok, **app_kw), runner, log_level) as url:
    yield url, engine, runner


@contextlib.contextmanager
def serving_app(app, runner, log_level="warning"):
  """`app` on a free loopback port, served from a thread: yields its base url; stops the server
  and `runner` on exit."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  try:
    while not srv.started:
      time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
  finally:
    srv.should_exit = True
    thread.join(timeout=10)
    runner.shutdown()
