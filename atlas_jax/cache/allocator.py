"""Host-side block allocator for the paged KV cache, with reference counts and prefix caching.

Plain Python, never traced: the scheduler calls it between jitted steps and hands the resulting
block tables and copy lists to the device.

Every physical block is in exactly one of three states:

* free: in the free list, holding nothing worth keeping;
* used: referenced by one or more sequences (`ref_count > 0`);
* cached: unreferenced but holding a full block of a known token prefix, so a later request with
  that prefix can reuse it; cached blocks are evicted in LRU order when the free list runs dry.

A full block is identified by a hash chained over its parent block's hash and its own tokens, so
equal hashes mean equal whole prefixes, not just equal blocks. A sequence's chain may start from a
salt (`add_sequence(..., salt=)`): the identity of what else its K/V depend on, such as its LoRA
adapter (vLLM puts the adapter's id in every block hash's extra keys), so sequences share cached
blocks only when their salts are equal. Only full blocks are hashed and
shared through the cache; a partial block is shared only by `fork`, and a sequence that must write
into a shared partial block first copies it (copy-on-write): `append` returns the (src, dst)
block pairs whose device data the caller must copy before writing the new tokens.

`reserve` takes blocks for tokens whose values are not known yet (a burst of decode steps on the
device); `append` fills them once the tokens are read back, and `truncate` gives back the rest.

`drop_before` releases the blocks of a sequence that no later token will read: a model whose
every layer attends within a sliding window of W positions reads, from the token at position p
on, only positions past p - W, so the blocks wholly before that return to the pool (to the prefix
cache, when hashed) and a sequence holds at most about W / Z + 1 blocks however long it grows, as
vLLM's sliding-window manager frees them. A dropped block's place in the sequence's list holds
`DROPPED`. An allocator made with that `window` also serves prefix hits by the window: a hit of
n tokens needs only the cached blocks the token at position n reads (those from n - W + 1 on),
and takes only those.

`HybridAllocator` holds the two block sets of a model whose layers mix full attention with
sliding windows (Gemma 2 and 3, gpt-oss): one allocator per group of layers, each with its own
pool, as vLLM's hybrid manager does, so the windowed layers' memory stops growing past the
window while the others keep every block.

Every operation checks what it needs before it changes anything, so a raised error leaves the
allocator exactly as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

SeqId = Hashable
_ROOT_HASH = b""
DROPPED = -1  # a released block's place in its sequence (`drop_before`)


class AllocatorError(Exception):
  """Base class of the allocator's errors."""


class OutOfBlocksError(AllocatorError):
  """Not enough free or evictable blocks for the request."""


class UnknownSequenceError(AllocatorError, KeyError):
  """The sequence id was never added or has been freed."""

  def __str__(self) -> str:  # KeyError would quote the whole message
    return str(self.args[0])


class DuplicateSequenceError(AllocatorError, ValueError):
  """The sequence id is already live."""


def block_hash(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
  """The chained hash of a full block: it commits to the whole prefix ending in this block."""
  data = np.asarray(tokens, dtype=np.int64).tobytes()
  return hashlib.blake2b(parent_hash + data, digest_size=16).digest()


def root_hash(salt: bytes) -> bytes:
  """The parent hash of a sequence's first block: no salt, the plain root; a salt, a hash that no
  block's equals, so the whole chain differs from every other salt's."""
  if not salt:
    return _ROOT_HASH
  return hashlib.blake2b(b"salt\0" + salt, digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
  """A snapshot of the allocator's occupancy and counters (see `atlas_jax.plan.kv`)."""

  n_blocks: int
  block_size: int
  n_free: int  # in the free list
  n_cached: int  # unreferenced but kept for prefix hits (evictable)
  n_used: int  # referenced by at least one sequence
  filled_slots: int  # token slots holding real tokens in used blocks, each physical block once
  logical_tokens: int  # tokens summed over live sequences (shared blocks counted per sequence)
  prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
  prefix_hit_tokens: int  # of those, served from cached blocks
  n_evictions: int
  n_copies: int  # copy-on-write block copies


@dataclasses.dataclass
class _Sequence:
  blocks: list[int]
  tokens: list[int]
  hashes: list[bytes]  # chained hash of each full block, in order
  root: bytes = _ROOT_HASH  # the parent hash of its first block (`root_hash` of its salt)
  dropped: int = 0  # leading blocks released by `drop_before`


class BlockAllocator:
  """Assigns the pool's blocks to sequences.

  Args:
    n_blocks: P, blocks in the pool.
    block_size: Z, token slots per block.
    enable_prefix_caching: keep and reuse full blocks by prefix hash.
  """

  def __init__(
    self,
    n_blocks: int,
    block_size: int,
    *,
    enable_prefix_caching: bool = True,
    window: int | None = None,
  ):
    for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockAllocator: {name} must be a positive int, got {value!r}")
    if window is not None and (not isinstance(window, int) or window < 1):
      raise ValueError(f"BlockAllocator: window must be a positive int or None, got {window!r}")
    self.n_blocks = n_blocks
    self.block_size = block_size
    self.enable_prefix_caching = enable_prefix_caching
    # W when the layers this pool serves attend within a sliding window of W positions: a
    # prefix hit then needs only the blocks inside the window of its first computed token.
    self.window = window
    # Popped from the left, so low block ids are handed out first (deterministic tables).
    self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))
    self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
    self._ref = [0] * n_blocks
    self._fill = [0] * n_blocks  # token slots written in each physical block
    self._hash_of: dict[int, bytes] = {}
    self._block_of: dict[bytes, int] = {}
    self._seqs: dict[SeqId, _Sequence] = {}
    self._prefix_query_tokens = 0
    self._prefix_hit_tokens = 0
    self._n_evictions = 0
    self._n_copies = 0

  # -- queries -------------------------------------------------------------------------------

  @property
  def n_available(self) -> int:
    """Blocks that can be handed out now: free plus evictable cached ones."""
    return len(self._free) + len(self._cached)

  def __contains__(self, seq_id: SeqId) -> bool:
    return seq_id in self._seqs

  def sequences(self) -> list[SeqId]:
    return list(self._seqs)

  def blocks(self, seq_id: SeqId) -> list[int]:
    return list(self._get(seq_id).blocks)

  def tokens(self, seq_id: SeqId) -> list[int]:
    return list(self._get(seq_id).tokens)

  def length(self, seq_id: SeqId) -> int:
    return len(self._get(seq_id).tokens)

  def ref_count(self, block: int) -> int:
    return self._ref[block]

  def free_blocks(self) -> list[int]:
    return list(self._free)

  def cached_blocks(self) -> list[int]:
    """Unreferenced cached blocks, least recently used first."""
    return list(self._cached)

  def slots(self, seq_id: SeqId, start: int, stop: int) -> np.ndarray:
    """i32[stop - start]: the pool slot (block * Z + offset) of token positions [start, stop)."""
    seq = self._get(seq_id)
    if not 0 <= start <= stop <= len(seq.tokens):
      raise ValueError(
        f"slots: need 0 <= start <= stop <= length={len(seq.tokens)}, got [{start}, {stop})"
      )
    pos = np.arange(start, stop)
    blocks = np.asarray(seq.blocks, np.int64)[pos // self.block_size] if stop > start else pos
    return (blocks * self.block_size + pos % self.block_size).astype(np.int32)

  def block_table(
    self, seq_ids: Sequence[SeqId], max_blocks: int, *, pad: int = 0
  ) -> tuple[np.ndarray, np.ndarray]:
    """(i32[B, max_blocks] block table, i32[B] lengths) for a batch; padding entries, and those of
    dropped blocks (`drop_before`), are `pad`."""
    table = np.full((len(seq_ids), max_blocks), pad, np.int32)
    lengths = np.zeros((len(seq_ids),), np.int32)
    for row, seq_id in enumerate(seq_ids):
      seq = self._get(seq_id)
      if len(seq.blocks) > max_blocks:
        raise ValueError(
          f"block_table: sequence {seq_id!r} holds {len(seq.blocks)} blocks > "
          f"max_blocks={max_blocks}"
        )
      table[row, : len(seq.blocks)] = [pad if b == DROPPED else b for b in seq.blocks]
      lengths[row] = len(seq.tokens)
    return table, lengths

  def stats(self) -> AllocatorStats:
    used = [b for b in range(self.n_blocks) if self._ref[b] > 0]
    return AllocatorStats(
      n_blocks=self.n_blocks,
      block_size=self.block_size,
      n_free=len(self._free),
      n_cached=len(self._cached),
      n_used=len(used),
      filled_slots=sum(self._fill[b] for b in used),
      logical_tokens=sum(len(s.tokens) for s in self._seqs.values()),
      prefix_query_tokens=self._prefix_query_tokens,
      prefix_hit_tokens=self._prefix_hit_tokens,
      n_evictions=self._n_evictions,
      n_copies=self._n_copies,
    )

  def cached_prefix_length(
    self, prompt: Sequence[int], *, salt: bytes = b"", limit: int | None = None
  ) -> int:
    """Leading tokens of `prompt` that `add_sequence` (with the same `salt` and `limit`) would
    serve from the prefix cache.

    A read-only lookup: nothing is allocated, referenced or hashed into the cache (a block's hash
    may only be registered once its K/V are computed).
    """
    return self._hit_blocks(self._chain(prompt, salt), limit) * self.block_size

  def _chain(self, prompt: Sequence[int], salt: bytes) -> list[bytes]:
    """The chained hashes of the prompt's full blocks before its last token (which is always
    recomputed)."""
    Z, parent, out = self.block_size, root_hash(salt), []
    for i in range((len(prompt) - 1) // Z if len(prompt) else 0):
      parent = block_hash(parent, prompt[i * Z : (i + 1) * Z])
      out.append(parent)
    return out

  def _first_read(self, n_hit: int) -> int:
    """The first block the token after `n_hit` cached blocks reads: 0, or with a window the
    one holding position n_hit * Z - W + 1."""
    if self.window is None:
      return 0
    return max(0, n_hit * self.block_size - self.window + 1) // self.block_size

  def _hit_blocks(self, chain: list[bytes], limit: int | None) -> int:
    """How many of the chain's blocks a new sequence starts with (at most `limit` tokens'
    worth): the longest run from the first block that is cached; with a window, the most
    blocks whose last ones, from `_first_read` on, are cached (earlier ones are never read)."""
    if not self.enable_prefix_caching:
      return 0
    n = len(chain) if limit is None else min(len(chain), max(0, limit) // self.block_size)
    run = 0  # cached blocks in a row ending at block k - 1
    best = 0
    for k in range(1, n + 1):
      run = run + 1 if chain[k - 1] in self._block_of else 0
      if self.window is None and run < k:
        break
      if run >= k - self._first_read(k):
        best = k
    return best

  # -- operations ----------------------------------------------------------------------------

  def add_sequence(
    self, seq_id: SeqId, prompt: Sequence[int], *, salt: bytes = b"", limit: int | None = None
  ) -> int:
    """Starts a sequence holding `prompt`, reusing the longest cached chain of its full blocks
    among those hashed under the same `salt` (b"": none), at most `limit` tokens of it.

    The last prompt token is never served from the cache, so the model always computes at least
    one token (whose logits start generation); a prompt that is a whole number of cached blocks
    recomputes its last block into a fresh block. With a window, the cached blocks before the
    window of the first computed token are not taken: their places hold `DROPPED`.

    Returns:
      The number of leading prompt tokens whose K/V are already in the pool (a multiple of Z);
      the caller computes and writes tokens from there on.

    Raises:
      DuplicateSequenceError: `seq_id` is live.
      OutOfBlocksError: the uncached part needs more blocks than are available.
    """
    if seq_id in self._seqs:
      raise DuplicateSequenceError(f"add_sequence: sequence {seq_id!r} already exists")
    prompt = [int(t) for t in prompt]
    Z = self.block_size
    chain = self._chain(prompt, salt)
    n_hit = self._hit_blocks(chain, limit)
    first = self._first_read(n_hit)
    hits = [self._block_of[h] for h in chain[first:n_hit]]
    n_new = -(-len(prompt) // Z) - n_hit
    # Reviving a cached hit takes it out of the evictable set, so it counts against availability.
    n_revived = sum(1 for b in hits if self._ref[b] == 0)
    if n_new + n_revived > self.n_available:
      raise OutOfBlocksError(
        f"add_sequence: sequence {seq_id!r} with {len(prompt)} prompt tokens needs {n_new} new "
        f"blocks (+{n_revived} cached ones revived), only {self.n_available} available"
      )
    for block in hits:
      self._take(block)
    seq = _Sequence(
      blocks=[DROPPED] * first + hits,
      tokens=prompt[: n_hit * Z],
      hashes=chain[:n_hit],
      root=root_hash(salt),
      dropped=first,
    )
    self._seqs[seq_id] = seq
    self._prefix_query_tokens += len(prompt)
    self._prefix_hit_tokens += n_hit * Z
    copies = self._extend(seq, prompt[n_hit * Z :])
    assert not copies, "a fresh sequence owns its partial block"
    return n_hit * Z

  def add_cost(self, prompt: Sequence[int], *, salt: bytes = b"", limit: int | None = None) -> int:
    """Blocks `add_sequence` would take from the available ones (new plus revived cached)."""
    chain = self._chain(prompt, salt)
    n_hit = self._hit_blocks(chain, limit)
    hits = [self._block_of[h] for h in chain[self._first_read(n_hit) : n_hit]]
    n_new = -(-len(prompt) // self.block_size) - n_hit
    return n_new + sum(1 for b in hits if self._ref[b] == 0)

  def append(self, seq_id: SeqId, tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Appends tokens to a sequence, allocating blocks as the last one fills.

    Returns:
      Copy-on-write pairs (src_block, dst_block): the sequence's partial last block was shared
      (after `fork`), so it now writes into a private copy; the caller must copy the device data
      of src into dst before writing the new tokens.

    Raises:
      UnknownSequenceError, OutOfBlocksError.
    """
    seq = self._get(seq_id)
    tokens = [int(t) for t in tokens]
    needed = self._blocks_needed(seq, len(tokens))
    if needed > self.n_available:
      raise OutOfBlocksError(
        f"append: sequence {seq_id!r} (length {len(seq.tokens)}) needs {needed} blocks for "
        f"{len(tokens)} tokens, only {self.n_available} available"
      )
    return self._extend(seq, tokens)

  def blocks_needed(self, seq_id: SeqId, n_tokens: int) -> int:
    """Blocks that `append` or `reserve` of `n_tokens` more tokens would take from the pool."""
    return self._blocks_needed(self._get(seq_id), n_tokens)

  def can_reserve(self, seq_ids: Sequence[SeqId], n_tokens: int) -> bool:
    """Whether `reserve(seq_id, n_tokens)` of every one of `seq_ids` fits the available blocks."""
    return sum(self.blocks_needed(s, n_tokens) for s in seq_ids) <= self.n_available

  def reserve(self, seq_id: SeqId, n_tokens: int) -> list[tuple[int, int]]:
    """Makes room for `n_tokens` more tokens before their values are known.

    A burst of decode steps writes K/V for tokens the host has not seen yet; the blocks for them
    are taken now and filled by `append` once the tokens are read back. `truncate` to the
    sequence's length gives back what was not used. `block_table` includes reserved blocks.

    Returns:
      Copy-on-write pairs, as `append`: the block the next token goes into was shared.

    Raises:
      UnknownSequenceError, OutOfBlocksError (nothing changed).
    """
    seq = self._get(seq_id)
    needed = self._blocks_needed(seq, n_tokens)
    if needed > self.n_available:
      raise OutOfBlocksError(
        f"reserve: sequence {seq_id!r} (length {len(seq.tokens)}) needs {needed} blocks for "
        f"{n_tokens} tokens, only {self.n_available} available"
      )
    copies = [self._copy_next_block(seq)] if n_tokens and self._next_block_shared(seq) else []
    while len(seq.blocks) * self.block_size < len(seq.tokens) + n_tokens:
      seq.blocks.append(self._new_block())
    return copies

  def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
    """Starts `child_id` as a copy of `parent_id` that shares all of its blocks."""
    parent = self._get(parent_id)
    if child_id in self._seqs:
      raise DuplicateSequenceError(f"fork: sequence {child_id!r} already exists")
    for block in parent.blocks:
      if block != DROPPED:
        self._ref[block] += 1
    self._seqs[child_id] = _Sequence(
      blocks=list(parent.blocks),
      tokens=list(parent.tokens),
      hashes=list(parent.hashes),
      root=parent.root,
      dropped=parent.dropped,
    )

  def truncate(self, seq_id: SeqId, length: int) -> list[tuple[int, int]]:
    """Drops a sequence's tokens from position `length` on, releasing the blocks past it.

    A fork that recomputes its parent's last token, or speculative decoding rolling back rejected
    drafts, starts from here. The kept last block, if now partial, is about to be written again,
    so it must be the sequence's own: a shared one is copied now (copy-on-write), and a private one
    that the prefix cache had registered as full is withdrawn from the cache.

    Returns:
      Copy-on-write pairs (src_block, dst_block) whose device data the caller must copy.

    Raises:
      UnknownSequenceError; ValueError for a length outside [0, current length];
      OutOfBlocksError when the copy needs a block and none is available.
    """
    seq = self._get(seq_id)
    if not 0 <= length <= len(seq.tokens):
      raise ValueError(
        f"truncate: length={length} must be in [0, {len(seq.tokens)}] for sequence {seq_id!r}"
      )
    Z = self.block_size
    keep = -(-length // Z)
    if keep < seq.dropped or (length % Z and keep == seq.dropped):
      raise ValueError(
        f"truncate: length={length} reaches into sequence {seq_id!r}'s dropped blocks (the first "
        f"{seq.dropped * Z} positions)"
      )
    tail = seq.blocks[keep - 1] if length % Z else None
    if tail is not None and self._ref[tail] > 1:
      released = sum(1 for b in seq.blocks[keep:] if self._ref[b] == 1)
      if self.n_available + released < 1:
        raise OutOfBlocksError(
          f"truncate: sequence {seq_id!r} needs a block to copy its shared last block, none "
          "available"
        )
    for block in reversed(seq.blocks[keep:]):
      self._release(block)
    del seq.blocks[keep:], seq.tokens[length:], seq.hashes[length // Z :]
    if tail is None:
      return []
    if self._ref[tail] > 1:
      dst = self._new_block()
      self._ref[tail] -= 1
      self._fill[dst] = length % Z
      seq.blocks[-1] = dst
      self._n_copies += 1
      return [(tail, dst)]
    h = self._hash_of.pop(tail, None)
    if h is not None:
      del self._block_of[h]
    self._fill[tail] = length % Z
    return []

  def free(self, seq_id: SeqId, *, computed: int | None = None) -> None:
    """Releases a sequence's blocks; its hashed full blocks stay cached until evicted.

    Args:
      computed: how many leading tokens have their K/V written in the pool (default: all). A
        full block past them leaves the prefix cache, since its hash promises K/V the pool does
        not hold (a step that failed before writing them).
    """
    seq = self._get(seq_id)
    if computed is not None:
      for i, block in enumerate(seq.blocks):
        if (i + 1) * self.block_size > computed and i < len(seq.hashes):
          if self._hash_of.get(block) == seq.hashes[i]:
            del self._block_of[self._hash_of.pop(block)]
    del self._seqs[seq_id]
    # Release the tail first so that, among this sequence's blocks, the tail is evicted first
    # and the more widely useful prefix blocks survive longest.
    for block in reversed(seq.blocks):
      if block != DROPPED:
        self._release(block)

  def drop_before(self, seq_id: SeqId, position: int) -> int:
    """Releases the sequence's blocks that lie wholly before token `position` (no later token
    reads them: a sliding window's bound) and returns how many it released. Their places hold
    `DROPPED`; hashed ones stay in the prefix cache until evicted.

    Raises:
      UnknownSequenceError; ValueError for a position past the sequence's length.
    """
    seq = self._get(seq_id)
    if position > len(seq.tokens):
      raise ValueError(
        f"drop_before: position={position} is past sequence {seq_id!r}'s length {len(seq.tokens)}"
      )
    first, stop = seq.dropped, max(0, position) // self.block_size
    for i in range(first, stop):
      self._release(seq.blocks[i])
      seq.blocks[i] = DROPPED
    seq.dropped = max(first, stop)
    return max(0, stop - first)

  # -- internals -----------------------------------------------------------------------------

  def _get(self, seq_id: SeqId) -> _Sequence:
    try:
      return self._seqs[seq_id]
    except KeyError:
      raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never added, or freed)") from None

  def _blocks_needed(self, seq: _Sequence, n_tokens: int) -> int:
    """Blocks that writing n_tokens more tokens takes: new ones past the held (or reserved)
    blocks, plus a copy of the block the next token goes into if it is shared."""
    if n_tokens == 0:
      return 0
    Z = self.block_size
    n_new = max(0, -(-(len(seq.tokens) + n_tokens) // Z) - len(seq.blocks))
    return n_new + self._next_block_shared(seq)

  def _next_block_shared(self, seq: _Sequence) -> bool:
    i = len(seq.tokens) // self.block_size
    return i < len(seq.blocks) and self._ref[seq.blocks[i]] > 1

  def _copy_next_block(self, seq: _Sequence) -> tuple[int, int]:
    """Copy-on-write of the shared block the next token goes into: (src, dst)."""
    i = len(seq.tokens) // self.block_size
    src = seq.blocks[i]
    dst = self._new_block()
    self._fill[dst] = self._fill[src]
    self._ref[src] -= 1
    seq.blocks[i] = dst
    self._n_copies += 1
    return src, dst

  def _release(self, block: int) -> None:
    """Drops one reference; an unreferenced block is cached (if hashed) or freed."""
    self._ref[block] -= 1
    if self._ref[block] > 0:
      return
    if block in self._hash_of:
      self._cached[block] = None
    else:
      self._fill[block] = 0
      self._free[block] = None

  def _take(self, block: int) -> None:
    """Adds a reference to a hashed block found in the cache."""
    if self._ref[block] == 0:
      del self._cached[block]
    self._ref[block] += 1

  def _new_block(self) -> int:
    if self._free:
      block, _ = self._free.popitem(last=False)
    else:
      block, _ = self._cached.popitem(last=False)
      del self._block_of[self._hash_of.pop(block)]
      self._n_evictions += 1
    self._ref[block] = 1
    self._fill[block] = 0
    return block

  def _extend(self, seq: _Sequence, tokens: list[int]) -> list[tuple[int, int]]:
    """Writes tokens into the sequence's blocks (reserved ones first, then new ones);
    availability was checked by the caller."""
    Z = self.block_size
    copies: list[tuple[int, int]] = []
    pos = 0
    while pos < len(tokens):
      offset, i = len(seq.tokens) % Z, len(seq.tokens) // Z
      if i == len(seq.blocks):
        seq.blocks.append(self._new_block())
      elif self._ref[seq.blocks[i]] > 1:
        copies.append(self._copy_next_block(seq))
      take = min(Z - offset, len(tokens) - pos)
      seq.tokens.extend(tokens[pos : pos + take])
      block = seq.blocks[i]
      self._fill[block] = offset + take
      pos += take
      if offset + take == Z:
        self._seal(seq, block)
    return copies

  def _seal(self, seq: _Sequence, block: int) -> None:
    """Hashes a block that just became full and offers it to the prefix cache."""
    Z = self.block_size
    i = len(seq.tokens) // Z - 1
    parent = seq.hashes[-1] if seq.hashes else seq.root
    h = block_hash(parent, seq.tokens[i * Z : (i + 1) * Z])
    seq.hashes.append(h)
    # A duplicate of an already cached prefix stays unhashed: one block per hash.
    if self.enable_prefix_caching and h not in self._block_of:
      self._block_of[h] = block
      self._hash_of[block] = h


class HybridAllocator:
  """One set of sequences over two pools: the blocks of the layers that attend to everything
  (`full`) and of those that attend within a sliding window of W positions (`sliding`), as
  vLLM's hybrid KV-cache manager keeps a block table per group of layers.

  Every operation applies to both, checked on both before either changes. The sliding group
  lets go of the blocks that left the window (`drop_before`, that group only) and takes a prefix
  hit's blocks only inside the window of the first computed token; a prefix hit is the longest
  that both can serve. `blocks` are the full group's ids and `window_blocks` the sliding
  group's; copy-on-write pairs of the sliding group come back offset by `full.n_blocks`, so one
  list names both pools' copies.
  """

  def __init__(
    self,
    n_blocks: int,
    n_window_blocks: int,
    block_size: int,
    window: int,
    *,
    enable_prefix_caching: bool = True,
  ):
    self.full = BlockAllocator(n_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    self.sliding = BlockAllocator(
      n_window_blocks, block_size, enable_prefix_caching=enable_prefix_caching, window=window
    )
    self.n_blocks, self.block_size, self.window = n_blocks, block_size, window
    self.enable_prefix_caching = enable_prefix_caching

  def _both(self) -> tuple[BlockAllocator, BlockAllocator]:
    return self.full, self.sliding

  def _merge(self, full_pairs, sliding_pairs) -> list[tuple[int, int]]:
    shift = self.full.n_blocks
    return [*full_pairs, *((s + shift, d + shift) for s, d in sliding_pairs)]

  def _check(self, needed: tuple[int, int], what: str) -> None:
    for alloc, n, group in zip(self._both(), needed, ("full", "sliding")):
      if n > alloc.n_available:
        raise OutOfBlocksError(
          f"{what} needs {n} blocks of the {group}-attention layers' pool, only "
          f"{alloc.n_available} available"
        )

  # -- queries -------------------------------------------------------------------------------

  @property
  def n_available(self) -> int:
    """Blocks of the scarcer pool that can be handed out now."""
    return min(a.n_available for a in self._both())

  def __contains__(self, seq_id: SeqId) -> bool:
    return seq_id in self.full

  def sequences(self) -> list[SeqId]:
    return self.full.sequences()

  def blocks(self, seq_id: SeqId) -> list[int]:
    return self.full.blocks(seq_id)

  def window_blocks(self, seq_id: SeqId) -> list[int]:
    return self.sliding.blocks(seq_id)

  def tokens(self, seq_id: SeqId) -> list[int]:
    return self.full.tokens(seq_id)

  def length(self, seq_id: SeqId) -> int:
    return self.full.length(seq_id)

  def stats(self) -> AllocatorStats:
    """The full group's occupancy and counters (the sliding group's: `sliding.stats()`)."""
    return self.full.stats()

  def cached_prefix_length(
    self, prompt: Sequence[int], *, salt: bytes = b"", limit: int | None = None
  ) -> int:
    full = self.full.cached_prefix_length(prompt, salt=salt, limit=limit)
    return self.sliding.cached_prefix_length(prompt, salt=salt, limit=full)

  def blocks_needed(self, seq_id: SeqId, n_tokens: int) -> int:
    return max(a.blocks_needed(seq_id, n_tokens) for a in self._both())

  def can_reserve(self, seq_ids: Sequence[SeqId], n_tokens: int) -> bool:
    return all(a.can_reserve(seq_ids, n_tokens) for a in self._both())

  # -- operations ----------------------------------------------------------------------------

  def add_sequence(
    self, seq_id: SeqId, prompt: Sequence[int], *, salt: bytes = b"", limit: int | None = None
  ) -> int:
    if seq_id in self.full:
      raise DuplicateSequenceError(f"add_sequence: sequence {seq_id!r} already exists")
    hit = self.cached_prefix_length(prompt, salt=salt, limit=limit)
    needed = tuple(a.add_cost(prompt, salt=salt, limit=hit) for a in self._both())
    self._check(needed, f"add_sequence: sequence {seq_id!r} with {len(prompt)} prompt tokens")
    for alloc in self._both():
      got = alloc.add_sequence(seq_id, prompt, salt=salt, limit=hit)
      assert got == hit, (got, hit)
    return hit

  def append(self, seq_id: SeqId, tokens: Sequence[int]) -> list[tuple[int, int]]:
    needed = tuple(a.blocks_needed(seq_id, len(tokens)) for a in self._both())
    self._check(needed, f"append: sequence {seq_id!r}, {len(tokens)} tokens,")
    return self._merge(*(a.append(seq_id, tokens) for a in self._both()))

  def reserve(self, seq_id: SeqId, n_tokens: int) -> list[tuple[int, int]]:
    needed = tuple(a.blocks_needed(seq_id, n_tokens) for a in self._both())
    self._check(needed, f"reserve: sequence {seq_id!r}, {n_tokens} tokens,")
    return self._merge(*(a.reserve(seq_id, n_tokens) for a in self._both()))

  def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
    for alloc in self._both():
      alloc.fork(parent_id, child_id)

  def truncate(self, seq_id: SeqId, length: int) -> list[tuple[int, int]]:
    # The sliding group first: it alone may refuse a length inside its dropped blocks.
    sliding = self.sliding.truncate(seq_id, length)
    return self._merge(self.full.truncate(seq_id, length), sliding)

  def free(self, seq_id: SeqId, *, computed: int | None = None) -> None:
    for alloc in self._both():
      alloc.free(seq_id, computed=computed)

  def drop_before(self, seq_id: SeqId, position: int) -> int:
    """Releases the sliding group's blocks wholly before `position` (`BlockAllocator.drop_before`);
    the full group keeps every block."""
    return self.sliding.drop_before(seq_id, position)
