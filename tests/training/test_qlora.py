"""QLoRA (train.base_quantization): adapters train over a frozen base held quantized on the
device; the quantized model's logits are the dequantized model's; a run resumes exactly and
exports its adapters merged into the dequantized base."""

import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import quant
from atlas_jax.config import ConfigError
from atlas_jax.training import checkpoint
from atlas_jax.training.step import make_train_step, make_trainer, split_trainable

from .common import batches, tiny_config

ROOT = Path(__file__).parents[2]
QTYPES = {"int8": jnp.int8, "int4": jnp.int4}


def qlora_config(fmt: str, *more: str):
  return tiny_config(
    "train.lora={rank: 4}",
    f"train.base_quantization={fmt}",
    "train.base_quantization_group_size=16",  # int4: d_model 32 and ffn_dim 64 cut in groups
    *more,
  )


def quantized_leaves(tree) -> list:
  leaves = jax.tree.leaves(tree, is_leaf=quant.is_quantized)
  return [x for x in leaves if quant.is_quantized(x)]


# int8 under -m slow: the same step over the simpler per-channel format.
@pytest.mark.parametrize("fmt", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_qlora_trains_the_adapters_over_a_frozen_quantized_base(fmt):
  """Every block projection is stored quantized (values in the format's dtype, float32 scales),
  the optimizer holds moments of the adapters alone, the loss falls over a few steps on one
  batch, and the base (values and scales) is bitwise unchanged."""
  cfg = qlora_config(fmt)
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0))
  adapters0, base0 = split_trainable(cfg, state.params)
  stored = quantized_leaves(base0)
  assert len(stored) == 7  # wq, wk, wv, wo, w_gate, w_up, w_down (each a stack over layers)
  for q in stored:
    assert q.qvalue.dtype == QTYPES[fmt] and q.scale.dtype == jnp.float32
  assert not quantized_leaves(adapters0)
  assert {x.dtype for x in jax.tree.leaves(adapters0)} == {jnp.dtype(jnp.float32)}
  n_adapters = sum(x.size for x in jax.tree.leaves(adapters0))
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert sum(x.size for x in moments) == 2 * n_adapters
  base0 = jax.tree.map(np.asarray, base0)
  step = make_train_step(trainer)
  batch = batches(1)[0]
  losses = []
  for _ in range(6):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.1, losses
  _, base = split_trainable(cfg, state.params)
  assert len(quantized_leaves(base)) == 7
  for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(base), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, np.asarray(b))


def test_qlora_logits_at_step_0_are_the_dequantized_models():
  """int4, per channel and group (int8's per-channel product is the simpler case of it)."""
  cfg = qlora_config("int4")
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0))
  tokens = jnp.asarray(batches(1, batch=2)[0]["tokens"][:, :16])
  got = nnx.merge(trainer.graphdef, state.params).forward_train(tokens).main
  reference = nnx.merge(trainer.graphdef, state.params)
  assert len(quant.dequantize_model(reference)) == 7
  want = reference.forward_train(tokens).main
  # Dequantization is exact; the two differ only in where the scale multiplies (after the
  # product per channel, or into the weight first).
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # ... and the quantized base is not the float one it came from: the test would not see it.
  plain = make_trainer(tiny_config("train.lora={rank: 4}"))
  float_logits = nnx.merge(plain.graphdef, plain.init(jax.random.key(0)).params)
  assert np.abs(np.asarray(float_logits.forward_train(tokens).main) - np.asarray(got)).max() > 1e-4


def test_base_quantization_needs_lora():
  with pytest.raises(ConfigError, match=r"train.base_quantization='int8'.*needs train.lora"):
    tiny_config("train.base_quantization=int8")
  with pytest.raises(ConfigError, match=r"train.base_quantization='nf4'.*int8"):
    tiny_config("train.lora={rank: 4}", "train.base_quantization=nf4")


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
  """train.py fine-tuning a tiny Llama folder with int4 QLoRA: 4 steps, a checkpoint at 2."""
  torch = pytest.importorskip("torch")
  del torch
  from ..test_hf import build_hf

  sys.path.insert(0, str(ROOT))
  import train
  from atlas_jax.data import synthetic

  root = tmp_path_factory.mktemp("qlora")
  build_hf("Llama", root / "base", std=0.02, vocab_size=259, hidden_size=64, intermediate_size=128)
  data = root / "reverse.jsonl"
  synthetic.write(data, synthetic.reverse_examples(64, words=tuple("abcdefghij")), "completion")
  sets = [
    f"train.init_from={root / 'base'}",
    f"data.source={data}",
    "data.eval_fraction=0.1",
    "train.lora={rank: 4, alpha: 8, targets: [attn, mlp]}",
    "train.base_quantization=int4",
    "train.base_quantization_group_size=32",
    "train.steps=4",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.learning_rate=3e-2",
    "train.warmup_steps=1",
    "train.log_every=2",
    "train.eval_every=0",
    "train.checkpoint_every=2",
    "train.eval_exact_match=0",
    f"train.checkpoint_dir={root / 'run'}",
  ]
  argv = ["--config", str(ROOT / "configs" / "finetune.yaml"), "--sample-prompt", ""]
  argv += [x for s in sets for x in ("--set", s)]
  assert train.main(argv) == 0
  return root, argv, train


@pytest.mark.slow
def test_a_qlora_run_resumes_exactly_and_exports_merged(qlora_run, tmp_path):
  root, argv, train = qlora_run
  run = root / "run"
  # Resumed from step 2: the same state as the run that went straight on.
  copy = tmp_path / "run"
  shutil.copytree(run, copy)
  shutil.rmtree(copy / "4")
  assert train.main([a.replace(str(run), str(copy)) for a in argv]) == 0
  want, _ = checkpoint.load_trained(run)
  got, _ = checkpoint.load_trained(copy)
  for a, b in zip(jax.tree.leaves(nnx.state(want)), jax.tree.leaves(nnx.state(got)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # The export: the adapters merged into the dequantized base, which is what the run computed.
  from atlas_jax import hf
  from atlas_jax.hf import __main__ as hf_cli

  out = tmp_path / "hf"
  assert hf_cli.main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
  tokens = jnp.asarray([[3, 17, 99, 5, 250, 42, 7, 1]])
  exported = np.asarray(hf.load(out, dtype="float32")(tokens))
  cfg = checkpoint.load_config(run / "config.yaml")
  trainer = make_trainer(cfg)
  mngr = checkpoint.manager(run)
  state, _ = checkpoint.restore(mngr, trainer.abstract_state(), trainer.state_shardings)
  assert quantized_leaves(state.params)  # restored as stored: the base quantized
  trained = nnx.merge(trainer.graphdef, state.params).forward_train(tokens).main
  np.testing.assert_allclose(exported, np.asarray(trained), rtol=1e-4, atol=1e-4)
  base = np.asarray(hf.load(root / "base", dtype="float32")(tokens))
  assert np.abs(exported - base).max() > 1e-3


def test_the_quantized_product_saves_no_float_copy_of_its_weight():
  """x's gradient through a quantized product is the dequantized weight's; the forward pass keeps
  no dequantized copy for the backward pass, so a QLoRA step saves what a float LoRA step does
  (the inputs its adapters need), none of the weights."""
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (6, 4, 8), jnp.float32)
  w = quant.quantize_weight(
    jax.random.normal(kw, (4, 8, 16)), ("q_heads", "head_dim", "embed"), "int4", group_size=16
  )
  dy = jax.random.normal(kg, (6, 16), jnp.float32)
  _, vjp = jax.vjp(lambda x: quant.quantized_product(x, w, 2), x)
  want = jnp.einsum("mo,nho->mnh", dy, quant.dequantized(w))
  np.testing.assert_allclose(np.asarray(vjp(dy)[0]), np.asarray(want), rtol=1e-5, atol=1e-5)
  from atlas_jax import measure

  sizes = ("model.d_model=64", "model.ffn_dim=256")
  lora = measure.saved_activation_bytes(tiny_config("train.lora={rank: 4}", *sizes), batch=2)
  for fmt in ("int8", "int4"):
    assert measure.saved_activation_bytes(qlora_config(fmt, *sizes), batch=2) == lora


def test_a_group_size_that_does_not_divide_is_named_as_the_train_field():
  cfg = qlora_config("int4", "train.base_quantization_group_size=24")
  with pytest.raises(ValueError, match=r"train.base_quantization_group_size=24 must divide"):
    make_trainer(cfg)


@pytest.mark.slow
def test_an_mla_moe_qlora_model_decodes_as_its_dequantized_copy():
  """DeepSeek-style: MLA attention (whose absorbed decoding folds the adapters into the up-
  projections: dequantized first) and routed experts (dequantized in the MoE layer), all held
  quantized; after a step, greedy decoding matches the dequantized model's."""
  from atlas_jax.config import load_config
  from atlas_jax.decoding.generate import SamplingParams, generate

  cfg = load_config(
    str(ROOT / "configs" / "deepseek-tiny.yaml"),
    ["train.lora={rank: 4, targets: [attn]}", "train.base_quantization=int8", "train.seq_len=16"],
  )
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0))
  _, base = split_trainable(cfg, state.params)
  assert len(quantized_leaves(base)) > 7  # MLA's projections and the experts'
  state, metrics = make_train_step(trainer)(state, batches(1, vocab=cfg.model.vocab_size)[0])
  assert np.isfinite(float(metrics["loss"]))
  prompts, params = [[1, 2, 3], [7, 5]], [SamplingParams(max_new_tokens=5, temperature=0.0)] * 2
  got = generate(nnx.merge(trainer.graphdef, state.params), prompts, params)
  reference = nnx.merge(trainer.graphdef, state.params)
  quant.dequantize_model(reference)
  assert got == generate(reference, prompts, params)


def test_a_hugging_face_base_is_quantized_on_the_host(tmp_path):
  """train.init_from with QLoRA: the devices receive the projections already quantized (values
  and scales in their shardings, never the float weights), equal to quantizing the folder's
  weights, and the run starts from them."""
  pytest.importorskip("torch")
  from atlas_jax import hf, sources
  from atlas_jax.hf import init_from

  from ..test_hf import build_hf

  build_hf("Llama", tmp_path / "base", std=0.02, hidden_size=64, intermediate_size=128)
  cfg = sources.load_config(
    None,
    [
      f"train.init_from={tmp_path / 'base'}",
      "train.lora={rank: 4}",
      "train.base_quantization=int4",
      "train.base_quantization_group_size=32",
    ],
  )
  trainer = make_trainer(cfg)
  base = init_from.base_params(tmp_path / "base", trainer)
  wq = base["blocks"]["attn"]["wq"]
  assert quant.is_quantized(wq) and wq.qvalue.dtype == jnp.int4
  assert (
    wq.qvalue.sharding == trainer.state_shardings.params["blocks"]["attn"]["wq"].get_value().qvalue
  )
  source = hf.load(tmp_path / "base")
  want = quant.quantize_weight(
    source.blocks.attn.wq[...], ("layers", "embed", "q_heads", "head_dim"), "int4", group_size=32
  )
  state = trainer.init(jax.random.key(0), base)
  got = state.params["blocks"]["attn"]["wq"].get_value()
  np.testing.assert_array_equal(np.asarray(got.qvalue), np.asarray(want.qvalue))
  np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
