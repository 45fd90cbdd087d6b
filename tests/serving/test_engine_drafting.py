"""Prompt-lookup (n-gram) and chained MTP drafting in the engine's rounds: greedy outputs equal
plain greedy decoding (preemption included), accepted drafts counted exactly as a host
simulation of the rounds counts them, sampled outputs equal to what `generate`'s speculative loop
draws with the same drafter."""

import dataclasses

import jax
import numpy as np
import pytest

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.decoding.drafters import NGramDrafter
from atlas_jax.serving.engine import Engine

from ..decoding.test_drafting import simulate
from .test_engine_mtp import mtp_model
from .test_engine_speculative import ROOMY, TIGHT, greedy_workload, run

LOOKUP = NGramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)


def repetitive(n_rows, seed):
  """Prompts that repeat a short random phrase, and random ones (few or no matches)."""
  rng = np.random.default_rng(seed)
  prompts = []
  for i in range(n_rows):
    phrase = rng.integers(0, 40, int(rng.integers(2, 6))).tolist()
    prompts.append(phrase * 3 if i % 2 == 0 else rng.integers(0, 40, 7).tolist())
  return prompts


# The tight pool (rounds, then preemption and recompute) in the default run; the roomy one's
# rounds alone with -m slow (the exact round-by-round check below runs on it).
@pytest.mark.parametrize(
  "config",
  [pytest.param(ROOMY, marks=pytest.mark.slow), TIGHT],
  ids=["roomy", "tight"],
)
def test_greedy_prompt_lookup_in_the_engine_equals_plain_greedy(tiny_model, config):
  prompts, params = greedy_workload(11)
  prompts[::2] = repetitive(len(prompts), 3)[::2]
  want = generate(tiny_model, prompts, params, eos_id=3)
  got, engine = run(tiny_model, LOOKUP, config, prompts, params)
  assert got == want
  assert engine.n_spec_rounds > 0 and 0 < engine.n_accepted < engine.n_drafted
  if config is TIGHT:
    assert engine.n_preemptions > 0
  # The token pool sits beside the target's: one token per slot of every block.
  assert engine.pools[1].tokens.shape == (1, *engine.pools[0].arrays[0].shape[1:3])


def test_prompt_lookup_rounds_accept_exactly_what_the_simulation_accepts(tiny_model):
  """Every prompt prefills in the first step, so every later step is a round for every row: the
  engine's accepted drafts are those the reference lookup proposes that equal the plain greedy
  tokens, round by round."""
  prompts = repetitive(4, 5)
  limits = [21, 13, 17, 9]
  params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in limits]
  want = generate(tiny_model, prompts, params)
  got, engine = run(tiny_model, LOOKUP, ROOMY, prompts, params)
  assert got == want
  k = ROOMY.num_speculative_tokens
  row_rounds, accepted = simulate(prompts, want, LOOKUP, k, limits)
  assert (engine.n_spec_row_rounds, engine.n_accepted) == (row_rounds, accepted)
  assert accepted > 0 and engine.n_bursts == 0


def test_sampled_prompt_lookup_rounds_draw_what_generate_draws(tiny_model):
  prompts = repetitive(4, 6)
  params = [
    SamplingParams(max_new_tokens=int(m), temperature=t, top_p=p, seed=s)
    for m, t, p, s in ((20, 1.0, 1.0, 1), (14, 0.7, 0.9, 2), (25, 1.3, 1.0, 3), (9, 0.5, 0.8, 4))
  ]
  want = generate(tiny_model, prompts, params, eos_id=3, draft=LOOKUP, num_speculative_tokens=3)
  got, engine = run(tiny_model, LOOKUP, ROOMY, prompts, params)
  assert got == want
  assert engine.n_spec_rounds > 0 and engine.n_accepted > 0


def test_chained_mtp_heads_in_the_engine():
  """Two sequential heads drafting three tokens (the chain, then the first head again): greedy
  equals plain greedy under preemption."""
  model = mtp_model("sequential", 2, False)
  prompts, params = greedy_workload(6)
  want = generate(model, prompts, params, eos_id=3)
  got, engine = run(model, "mtp", TIGHT, prompts, params)
  assert got == want
  assert engine.n_spec_rounds > 0 and engine.n_preemptions > 0
  heads_pool = engine.pools[1][0]
  assert all(a.shape[0] == 2 for a in jax.tree.leaves(heads_pool))  # both heads hold a cache


@pytest.mark.slow
def test_sampled_chained_mtp_rounds_draw_what_generate_draws():
  model = mtp_model("sequential", 2, False)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 40, int(n)).tolist() for n in (6, 11, 4)]
  params = [SamplingParams(max_new_tokens=18, temperature=1.0, seed=s) for s in (5, 6, 7)]
  want = generate(model, prompts, params, eos_id=3, draft="mtp", num_speculative_tokens=3)
  got, _ = run(model, "mtp", dataclasses.replace(ROOMY, num_speculative_tokens=3), prompts, params)
  assert got == want


def test_serve_takes_vllms_speculative_config(tiny_model):
  import sys
  import types
  from pathlib import Path

  sys.path.insert(0, str(Path(__file__).parent.parent.parent))
  import serve

  spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
  sets = ("n_blocks=32", "block_size=4", "max_num_seqs=4", "runner=ragged")
  argv = ["--checkpoint", "/nonexistent", "--speculative-config", spec]
  args = serve.parse_args([*argv, *(a for s in sets for a in ("--set", f"serve.engine.{s}"))])
  serve.fill_defaults(args)
  tok = types.SimpleNamespace(eos_ids=[3], decode=lambda ids, **kw: "")
  engine = serve.make_engine(args, tiny_model, tok)
  assert engine.runner.drafter == NGramDrafter(prompt_lookup_min=4, prompt_lookup_max=4)
  assert engine.config.num_speculative_tokens == 3
  assert serve.speculative_config('{"method": "ngram"}')[0] == NGramDrafter(5, 5)  # vLLM's
  assert serve.speculative_config('{"method": "mtp", "num_speculative_tokens": 2}') == (
    "mtp",
    None,
    2,
  )
  assert serve.speculative_config('{"method": "draft_model", "model": "d"}') == (None, "d", None)
  with pytest.raises(ValueError, match="method='eagle' is not allowed"):
    serve.speculative_config('{"method": "eagle"}')
  with pytest.raises(ValueError, match=r"\['model'\] not allowed with method='ngram'"):
    serve.speculative_config('{"method": "ngram", "model": "x"}')
  with pytest.raises(ValueError, match="--speculative and --speculative-config are two drafts"):
    serve.make_engine(serve.parse_args([*argv, "--speculative", "mtp"]), tiny_model, tok)


def test_prompt_lookup_on_a_mesh_equals_plain_greedy(tiny_model):
  """2 replicas x 2 tensor devices: each replica's token pool holds its own pages."""
  prompts = repetitive(4, 8)
  params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4
  want = generate(tiny_model, prompts, params)
  config = dataclasses.replace(ROOMY, data_parallel_size=2, tensor_parallel_size=2)
  engine = Engine(tiny_model, config, draft=LOOKUP)
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(i, p, sp)
  got = [[] for _ in prompts]
  while engine.has_unfinished():
    for out in engine.step():
      assert out.error is None
      got[out.request_id].extend(out.new_token_ids)
  assert got == want
  assert engine.mesh is not None and engine.n_accepted > 0
