"""Fault isolation: one request's failure inside a batched step fails that request only.

* A call that raises with the pools intact is re-run in halves until the failing rows are alone
  (`run_isolated`); they fail ("error"), the others' draws are kept. Halves run in order, so a
  row reading blocks that an earlier row writes this step still reads them after they are
  written.
* The blocks a failed row was to fill hold no valid entries, though the allocator may have
  hashed them into the prefix cache and another request admitted this step may read them: they
  leave the cache, and every reader (transitively) recomputes (`fail_rows`).
* A call that raised after the device took the donated pools (`PoolLost`) leaves nothing to
  re-run on: the pools and allocators are rebuilt, every running request recomputes (its
  outputs so far are kept, and its sampling keys make the recomputation draw the same tokens),
  and the rows of the failed call fail if there was one, else run alone from then on (`suspect`)
  until the culprit is found (`recover`).
"""

from __future__ import annotations

from collections.abc import Callable

from atlas_jax.serving.batch import Row
from atlas_jax.serving.requests import Request, RequestId, RequestOutput
from atlas_jax.serving.runner import ModelRunner
from atlas_jax.serving.scheduler import Scheduler


class PoolLost(Exception):
  """A jitted call raised after the device took the donated pools."""

  def __init__(self, rows: list[Request], error: BaseException):
    super().__init__(str(error))
    self.rows, self.error = rows, error


def step_error(e: BaseException) -> str:
  return f"the model step failed: {type(e).__name__}: {e}"


def run_isolated(run: Callable[[list[Row]], dict], rows: list[Row], runner: ModelRunner):
  """`run(rows)`, and when it raises, the rows split in halves until the failing ones are alone.

  Requests flagged `suspect` run alone. Returns ({id: draw}, {id: error message}).

  Raises:
    PoolLost: a call failed after taking the pools.
  """
  groups: list[list[Row]] = []
  for row in rows:
    if row.req.suspect or not groups or groups[-1][0].req.suspect:
      groups.append([row])
    else:
      groups[-1].append(row)
  results: dict[RequestId, tuple] = {}
  failed: dict[RequestId, str] = {}
  for group in groups:
    try:
      results.update(run(group))
    except Exception as e:
      if runner.pool_lost():
        raise PoolLost([r.req for r in group], e) from e  # nothing left to re-run on
      if len(group) == 1:
        failed[group[0].req.id] = step_error(e)
        continue
      mid = len(group) // 2
      for half in (group[:mid], group[mid:]):
        got, bad = run_isolated(run, half, runner)
        results.update(got)
        failed.update(bad)
  return results, failed


def fail_rows(
  scheduler: Scheduler, rows: list[Row], failed: dict[RequestId, str], finish
) -> list[RequestOutput]:
  """Ends the failed requests (`finish(req, "error", message)`); recomputes those that read
  entries the failed ones never wrote."""
  by_id = {row.req.id: row.req for row in rows}
  lost_blocks: set[tuple[int, int]] = set()  # (replica, block)
  tainted = set(failed)
  changed = True
  Z = scheduler.config.block_size
  while changed:
    changed = False
    for row in rows:
      req = row.req
      ids = scheduler.allocator(req).blocks(req.id)
      blocks = {(req.replica, b) for b in ids}
      written = {(req.replica, b) for b in ids[req.n_computed // Z :]}  # filled this step
      if req.id in tainted:
        if not lost_blocks.issuperset(written):
          lost_blocks.update(written)
          changed = True
      elif lost_blocks.intersection(blocks):
        tainted.add(req.id)
        changed = True
  outputs = []
  readers = []
  for rid in tainted:
    req = by_id[rid]
    if rid in failed:
      scheduler.fail(req)
      outputs.append(finish(req, "error", failed[rid]))
    else:
      readers.append(req)
  scheduler.requeue(readers)
  return outputs


def recover(
  scheduler: Scheduler, runner: ModelRunner, lost: PoolLost, finish
) -> list[RequestOutput]:
  """Fresh pools and allocators after `lost`; see the module's docstring."""
  outputs = []
  if len(lost.rows) == 1 and lost.rows[0].id in scheduler.requests:
    outputs.append(finish(lost.rows[0], "error", step_error(lost.error)))
  for req in lost.rows:
    req.suspect = True
  runner.reset_pools()
  scheduler.reset()
  return outputs
