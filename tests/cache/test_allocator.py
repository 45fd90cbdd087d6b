"""Block allocator: exact unit cases, then random operation sequences against a simple model."""

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from atlas_jax.cache.allocator import (
  BlockAllocator,
  DuplicateSequenceError,
  OutOfBlocksError,
  UnknownSequenceError,
)


def snapshot(alloc: BlockAllocator):
  """Everything observable about the allocator, to check that a failed call changed nothing."""
  seqs = {s: (alloc.blocks(s), alloc.tokens(s)) for s in alloc.sequences()}
  refs = [alloc.ref_count(b) for b in range(alloc.n_blocks)]
  return alloc.free_blocks(), alloc.cached_blocks(), refs, seqs, alloc.stats()


def check_invariants(alloc: BlockAllocator) -> None:
  free, cached = alloc.free_blocks(), alloc.cached_blocks()
  assert len(free) == len(set(free)), "a block twice in the free list"
  assert len(cached) == len(set(cached))
  assert not set(free) & set(cached)
  holders = [0] * alloc.n_blocks
  for s in alloc.sequences():
    blocks = alloc.blocks(s)
    assert len(blocks) == len(set(blocks)), f"{s} holds a block twice"
    assert len(blocks) == -(-alloc.length(s) // alloc.block_size)
    for b in blocks:
      holders[b] += 1
  for b in range(alloc.n_blocks):
    assert alloc.ref_count(b) == holders[b], f"block {b}: ref {alloc.ref_count(b)} != {holders[b]}"
  used = sum(1 for h in holders if h)
  assert all(holders[b] == 0 for b in free + cached)
  stats = alloc.stats()
  assert len(free) + len(cached) + used == alloc.n_blocks == stats.n_blocks
  assert (stats.n_free, stats.n_cached, stats.n_used) == (len(free), len(cached), used)


def test_append_allocates_a_block_when_the_last_is_full():
  alloc = BlockAllocator(8, 4)
  assert alloc.add_sequence("a", range(5)) == 0
  assert alloc.blocks("a") == [0, 1]
  assert alloc.append("a", [5, 6, 7]) == []
  assert alloc.blocks("a") == [0, 1]
  alloc.append("a", [8])
  assert alloc.blocks("a") == [0, 1, 2]
  assert alloc.length("a") == 9
  assert list(alloc.slots("a", 3, 9)) == [3, 4, 5, 6, 7, 8]
  table, lengths = alloc.block_table(["a"], 4, pad=-1)
  assert table.tolist() == [[0, 1, 2, -1]] and lengths.tolist() == [9]
  with pytest.raises(ValueError, match="max_blocks=2"):
    alloc.block_table(["a"], 2)
  check_invariants(alloc)


def test_prefix_cache_reuses_the_longest_full_block_chain():
  alloc = BlockAllocator(16, 4)
  alloc.add_sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
  # Two full blocks shared, then the prompts diverge inside block 2.
  assert alloc.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 98]) == 8
  assert alloc.blocks("b")[:2] == alloc.blocks("a")[:2]
  assert alloc.blocks("b")[2] != alloc.blocks("a")[2]
  assert [alloc.ref_count(b) for b in alloc.blocks("a")] == [2, 2, 1]
  # Divergence in the first block: the chain breaks there even though block 1 matches.
  assert alloc.add_sequence("c", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
  # The last prompt token is always computed: 8 cached tokens serve only one block of an
  # 8-token prompt.
  assert alloc.add_sequence("d", [1, 2, 3, 4, 5, 6, 7, 8]) == 4
  stats = alloc.stats()
  assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (10 + 11 + 9 + 8, 8 + 0 + 4)
  check_invariants(alloc)


def test_a_salt_keeps_prefix_chains_apart():
  """Blocks hashed under one salt (a LoRA adapter's identity) serve that salt only, the chain
  sealed by a fork or by appends included."""
  alloc = BlockAllocator(32, 4)
  prompt = list(range(1, 11))
  alloc.add_sequence("a", prompt, salt=b"lora:x:1")
  alloc.fork("a", "a2")
  alloc.append("a2", [11, 12])  # seals block 2 under the parent's salt
  assert alloc.cached_prefix_length(prompt + [11, 12, 13], salt=b"lora:x:1") == 12
  assert alloc.cached_prefix_length(prompt, salt=b"lora:x:2") == 0
  assert alloc.cached_prefix_length(prompt) == 0
  assert alloc.add_sequence("b", prompt, salt=b"lora:x:1") == 8
  assert alloc.blocks("b")[:2] == alloc.blocks("a")[:2]
  assert alloc.add_sequence("c", prompt) == 0
  assert alloc.add_sequence("e", prompt) == 8 and alloc.blocks("e")[:2] == alloc.blocks("c")[:2]
  assert not set(alloc.blocks("c")) & set(alloc.blocks("a"))
  check_invariants(alloc)


def test_freed_blocks_stay_cached_until_evicted_in_lru_order():
  alloc = BlockAllocator(6, 2)
  alloc.add_sequence("a", [1, 2, 3, 4, 5])  # blocks 0 1 2, full ones: 0 1
  alloc.add_sequence("b", [7, 8, 9])  # blocks 3 4, full one: 3
  alloc.free("a")
  alloc.free("b")
  # Tails are released first, so within a sequence the prefix block is the last to go.
  assert alloc.cached_blocks() == [1, 0, 3]
  assert sorted(alloc.free_blocks()) == [2, 4, 5]
  assert alloc.add_sequence("c", [1, 2, 3, 4, 0]) == 4
  assert alloc.blocks("c")[:2] == [0, 1]
  assert alloc.cached_blocks() == [3]
  # Needs 3 blocks, 2 are free: the LRU cached block (3, prefix [7, 8]) is evicted.
  alloc.add_sequence("d", [5, 5, 5, 5, 5])
  assert alloc.stats().n_evictions == 1
  alloc.free("d")
  assert alloc.cached_blocks() == [4, 2]  # d's tail block 4 is now least recently used
  assert alloc.add_sequence("f", [7, 8, 9]) == 0  # evicted above
  assert alloc.stats().n_evictions == 2  # f needed two blocks, one free: block 4 went
  alloc.free("c")
  assert alloc.add_sequence("e", [5, 5, 5, 5, 1]) == 2  # d's first block survived, not its tail
  check_invariants(alloc)


def test_fork_shares_and_copy_on_write_splits_the_partial_block():
  alloc = BlockAllocator(8, 4)
  alloc.add_sequence("p", [1, 2, 3, 4, 5, 6])
  alloc.fork("p", "c")
  assert alloc.blocks("c") == alloc.blocks("p") == [0, 1]
  assert [alloc.ref_count(b) for b in (0, 1)] == [2, 2]
  copies = alloc.append("c", [7])
  assert copies == [(1, 2)]
  assert alloc.blocks("c") == [0, 2] and alloc.blocks("p") == [0, 1]
  assert [alloc.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
  assert alloc.append("p", [9]) == []  # p is now the block's only holder: write in place
  assert alloc.tokens("p") == [1, 2, 3, 4, 5, 6, 9] and alloc.tokens("c")[-1] == 7
  # A full shared block is never written: appending starts a new block, no copy.
  alloc.append("p", [10])
  alloc.fork("p", "q")
  assert alloc.append("q", [11]) == []
  assert alloc.stats().n_copies == 1
  check_invariants(alloc)


def test_truncate_releases_blocks_and_copies_a_shared_tail():
  alloc = BlockAllocator(8, 4)
  alloc.add_sequence("p", list(range(10)))  # blocks 0, 1 full and hashed; 2 partial
  alloc.fork("p", "c")
  assert alloc.truncate("c", 9) == [(2, 3)]  # its last block is shared and partial: copied
  assert alloc.blocks("c") == [0, 1, 3] and alloc.ref_count(2) == 1
  assert alloc.append("c", [99]) == []
  assert alloc.tokens("c") == list(range(9)) + [99] and alloc.tokens("p") == list(range(10))
  alloc.truncate("c", 8)  # drops block 3 (private): back to the free list
  assert alloc.blocks("c") == [0, 1] and 3 in alloc.free_blocks()
  # A private full block that the prefix cache holds is withdrawn when truncated into.
  alloc.free("p")
  alloc.truncate("c", 6)
  assert alloc.cached_prefix_length(list(range(8)) + [5]) == 4
  with pytest.raises(ValueError, match=r"length=7 must be in \[0, 6\]"):
    alloc.truncate("c", 7)
  check_invariants(alloc)


def test_errors_are_clear_and_change_nothing():
  alloc = BlockAllocator(4, 4)
  alloc.add_sequence("a", range(9))
  before = snapshot(alloc)
  with pytest.raises(OutOfBlocksError, match="needs 2 new blocks"):
    alloc.add_sequence("b", range(100, 108))
  with pytest.raises(OutOfBlocksError, match="needs 2 blocks"):
    alloc.append("a", range(3 + 5))
  with pytest.raises(UnknownSequenceError, match="unknown sequence 'zz'"):
    alloc.append("zz", [1])
  with pytest.raises(DuplicateSequenceError):
    alloc.add_sequence("a", [1])
  with pytest.raises(DuplicateSequenceError):
    alloc.fork("a", "a")
  assert snapshot(alloc) == before
  alloc.free("a")
  with pytest.raises(UnknownSequenceError, match="freed"):
    alloc.free("a")
  with pytest.raises(ValueError, match="block_size"):
    BlockAllocator(4, 0)
  check_invariants(alloc)


def test_copy_on_write_counts_against_availability():
  alloc = BlockAllocator(3, 4)
  alloc.add_sequence("p", range(6))
  alloc.fork("p", "c")
  alloc.add_sequence("x", range(50, 53))  # the last free block
  before = snapshot(alloc)
  # One token fits in c's partial block, but that block is shared: it needs a copy.
  with pytest.raises(OutOfBlocksError, match="needs 1 blocks for 1 tokens"):
    alloc.append("c", [9])
  assert snapshot(alloc) == before
  alloc.free("x")
  assert alloc.append("c", [9]) == [(1, 2)]
  check_invariants(alloc)


def test_prefix_caching_disabled_never_shares():
  alloc = BlockAllocator(8, 2, enable_prefix_caching=False)
  alloc.add_sequence("a", [1, 2, 3, 4])
  alloc.free("a")
  assert alloc.cached_blocks() == []
  assert alloc.add_sequence("b", [1, 2, 3, 4]) == 0
  check_invariants(alloc)


class AllocatorMachine(RuleBasedStateMachine):
  """Random operations against a model: token lists per sequence and fake device memory.

  The harness plays the engine: it copies device blocks as `append` says and writes each new
  token into its slot, asserting the block is unshared. Reading every sequence back through its
  block table then checks sharing, copy-on-write and prefix reuse end to end.
  """

  @initialize(n_blocks=st.integers(3, 14), block_size=st.sampled_from([1, 2, 3, 4]))
  def setup(self, n_blocks, block_size):
    self.alloc = BlockAllocator(n_blocks, block_size)
    self.Z = block_size
    self.device = [[None] * block_size for _ in range(n_blocks)]
    self.model: dict[int, list[int]] = {}
    self.completed: set[tuple[int, ...]] = set()  # every full-block prefix ever written
    self.next_id = 0
    self.dead: list[int] = []
    self.truncated = False  # a truncation may withdraw a cached block: hits are then a lower bound

  def _write(self, seq_id, start):
    tokens = self.model[seq_id]
    for pos, slot in zip(range(start, len(tokens)), self.alloc.slots(seq_id, start, len(tokens))):
      block, offset = divmod(int(slot), self.Z)
      assert self.alloc.ref_count(block) == 1, "wrote into a shared block"
      self.device[block][offset] = tokens[pos]
      if (pos + 1) % self.Z == 0:
        self.completed.add(tuple(tokens[: pos + 1]))

  def _expected_hit(self, prompt):
    k = 0
    while (k + 1) * self.Z <= len(prompt) - 1 and tuple(
      prompt[: (k + 1) * self.Z]
    ) in self.completed:
      k += 1
    return k * self.Z

  @rule(
    prefix=st.sampled_from([(), (1, 2, 1, 2, 1, 2, 1, 2), (1, 2, 1, 2, 3), (3, 3, 3, 3, 3, 3)]),
    suffix=st.lists(st.integers(0, 3), max_size=6),
  )
  def add(self, prefix, suffix):
    prompt = list(prefix) + suffix
    seq_id = self.next_id
    self.next_id += 1
    before = snapshot(self.alloc)
    evictions = self.alloc.stats().n_evictions
    try:
      hit = self.alloc.add_sequence(seq_id, prompt)
    except OutOfBlocksError:
      assert snapshot(self.alloc) == before
      return
    assert hit % self.Z == 0 and hit <= max(len(prompt) - 1, 0)
    expected = self._expected_hit(prompt)
    if evictions == 0 and not self.truncated:
      assert hit == expected  # nothing ever evicted: every completed prefix is still cached
    else:
      assert hit <= expected
    self.model[seq_id] = prompt
    self._write(seq_id, hit)

  @precondition(lambda self: self.model)
  @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=7))
  def append(self, data, tokens):
    seq_id = data.draw(st.sampled_from(sorted(self.model)))
    blocks = self.alloc.blocks(seq_id)
    length = self.alloc.length(seq_id)
    room = len(blocks) * self.Z - length
    shared_partial = room > 0 and self.alloc.ref_count(blocks[-1]) > 1
    needed = max(0, -(-(len(tokens) - room) // self.Z)) + shared_partial
    before = snapshot(self.alloc)
    try:
      copies = self.alloc.append(seq_id, tokens)
    except OutOfBlocksError:
      assert needed > before[-1].n_free + before[-1].n_cached
      assert snapshot(self.alloc) == before
      return
    assert needed <= before[-1].n_free + before[-1].n_cached
    assert len(copies) == shared_partial
    for src, dst in copies:
      self.device[dst] = list(self.device[src])
    self.model[seq_id] = self.model[seq_id] + tokens
    self._write(seq_id, length)

  @precondition(lambda self: self.model)
  @rule(data=st.data())
  def fork(self, data):
    parent = data.draw(st.sampled_from(sorted(self.model)))
    child = self.next_id
    self.next_id += 1
    self.alloc.fork(parent, child)
    self.model[child] = list(self.model[parent])

  @precondition(lambda self: self.model)
  @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=7))
  def reserve_write_release(self, data, tokens):
    """A decode burst: reserve slots, write K/V into them on the device, learn the tokens, append
    the ones kept (a stop may cut the burst short) and give back the rest."""
    seq_id = data.draw(st.sampled_from(sorted(self.model)))
    length = self.alloc.length(seq_id)
    before = snapshot(self.alloc)
    try:
      copies = self.alloc.reserve(seq_id, len(tokens))
    except OutOfBlocksError:
      assert snapshot(self.alloc) == before
      return
    for src, dst in copies:
      self.device[dst] = list(self.device[src])
    blocks = self.alloc.blocks(seq_id)
    assert len(blocks) == -(-(length + len(tokens)) // self.Z)
    for pos, token in enumerate(tokens, start=length):  # the device writes before the host knows
      block = blocks[pos // self.Z]
      assert self.alloc.ref_count(block) == 1, "a burst wrote into a shared block"
      self.device[block][pos % self.Z] = token
    kept = tokens[: data.draw(st.integers(0, len(tokens)))]
    assert self.alloc.append(seq_id, kept) == []  # the reserved blocks are already private
    assert self.alloc.truncate(seq_id, length + len(kept)) == []
    self.model[seq_id] = self.model[seq_id] + kept
    for pos in range(length, length + len(kept)):
      if (pos + 1) % self.Z == 0:
        self.completed.add(tuple(self.model[seq_id][: pos + 1]))

  @precondition(lambda self: self.model)
  @rule(data=st.data())
  def truncate(self, data):
    seq_id = data.draw(st.sampled_from(sorted(self.model)))
    length = data.draw(st.integers(0, len(self.model[seq_id])))
    before = snapshot(self.alloc)
    try:
      copies = self.alloc.truncate(seq_id, length)
    except OutOfBlocksError:
      assert snapshot(self.alloc) == before
      return
    for src, dst in copies:
      self.device[dst] = list(self.device[src])
    self.model[seq_id] = self.model[seq_id][:length]
    self.truncated = True
    blocks = self.alloc.blocks(seq_id)
    assert len(blocks) == -(-length // self.Z)
    # The block the sequence will write next is its own.
    assert len(copies) <= 1 and (length % self.Z == 0 or self.alloc.ref_count(blocks[-1]) == 1)

  @precondition(lambda self: self.model)
  @rule(data=st.data())
  def free(self, data):
    seq_id = data.draw(st.sampled_from(sorted(self.model)))
    self.alloc.free(seq_id)
    del self.model[seq_id]
    self.dead.append(seq_id)

  @precondition(lambda self: self.dead)
  @rule(data=st.data())
  def double_free(self, data):
    seq_id = data.draw(st.sampled_from(self.dead))
    before = snapshot(self.alloc)
    with pytest.raises(UnknownSequenceError):
      self.alloc.free(seq_id)
    with pytest.raises(UnknownSequenceError):
      self.alloc.append(seq_id, [0])
    assert snapshot(self.alloc) == before

  @invariant()
  def allocator_is_consistent(self):
    check_invariants(self.alloc)

  @invariant()
  def sequences_read_back_their_tokens(self):
    assert sorted(self.alloc.sequences()) == sorted(self.model)
    for seq_id, tokens in self.model.items():
      assert self.alloc.tokens(seq_id) == tokens
      slots = self.alloc.slots(seq_id, 0, len(tokens))
      assert [self.device[s // self.Z][s % self.Z] for s in slots] == tokens

  @invariant()
  def stats_count_slots_exactly(self):
    stats = self.alloc.stats()
    filled = {}
    for seq_id, tokens in self.model.items():
      for i, block in enumerate(self.alloc.blocks(seq_id)):
        filled[block] = min(self.Z, len(tokens) - i * self.Z)
    assert stats.filled_slots == sum(filled.values())
    assert stats.logical_tokens == sum(len(t) for t in self.model.values())


AllocatorMachine.TestCase.settings = settings(
  max_examples=100,
  stateful_step_count=40,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase


def test_snapshot_is_deep():
  # The no-change checks above rely on snapshots not aliasing allocator state.
  alloc = BlockAllocator(4, 2)
  alloc.add_sequence("a", [1])
  before = copy.deepcopy(snapshot(alloc))
  alloc.append("a", [2, 3])
  assert snapshot(alloc) != before


def test_cached_prefix_length_predicts_add_sequence_without_changing_state():
  alloc = BlockAllocator(16, 4)
  alloc.add_sequence("a", list(range(13)))
  alloc.append("a", [99])
  alloc.free("a")
  stats = alloc.stats()
  prompt = list(range(12)) + [7, 7]
  want = alloc.cached_prefix_length(prompt)
  assert alloc.stats() == stats  # a pure lookup
  assert want == 12
  assert alloc.add_sequence("b", prompt) == want
  assert alloc.cached_prefix_length(list(range(8))) == 4  # the last token is always recomputed
