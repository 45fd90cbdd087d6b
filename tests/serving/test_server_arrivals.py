"""Arrivals never wait on the engine step in progress: a submission is checked and queued in the
engine's inbox from the event loop while the engine thread is held inside a step."""

import asyncio
import contextlib
import threading

import httpx
import pytest

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.serving.engine import Engine, EngineConfig, RequestError
from atlas_jax.serving.server import EngineRunner, build_app

from .conftest import byte_model, serving_app

CONFIG = EngineConfig(n_blocks=64, block_size=8, max_num_seqs=4, prefill_chunk=16)


@contextlib.contextmanager
def held_steps(engine: Engine):
  """Makes the engine's next step wait, once it has started, until `release` is set; yields
  (entered, release). Set on exit, or after a minute (an arrival that waits for the step, as it
  did when it took the engine lock, then sees `release` set and fails instead of hanging)."""
  entered, release = threading.Event(), threading.Event()
  failsafe = threading.Timer(60, release.set)
  failsafe.start()
  step = engine.step

  def held_step():
    if not release.is_set():
      entered.set()
      release.wait()
    return step()

  engine.step = held_step
  try:
    yield entered, release
  finally:
    release.set()
    failsafe.cancel()


async def drain(queue) -> list[int]:
  tokens = []
  while True:
    out = await queue.get()
    tokens += out.new_token_ids
    if out.finished:
      return tokens


def test_an_arrival_is_queued_while_a_step_runs(tiny_model):
  engine = Engine(tiny_model, CONFIG)
  params = SamplingParams(max_new_tokens=6)
  runner = EngineRunner(engine)
  try:
    with held_steps(engine) as (entered, release):

      async def main():
        _, first = runner.submit([1, 2, 3], params)
        assert await asyncio.to_thread(entered.wait, 60)  # the engine thread is in a step
        _, second = runner.submit([4, 5, 6, 7], params)  # returns while that step is held
        assert not release.is_set()
        assert (engine.n_waiting, engine.n_running) == (2, 0)  # both in the inbox
        with pytest.raises(RequestError, match="prompt token id 99 is not allowed") as e:
          runner.submit([1, 99], params)  # checked at once, in this thread
        assert e.value.field is None and engine.n_waiting == 2  # nothing of it queued
        with pytest.raises(RequestError, match="logit_bias token id 40") as e:
          runner.submit([1, 2], SamplingParams(max_new_tokens=2, logit_bias={40: 1.0}))
        assert e.value.field == "logit_bias"
        release.set()
        return await drain(first), await drain(second)

      got = asyncio.run(main())
  finally:
    runner.shutdown()
  assert list(got) == generate(tiny_model, [[1, 2, 3], [4, 5, 6, 7]], params)


def test_http_handlers_answer_while_a_step_runs():
  model, tok = byte_model(3)
  engine = Engine(model, CONFIG, eos_id=tok.eos_id, detokenize=tok.decode)
  runner = EngineRunner(engine)
  app = build_app(runner, tokenizer=tok, model_name="tiny")
  with serving_app(app, runner) as url, held_steps(engine) as (entered, release):
    with httpx.Client(base_url=url, timeout=60) as client:
      held = threading.Thread(
        target=client.post, args=("/v1/completions",), kwargs=dict(json={"prompt": "ab"})
      )
      held.start()
      assert entered.wait(60)
      bad = client.post("/v1/completions", json={"prompt": "ab", "logit_bias": {"999": 1}})
      assert not release.is_set()  # answered while the step is held
      assert bad.status_code == 400
      assert bad.json()["error"]["param"] == "logit_bias"
      assert "logit_bias token id 999 is not allowed" in bad.json()["error"]["message"]
      metrics = client.get("/metrics")
      assert metrics.status_code == 200 and not release.is_set()
      assert "\natlas_num_requests_waiting 1\n" in metrics.text  # the held request, queued
      release.set()
      held.join(60)
      assert not held.is_alive()
