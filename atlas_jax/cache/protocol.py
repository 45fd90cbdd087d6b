"""The cache protocol: what every cache kind offers the model and each attention layer.

Four cache kinds share it: contiguous KV (`KVCache`) and contiguous MLA latents (`LatentCache`),
in `atlas_jax.cache.contiguous`, and paged KV or latent pools behind a block table
(`PagedCache`), in `atlas_jax.cache.paged`. The model never asks which kind it holds:

    storage = cache.layers                          # every layer's arrays, leading [L] axis
    for l in range(L) (a `jax.lax.scan` carrying `storage`):
      view = cache.layer(storage, l, positions_BT)  # a LayerCache for layer l
      view = view.write(positions_BT, *new_BT)      # store this call's entries at layer l
      out = view.attend(q_BTN_, positions_BT, ...)  # attend over everything layer l holds
      storage = view.storage                        # carried to the next layer
    cache = cache.advance(storage, positions_BT)    # new storage, lengths grown

The storage is carried whole rather than sliced per layer and stacked back: a layer writes its new
entries into its slice with a scatter and reads it in place, so XLA updates the (donated) cache in
place and never copies a layer, let alone the whole cache, per call.

A KV layer stores (k, v), each [.., K, H] per token, and `attend` takes queries [B, T, N, H]. A
latent layer stores MLA's latent [.., C + R] per token and `attend` is the absorbed MLA attention:
queries [B, T, N, C + R] (W_UK folded into the no-rope part) score against whole latents and the
output is the weighted sum of their first C dims, [B, T, N, C]. `read` returns the held entries
densely, [B, S, ...] per stored array, for attention paths that need them (MLA's expanded
prefill); slots at or past `kv_lengths` are zeros or stale and must be masked.

Positions: the T new tokens of row b sit at positions lengths[b], lengths[b] + 1, ...; a paged
cache also accepts negative positions, marking right padding (not written, not counted), so the
rows of one call may add different numbers of tokens. Contiguous caches add T tokens to every row.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

Array = jax.Array


class LayerCache(Protocol):
  """One layer's slice of a cache, as the attention module sees it."""

  kv_lengths: Array  # i32[B] tokens held per row, including this call's
  # Whether `attend` reads the stored entries in place for any number of new tokens (paged
  # pools): attention modules then never ask for a dense `read`. Absent means False.
  attends_in_place: bool

  @property
  def storage(self) -> tuple[Array, ...]:
    """Every layer's arrays (this one updated), handed back to the model's layer scan."""
    ...

  def write(self, positions_BT: Array, *new: Array) -> LayerCache:
    """Stores the new tokens' entries ([B, T, ...] each) at their positions."""
    ...

  def attend(
    self,
    q: Array,
    positions_BT: Array,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Array | None = None,
    implementation: str | None = None,
    attention_chunk: int | None = None,
  ) -> Array:
    """Causal attention of the T queries over every entry held (after `write`); the softmax
    options (window, soft-cap, f32[N] sinks, a chunked layer's `attention_chunk`) as in
    `atlas_jax.kernels.reference`. Latent layers take none of them and raise ValueError when one
    is given. The model passes `attention_chunk` only for a chunked layer."""
    ...

  def read(self) -> tuple[Array, ...]:
    """The held entries densely, [B, S, ...] per stored array."""
    ...


class Cache(Protocol):
  """A batch of sequences' cache, threaded through the model's layer scan."""

  lengths: Array  # i32[B] tokens held per row before the call

  @property
  def layers(self) -> tuple[Array, ...]:
    """The storage of every layer, each array with a leading [L] axis."""
    ...

  def layer(self, storage: tuple[Array, ...], layer: Array, positions_BT: Array) -> LayerCache:
    """The view of layer `layer` (i32[]) of `storage`."""
    ...

  def advance(self, layers: tuple[Array, ...], positions_BT: Array) -> Any:
    """The cache holding the scan's updated storage, with each row's length grown."""
    ...

  def replace(self, **fields) -> Any:
    """The cache with fields replaced (`lengths=`: a rollback, or a row's own start)."""
    ...

  def slots(self, positions_BT: Array) -> Array:
    """i32[B, T] where each position's entry lives in a flattening of one layer's storage
    ([B * S] rows of a contiguous cache, [P * Z] slots of a pool); -1 where padding. Side
    stores kept beside the cache (an MTP drafter's hidden states) are indexed by it."""
    ...


def refuse_latent_options(where: str, sliding_window, soft_cap, sinks) -> None:
  """MLA's absorbed attention takes none of the per-model softmax options: ValueError naming
  the one given."""
  for name, value in (
    ("sliding_window", sliding_window),
    ("soft_cap", soft_cap),
    ("sinks", sinks),
  ):
    if value is not None:
      shown = "an array" if name == "sinks" else repr(value)
      raise ValueError(f"{where}: MLA has no {name} (got {name}={shown}); pass None")


def added_tokens(positions_BT: Array) -> Array:
  """i32[B]: tokens a call adds per row; negative positions mark padding."""
  return (positions_BT >= 0).sum(axis=1, dtype=jax.numpy.int32)
