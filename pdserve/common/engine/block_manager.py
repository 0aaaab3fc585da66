"""Paged KV block allocation with hash-chained prefix caching.

Owns the free list, ref counts and the hash -> block map. The scheduler asks it for
blocks; it never touches these structures itself.

Invariants:
- every block is either in use (ref_count > 0) or in `_free` (ref_count == 0), never both;
- a free block may still hold a cached hash; it is evicted (hash dropped) only when
  the block is handed out again, oldest-freed first;
- `_hash_to_block[h] == b` implies `blocks[b].hash == h`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.common.hashing import ROOT_HASH, cacheable_prefix_hashes, hash_block
from pdserve.common.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


class BlockManager:
    """Allocates KV blocks to sequences and keeps a prefix cache of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is the eviction order: first freed, first reused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._events: list[tuple[str, int]] = []  # ("stored" | "evicted", hash) for the router
        self.num_cached_blocks_hit = 0  # counters for metrics
        self.num_blocks_queried = 0

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def find_cached_prefix(self, token_ids: list[int], prompt_hashes: list[int] | None = None) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` (never its last token).
        `prompt_hashes`, if given, are the chained hashes of its leading full blocks."""
        if not self.enable_prefix_caching:
            return []
        if prompt_hashes:
            hashes = prompt_hashes[:(len(token_ids) - 1) // self.block_size]
        else:
            hashes = cacheable_prefix_hashes(token_ids, self.block_size)
        found: list[int] = []
        for h in hashes:
            b = self._hash_to_block.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def take_events(self) -> list[tuple[str, int]]:
        events, self._events = self._events, []
        return events

    # ---- mutation --------------------------------------------------------------
    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Whether a waiting seq holding no blocks can take `cached` plus new blocks."""
        in_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        total = -(-(len(cached) * self.block_size + num_new_tokens) // self.block_size)
        return total - len(cached) + in_free <= len(self._free)

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting seq its cached prefix blocks (it must hold none)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for b in cached:
            self._ref(b)
        seq.block_table = list(cached)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        seq.num_hashed_blocks = len(cached)
        seq.block_hashes = [self.blocks[b].hash for b in cached]  # type: ignore[misc]
        self.num_blocks_queried += (len(seq) - 1) // self.block_size
        self.num_cached_blocks_hit += len(cached)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold `num_new_tokens` more tokens; False if no room."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            return False
        # ascending ids keep a sequence's blocks in long consecutive runs (fewer, bigger copies
        # when its KV is transferred); which of the n blocks is evicted first does not matter
        seq.block_table.extend(sorted(self._pop_free() for _ in range(need)))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (holding nothing) parent's computed prompt: its full blocks shared
        (one more reference each), its last block, if partial, copied into a new block,
        since both will write their next tokens there. Returns (src, dst) of the KV the
        caller must copy, or None when no copy is needed. The caller checks room
        (`fork_blocks_needed`)."""
        assert not child.block_table and child.num_computed_tokens == 0
        n_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:n_full]
        for b in shared:
            self._ref(b)
        child.block_table = list(shared)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.block_hashes = list(parent.block_hashes)
        if self.fork_blocks_needed(parent) == 0:
            return None
        dst = self._pop_free()
        child.block_table.append(dst)
        return parent.block_table[n_full], dst

    def fork_blocks_needed(self, parent: Sequence) -> int:
        """New blocks a fork of `parent` takes: 1 for the copy of a partial last block."""
        return 1 if parent.num_computed_tokens % self.block_size else 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        known = seq.prompt_hashes
        for i in range(seq.num_hashed_blocks, n_full):
            h = known[i] if i < len(known) else hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            parent = h
            b = seq.block_table[i]
            if h not in self._hash_to_block and self.blocks[b].hash is None:
                self.blocks[b].hash = h
                self._hash_to_block[h] = b
                self._events.append(("stored", h))
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, n_full)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's trailing blocks beyond those that hold `num_tokens` tokens (never
        a computed one's): the room a speculative step took for draft tokens that were
        rejected. The released blocks were never full and computed, so hold no hash."""
        keep = max(-(-num_tokens // self.block_size), -(-seq.num_computed_tokens // self.block_size))
        while len(seq.block_table) > keep:
            self.release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; tail blocks are freed first so they are evicted first."""
        for b in reversed(seq.block_table):
            self.release(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.block_hashes = []

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    # ---- internals ------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its content is about to be overwritten
            del self._hash_to_block[block.hash]
            self._events.append(("evicted", block.hash))
            block.hash = None
        block.ref_count = 1
        return block_id

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        for b in self.blocks:
            assert (b.ref_count == 0) == (b.block_id in self._free), b
            assert b.ref_count >= 0
            if b.hash is not None:
                assert self._hash_to_block[b.hash] == b.block_id
        for h, bid in self._hash_to_block.items():
            assert self.blocks[bid].hash == h
