"""Config: presets load, overrides apply, and every invalid field is named in the error."""

from pathlib import Path

import pytest

from atlas_jax.config import Config, ConfigError, ModelConfig, dump_config, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_presets_load_and_round_trip(path, tmp_path):
  cfg = load_config(path)
  assert isinstance(cfg, Config)
  again = tmp_path / "again.yaml"
  again.write_text(dump_config(cfg))
  assert load_config(again) == cfg


def test_overrides_apply_with_yaml_types():
  cfg = load_config(
    None,
    [
      "model.n_layers=3",
      "train.learning_rate=1e-3",
      "model.qkv_bias=true",
      "model.rope_scaling={type: linear, factor: 2.0}",
    ],
  )
  assert cfg.model.n_layers == 3
  assert cfg.train.learning_rate == pytest.approx(1e-3)
  assert cfg.model.qkv_bias is True
  assert cfg.model.rope_scaling.type == "linear" and cfg.model.rope_scaling.factor == 2.0


def test_head_dim_defaults_to_d_model_over_heads():
  assert ModelConfig(d_model=256, n_heads=8, n_kv_heads=2).head_dim == 32


@pytest.mark.parametrize(
  "override, names",
  [
    (["model.n_heads=12", "model.n_kv_heads=5"], ["model.n_heads=12", "n_kv_heads=5"]),
    (["model.head_dim=33"], ["model.head_dim=33", "even"]),
    (["model.d_model=100", "model.n_heads=8"], ["model.d_model=100", "n_heads=8"]),
    (["model.colour=red"], ["model.colour", "allowed", "n_heads"]),
    (["nonsense.x=1"], ["nonsense", "allowed", "model"]),
    (["model.n_layers=two"], ["model.n_layers='two'", "integer"]),
    (["model.n_layers=0"], ["model.n_layers=0", "> 0"]),
    (["model.qkv_bias=3"], ["model.qkv_bias=3", "true or false"]),
    (["model.dtype=float64"], ["model.dtype='float64'", "'bfloat16'"]),
    (["attention.implementation=fast"], ["attention.implementation='fast'", "'pallas'"]),
    (["model.rope_scaling={type: longrope}"], ["model.rope_scaling.short_factor=[]", "longrope"]),
    (["model.rope_scaling={type: rope}"], ["model.rope_scaling.type='rope'", "'longrope'"]),
    (
      ["model.rope_scaling={type: yarn, longrope_frequencies: both}"],
      ["model.rope_scaling.longrope_frequencies='both'", "'dynamic'", "'long'"],
    ),
    (["model.partial_rotary_factor=0"], ["model.partial_rotary_factor=0", "(0, 1]"]),
    (["mesh.data=-1", "mesh.fsdp=-1"], ["mesh", "at most one axis"]),
    (["train.seq_len=1024"], ["train.seq_len=1024", "max_seq_len=512"]),
    (["train.b2=1.5"], ["train.b2=1.5", "[0, 1]"]),
    (["serve.sampling.top_p=0"], ["serve.sampling.top_p=0", "(0, 1]"]),
    (["serve.engine.prefill_chunk=48"], ["serve.engine.prefill_chunk=48", "power of two"]),
    (["serve.engine.kv_cache_memory=-1"], ["serve.engine.kv_cache_memory=-1", "bytes"]),
    (["train.async_checkpointing=2"], ["train.async_checkpointing=2", "true or false"]),
    (["serve.engine.prefill_context_parallel_size=0"], ["prefill_context_parallel_size=0"]),
    (["serve.engine.disable_hybrid_kv_cache_manager=1"], ["disable_hybrid_kv_cache_manager=1"]),
    (["model.n_layers"], ["model.n_layers", "section.field=value"]),
  ],
)
def test_invalid_fields_are_named(override, names):
  with pytest.raises(ConfigError) as e:
    load_config(Path(__file__).parent.parent / "configs" / "tiny.yaml", override)
  for name in names:
    assert name in str(e.value), (name, str(e.value))


def test_missing_and_malformed_files(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    load_config(tmp_path / "nope.yaml")
  bad = tmp_path / "bad.yaml"
  bad.write_text("- a list\n- not a mapping\n")
  with pytest.raises(ConfigError, match="mapping"):
    load_config(bad)
