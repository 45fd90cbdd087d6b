"""The transformers side of the family tests (tests/test_hf*.py): tiny random models saved as
Hugging Face folders, their logits and greedy tokens, and the checks several families run against
them (logits and greedy tokens past a sliding window, export back, the engine's greedy tokens,
fine-tuning from a folder, MTP modules stored as DeepSeek-V3 and GLM-4.5 release them).

Importers skip themselves without torch and transformers (`pytest.importorskip`) before importing
this module."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from atlas_jax import hf
from atlas_jax.decoding.generate import SamplingParams, generate

# The tiny shape most family tests start from (each adds its family's fields).
TINY = dict(
  vocab_size=101,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
)
# Families whose causal-LM class is not `{family}ForCausalLM`.
MODEL_CLASSES = {"Gemma3Text": "Gemma3ForCausalLM"}
# A small paged pool served in ragged steps: prompts span several blocks and prefill chunks, and
# two sequences at a time make the others wait.
SMALL_POOL = dict(runner="ragged", n_blocks=32, block_size=4, max_num_seqs=2, prefill_chunk=8)


def randomise(module, std: float = 0.2, *, norm_mean: float = 1.0):
  """Every weight of `module` drawn from N(0, std), norms from N(norm_mean, 0.1) (0 for Gemma's,
  which multiply by 1 + w), and DeepSeek-V3's and GLM's selection bias `e_score_correction_bias`
  (transformers starts it at zeros) large enough to change which experts are picked."""
  with torch.no_grad():
    for name, p in module.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(norm_mean + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, std)
    for name, b in module.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.3 * torch.randn_like(b))


def build(family: str, folder, config: dict, *, std=0.2, norm_mean=1.0, attention=None, **save):
  """transformers' `{family}Config(**config)` model, seeded and randomised (`randomise`), saved to
  `folder` unless it is None (`save`: save_pretrained's options); `attention` sets its attention
  implementation. Returns the model in eval mode."""
  torch.manual_seed(0)
  hf_config = getattr(transformers, f"{family}Config")(**config)
  if attention is not None:
    hf_config._attn_implementation = attention
  model_class = getattr(transformers, MODEL_CLASSES.get(family, f"{family}ForCausalLM"))
  model = model_class(hf_config).eval()
  randomise(model, std, norm_mean=norm_mean)
  if folder is not None:
    model.save_pretrained(folder, **save)
  return model


def hf_logits(model, tokens) -> np.ndarray:
  """transformers' logits, f32[B, T, V], for int tokens [B, T]."""
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def jit_logits(model, tokens) -> np.ndarray:
  """Our model's logits, f32[B, T, V], from one jitted call on int tokens [B, T]."""
  return np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens, jnp.int32)))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
  """transformers' `n` greedy new tokens after `prompt` (no eos stops them)."""
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      max_new_tokens=n,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )
  return out[0, len(prompt) :].tolist()


def check_past_the_window(ref, ours, out, window: int):
  """Logits for prompts three windows long, greedy tokens through the cache past the window
  (against transformers' `generate`), and `ours` exported to the folder `out`, which
  transformers reads to `ref`'s logits."""
  rng = np.random.RandomState(0)
  V = ref.config.vocab_size
  toks = rng.randint(0, V, (2, 3 * window + 5))
  np.testing.assert_allclose(np.asarray(ours(toks)), hf_logits(ref, toks), atol=2e-4, rtol=2e-4)
  prompt = rng.randint(0, V, 2 * window + 3).tolist()
  n = window + 4
  (got,) = generate(ours, [prompt], SamplingParams(max_new_tokens=n))
  assert list(got) == hf_greedy(ref, prompt, n)
  hf.save(ours, out)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(hf_logits(back, toks), hf_logits(ref, toks), atol=2e-4, rtol=2e-4)


def check_engine_greedy(ours, ref, prompts: list[list[int]], n: int, **config):
  """The engine (`SMALL_POOL` updated by `config`: EngineConfig's fields) serves each prompt
  transformers' greedy tokens. Returns the engine."""
  from atlas_jax.serving.engine import Engine, EngineConfig

  engine = Engine(ours, EngineConfig(**{**SMALL_POOL, **config}))
  got = engine.generate(prompts, [SamplingParams(max_new_tokens=n)] * len(prompts))
  for prompt, tokens in zip(prompts, got):
    assert list(tokens) == hf_greedy(ref, prompt, n)
  return engine


def check_fine_tuning(folder, *sets: str, seq_len: int, steps: int):
  """train.init_from `folder` with `sets` (train.py's --set; batch 8, learning rate 3e-3): the
  step-0 model gives the folder's logits and the loss falls over `steps` steps.

  Returns:
    (the trainer, its trained state, the batch's tokens i32[8, seq_len + 1], the folder's
    logits f32[2, seq_len, V] of the first two rows).
  """
  from flax import nnx

  from atlas_jax import sources
  from atlas_jax.hf import init_from
  from atlas_jax.training.step import make_train_step, make_trainer

  cfg = sources.load_config(
    None,
    [
      f"train.init_from={folder}",
      f"train.seq_len={seq_len}",
      "train.batch_size=8",
      "train.learning_rate=3e-3",
      "train.warmup_steps=1",
      *sets,
    ],
  )
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0), init_from.base_params(folder, trainer))
  toks = np.random.RandomState(0).randint(0, cfg.model.vocab_size, (8, seq_len + 1))
  got = nnx.merge(trainer.graphdef, state.params)(toks[:2, :seq_len])
  want = np.asarray(hf.load(folder)(toks[:2, :seq_len]))
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)
  step = make_train_step(trainer)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, {"tokens": toks})
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  return trainer, state, toks, want


def store_mtp_layers(folder, ref, layers):
  """Adds `layers` (transformers' `MtpLayer`s) to the folder's model.safetensors as the released
  DeepSeek-V3 and GLM-4.5 checkpoints store their MTP modules: layer num_hidden_layers + j, with
  copies of the embedding and output head (which are not read); config.json announces them in
  num_nextn_predict_layers."""
  L = ref.config.num_hidden_layers
  tensors = load_file(str(folder / "model.safetensors"))
  for j, layer in enumerate(layers):
    prefix = f"model.layers.{L + j}."
    for name, p in layer.state_dict().items():
      name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
      tensors[prefix + name] = p.contiguous()
    tensors[prefix + "embed_tokens.weight"] = ref.model.embed_tokens.weight.data.clone()
    tensors[prefix + "shared_head.head.weight"] = ref.lm_head.weight.data.clone()
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((folder / "config.json").read_text())
  config["num_nextn_predict_layers"] = len(layers)
  (folder / "config.json").write_text(json.dumps(config))


def mtp_logits(ref, layers, tokens) -> list[np.ndarray]:
  """transformers' logits f32[B, T, V] of each MTP layer in turn, for int tokens [B, T]: layer j
  (from 1) reads the embedding of the tokens j ahead at positions + j beside the hidden state
  before it (the trunk's normalised last one, as MtpModel receives it, then layer j - 1's)."""
  T = tokens.shape[1]
  out = []
  with torch.no_grad():
    tt = torch.tensor(tokens)
    h = ref.model(tt).last_hidden_state
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    for j, layer in enumerate(layers, start=1):
      emb = ref.model.embed_tokens(torch.roll(tt, -j, dims=1))
      pos = torch.arange(T)[None] + j
      h = layer(
        emb,
        h,
        position_embeddings=ref.model.rotary_emb(emb, pos),
        attention_mask=mask,
        position_ids=pos,
        cache=None,
      )
      out.append(ref.lm_head(h).numpy())
  return out
