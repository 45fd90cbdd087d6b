"""vLLM's offline engine as a peer: run by the vLLM virtualenv's python, never imported by ours.

bench/serve.py starts it as a subprocess (`--peer vllm`) so that vLLM and its torch stay out of
our package's dependencies. It builds one `vllm.LLM` on a Hugging Face folder (float32, CPU) and
runs greedy generations from token-id prompts (temperature 0, ignore_eos, max_tokens each):

    .venv-vllm/bin/python bench/vllm_peer.py job.json [--out result.json]
        job.json: {"folder", "prompts": [[ids]], "max_tokens": [n per prompt], "repeats",
                   "max_num_seqs", "max_model_len", "max_num_batched_tokens", "enforce_eager"};
        writes
        {"seconds": [per repeat], "token_ids": [[new ids per prompt]] (the last repeat's)}.
    .venv-vllm/bin/python bench/vllm_peer.py job.json --serve
        builds the engine, then reads one {"prompts", "max_tokens"} JSON object per stdin line
        and answers each with one line `PEER {"seconds", "token_ids"}` on stdout, so the caller
        can interleave vLLM's runs with its own; an empty line or end of input stops it.

The KV cache is VLLM_CPU_KVCACHE_SPACE GiB (default here 1, far more than the jobs use); vLLM's
own log goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPLY = "PEER "


def build(job: dict):
  """A vllm.LLM for the job's folder, batch and context."""
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
  from vllm import LLM

  return LLM(
    model=job["folder"],
    dtype="float32",
    max_num_seqs=int(job["max_num_seqs"]),
    max_model_len=int(job["max_model_len"]),
    **(
      {"max_num_batched_tokens": int(job["max_num_batched_tokens"])}
      if "max_num_batched_tokens" in job
      else {}
    ),
    enforce_eager=bool(job.get("enforce_eager", False)),
    seed=0,
  )


def run(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict:
  """Seconds of one greedy generate of all prompts, and the new token ids of each."""
  from vllm import SamplingParams

  if len(prompts) != len(max_tokens):
    raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
  params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=int(n)) for n in max_tokens]
  inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
  start = time.perf_counter()
  outs = llm.generate(inputs, params, use_tqdm=False)
  seconds = time.perf_counter() - start
  return dict(seconds=seconds, token_ids=[list(o.outputs[0].token_ids) for o in outs])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("job", help="JSON file: folder, max_num_seqs, max_model_len (and prompts ...)")
  p.add_argument("--out", help="write the result JSON here instead of stdout")
  p.add_argument("--serve", action="store_true", help="take runs from stdin, one JSON per line")
  args = p.parse_args(argv)
  with open(args.job) as f:
    job = json.load(f)
  missing = {"folder", "max_num_seqs", "max_model_len"} - set(job)
  if missing:
    raise SystemExit(f"error: {args.job} lacks {sorted(missing)}")
  llm = build(job)
  if args.serve:
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
      if not line.strip():
        break
      req = json.loads(line)
      print(REPLY + json.dumps(run(llm, req["prompts"], req["max_tokens"])), flush=True)
    return 0
  repeats = int(job.get("repeats", 1))
  if repeats < 1:
    raise SystemExit(f"error: repeats={repeats} in {args.job}: must be at least 1")
  results = [run(llm, job["prompts"], job["max_tokens"]) for _ in range(repeats)]
  out = dict(seconds=[r["seconds"] for r in results], token_ids=results[-1]["token_ids"])
  text = json.dumps(out)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  else:
    print(text)
  return 0


if __name__ == "__main__":  # required: vLLM's engine starts processes that re-import __main__
  # bench/'s modules (sampling.py, attention.py, ...) must not shadow packages vLLM imports
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
  sys.exit(main())
