"""The Llama-3.2-1B-shaped preset: loads, validates, has the real model's shapes, and fits one
H200 by the planner (shapes only, through jax.eval_shape; nothing is allocated)."""

from pathlib import Path

from atlas_jax import measure
from atlas_jax.config import load_config
from atlas_jax.data.tokenizer import bpe_size
from atlas_jax.devices import get_device
from atlas_jax.plan.cli import build_plan, parser

PRESET = Path(__file__).parent.parent.parent / "configs" / "llama3-1b.yaml"


def test_preset_loads_with_llama_3_2_1b_shapes():
  cfg = load_config(PRESET)
  m = cfg.model
  assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim) == (
    16,
    2048,
    32,
    8,
    64,
    8192,
  )
  assert (m.vocab_size, m.tie_embeddings, m.rope_theta) == (128256, True, 500000.0)
  assert m.rope_scaling.type == "llama3" and m.rope_scaling.factor == 32.0
  assert cfg.train.seq_len == 2048 and cfg.train.loss_chunk > 0
  assert bpe_size(cfg.data.tokenizer) <= m.vocab_size
  # Llama-3.2-1B's published parameter count, from the abstract model.
  assert measure.param_counts(m)["total"] == 1_235_814_400


def test_planner_fits_the_preset_on_one_h200():
  plan = build_plan(parser().parse_args(["--config", str(PRESET), "--devices", "1", "--json"]))
  chosen = next(s for s in plan["training"]["strategies"] if s["strategy"] == "zero1")
  assert chosen["micro_batch"] == load_config(PRESET).train.batch_size
  assert chosen["total"] <= get_device("H200").hbm_bytes, chosen["total"]
  # The chunked loss is what the plan used: without it the logits alone add 4V bytes per token.
  plain = build_plan(
    parser().parse_args(["--config", str(PRESET), "--devices", "1", "--loss-chunk", "0"])
  )
  plain_total = next(s for s in plain["training"]["strategies"] if s["strategy"] == "zero1")
  tokens = 32 * 2048
  assert plain_total["total"] - chosen["total"] >= 4 * 128256 * tokens
