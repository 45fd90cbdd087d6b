"""train.init_from: the model, weights and tokenizer of a Hugging Face folder or a run, placed
shard by shard under the run's mesh; disagreeing config fields are named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")

from atlas_jax import hf, sources  # noqa: E402
from atlas_jax.config import ConfigError  # noqa: E402
from atlas_jax.hf import init_from  # noqa: E402
from atlas_jax.training import checkpoint  # noqa: E402
from atlas_jax.training.step import make_trainer  # noqa: E402

from ..test_hf import build_hf  # noqa: E402

TOKENS = np.array([[1, 7, 3, 99, 42, 5, 17, 60], [4, 4, 8, 15, 16, 23, 42, 0]], np.int32)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
  """A Qwen2 folder (biases, GQA) whose heads and FFN split over 2 and dims over 4."""
  folder = tmp_path_factory.mktemp("qwen2")
  build_hf("Qwen2", folder, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
  return folder


@pytest.fixture(scope="module")
def qwen_logits(qwen_folder):
  return np.asarray(hf.load(qwen_folder)(jnp.asarray(TOKENS)))


def finetune_config(folder, *sets):
  overrides = [f"train.init_from={folder}", "train.seq_len=8", "train.batch_size=8", *sets]
  return sources.load_config(None, overrides)


@pytest.mark.parametrize(
  "sets",
  # One device under -m slow: the sharded case loads the same folder, then lays it out over
  # the mesh (test_finetune initialises full fine-tunes from a folder in the default run).
  [
    pytest.param([], marks=pytest.mark.slow),
    ["mesh.fsdp=4", "mesh.tensor=2", "train.sharding=zero3", "train.lora={rank: 2}"],
  ],
  ids=["one-device", "fsdp4-tensor2-lora"],
)
def test_init_from_an_hf_folder_gives_its_logits(qwen_folder, qwen_logits, sets):
  cfg = finetune_config(qwen_folder, *sets)
  assert cfg.model == hf.load(qwen_folder).cfg
  trainer = make_trainer(cfg) if sets else make_trainer(cfg, checkpoint.single_device_mesh())
  state = trainer.init(jax.random.key(0), init_from.base_params(qwen_folder, trainer))
  assert int(state.step) == 0  # a fresh optimizer: every moment and count zero
  assert all(float(jnp.abs(x).sum()) == 0 for x in jax.tree.leaves(state.opt_state))
  # Every parameter is laid out as the run's rules say: with the mesh, e.g. the query heads are
  # split over `tensor` and the model width over `fsdp`; each device holds only its slice.
  wq = state.params["blocks"]["attn"]["wq"][...]
  assert wq.sharding == jax.tree.leaves(trainer.state_shardings.params["blocks"]["attn"]["wq"])[0]
  if sets:
    L, D, N, H = wq.shape
    assert {s.data.shape for s in wq.addressable_shards} == {(L, D // 4, N // 2, H)}
  got = np.asarray(nnx.merge(trainer.graphdef, state.params)(jnp.asarray(TOKENS)))
  np.testing.assert_allclose(got, qwen_logits, rtol=1e-5, atol=1e-5)


def test_init_from_a_lora_run_merges_its_adapters(qwen_folder, qwen_logits, tmp_path):
  """A run directory as the source: its newest step restored into the new run's shardings, its
  adapters folded into the weights."""
  src_cfg = finetune_config(qwen_folder, "train.lora={rank: 2}", f"train.checkpoint_dir={tmp_path}")
  src = make_trainer(src_cfg, checkpoint.single_device_mesh())
  state = src.init(jax.random.key(0), init_from.base_params(qwen_folder, src))
  # Adapters that change the function (b is zero at the start).
  lora = lambda p: jax.tree.map(lambda x: x + 0.1, p) if p.ndim >= 3 else p
  params = nnx.to_pure_dict(state.params)
  for name in ("wq_lora", "wo_lora"):
    params["blocks"]["attn"][name]["b"] = lora(params["blocks"]["attn"][name]["b"])
  nnx.replace_by_pure_dict(state.params, params)
  checkpoint.write_run_files(tmp_path, src_cfg)
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 1, state, {"step": 1, "data_index": 1})
  mngr.wait_until_finished()
  want = np.asarray(checkpoint.load_model(tmp_path)[0](jnp.asarray(TOKENS)))
  trained = np.asarray(nnx.merge(src.graphdef, state.params)(jnp.asarray(TOKENS)))
  np.testing.assert_allclose(want, trained, rtol=1e-5, atol=1e-5)

  cfg = sources.load_config(None, [f"train.init_from={tmp_path}", "mesh.fsdp=8"])
  assert cfg.model == src_cfg.model
  trainer = make_trainer(cfg)
  fresh = trainer.init(jax.random.key(1), init_from.base_params(tmp_path, trainer))
  got = np.asarray(nnx.merge(trainer.graphdef, fresh.params)(jnp.asarray(TOKENS)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(got - qwen_logits).max() > 1e-3  # the adapters changed the function


@pytest.mark.parametrize(
  "sets, names",
  [
    (["model.n_layers=3"], ["model.n_layers=3", "n_layers=2", "train.init_from="]),
    (["model.qkv_bias=false"], ["model.qkv_bias=False", "qkv_bias=True"]),
    (["model.mtp={n_predict: 1}"], ["model.mtp.n_predict=1", "mtp.n_predict=None"]),
    (["data.tokenizer=bpe:300"], ["data.tokenizer='bpe:300'", "comes from the source"]),
    (["train.init_from=/nonexistent/folder"], ["train.init_from='/nonexistent/folder'", "exist"]),
    (["train.init_from=7"], ["train.init_from=7", "a path"]),
  ],
)
def test_a_disagreeing_field_is_named_with_both_values(qwen_folder, sets, names):
  with pytest.raises(ConfigError) as e:
    finetune_config(qwen_folder, *sets)
  for name in names:
    assert name in str(e.value), (name, str(e.value))


def test_fields_that_say_how_it_runs_may_differ(qwen_folder):
  cfg = finetune_config(qwen_folder, "model.dtype=bfloat16", "model.n_layers=2")
  assert cfg.model.dtype == "bfloat16" and cfg.model.n_layers == 2
  assert init_from.comparable(cfg.model) == init_from.comparable(hf.load(qwen_folder).cfg)


@pytest.fixture(scope="module")
def deepseek_moe_folder(tmp_path_factory):
  """A DeepSeek-V3 folder: MLA, a dense first layer, then MoE layers with a shared expert and
  the selection bias (`noaux_tc`)."""
  from ..test_hf_moe import FAMILIES
  from ..test_hf_moe import build_hf as build_moe

  folder = tmp_path_factory.mktemp("deepseek_v3")
  family, overrides = FAMILIES["deepseek_v3-noaux-tc"]
  build_moe(family, overrides, folder)
  return folder


@pytest.mark.slow
def test_init_from_a_mixture_of_experts_folder_under_an_expert_mesh(deepseek_moe_folder):
  sets = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "train.sharding=zero3"]
  cfg = finetune_config(deepseek_moe_folder, "train.lora={rank: 2, targets: [attn]}", *sets)
  want_model = hf.load(deepseek_moe_folder)
  assert cfg.model == want_model.cfg
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0), init_from.base_params(deepseek_moe_folder, trainer))
  w_up = state.params["blocks"]["mlp"]["w_up"][...]  # [L_moe, E, D, F], experts over `expert`
  L, E, D, F = w_up.shape
  assert {s.data.shape for s in w_up.addressable_shards} == {(L, E // 2, D // 2, F // 2)}
  bias = np.asarray(state.params["blocks"]["mlp"]["score_bias"][...])
  np.testing.assert_array_equal(bias, np.asarray(want_model.blocks.mlp.score_bias[...]))
  got = np.asarray(nnx.merge(trainer.graphdef, state.params)(jnp.asarray(TOKENS % 97)))
  want = np.asarray(want_model(jnp.asarray(TOKENS % 97)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_lora_on_a_mixture_of_experts_mlp_is_named(deepseek_moe_folder):
  with pytest.raises(ConfigError, match=r"train.lora.targets=\['attn', 'mlp'\].*mixture-of-"):
    make_trainer(finetune_config(deepseek_moe_folder, "train.lora={rank: 2}"))
