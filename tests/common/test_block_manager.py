"""BlockManager: ref counts, the prefix cache and eviction, under random operation
sequences (a hypothesis state machine that also simulates the KV each block holds) and
in targeted cases; block hashes are the same in every process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.hashing import block_hashes, cacheable_prefix_hashes
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 12
# Prompts are cut from these so that they share prefixes of every length.
PREFIXES = [list(range(100, 120)), list(range(100, 108)) + list(range(200, 212)), [7] * 20]


def _seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence(seq_id, list(token_ids), SamplingParams(temperature=0))


def _run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit a fresh seq with its cached prefix, then compute the rest of its tokens."""
    cached = bm.find_cached_prefix(seq.token_ids)
    n = len(seq) - len(cached) * bm.block_size
    assert bm.can_admit(seq, cached, n)
    bm.admit(seq, cached)
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives one BlockManager like a scheduler and a KV-transfer receiver would.

    `kv[b][o]` is what slot o of block b holds: the token prefix whose last token's KV
    was written there. A prefix-cache hit must only ever hand out blocks whose slots
    hold exactly the prefix of the requesting prompt.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.next_id = 0
        self.waiting: list[Sequence] = []
        self.live: list[Sequence] = []
        self.kv: dict[int, list[tuple[int, ...] | None]] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.hash_prefix: dict[int, tuple[int, ...]] = {}  # block hash -> the tokens it covers
        self.cached_hashes: set[int] = set()  # replay of the stored/evicted events
        self.used_hash: dict[int, int] = {}  # in-use block -> its hash, at the last check

    # ---- rules ---------------------------------------------------------------------
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(0, 20),
          suffix=st.lists(st.integers(3, 60), max_size=9))
    def new_seq(self, prefix: int, cut: int, suffix: list[int]) -> None:
        tokens = PREFIXES[prefix][:cut] + suffix or [5]
        self.waiting.append(_seq(self.next_id, tokens))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 24))
    def admit(self, pick: int, chunk: int) -> None:
        seq = self.waiting[pick % len(self.waiting)]
        cached = self.bm.find_cached_prefix(seq.token_ids)
        assert len(cached) <= (len(seq) - 1) // BS, "a hit must leave the final token to compute"
        assert len(set(cached)) == len(cached)
        want_hashes = cacheable_prefix_hashes(seq.token_ids, BS)
        for i, b in enumerate(cached):
            assert self.bm.blocks[b].hash == want_hashes[i]
            for o in range(BS):
                pos = i * BS + o
                assert self.kv[b][o] == tuple(seq.token_ids[:pos + 1]), f"stale KV in cached block {b}"
        n = min(chunk, len(seq) - len(cached) * BS)
        in_free = sum(1 for b in cached if self.bm.blocks[b].ref_count == 0)
        fresh = -(-(len(cached) * BS + n) // BS) - len(cached)
        fits = fresh + in_free <= self.bm.num_free_blocks
        assert self.bm.can_admit(seq, cached, n) == fits
        if not fits:
            return
        self.bm.admit(seq, cached)
        assert seq.num_computed_tokens == seq.num_cached_tokens == len(cached) * BS
        assert self.bm.allocate(seq, n), "can_admit promised room"
        self.waiting.remove(seq)
        self.live.append(seq)
        self._compute(seq, n)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.live))
    @rule(pick=st.integers(0, 99), n=st.integers(1, 12))
    def compute(self, pick: int, n: int) -> None:
        todo = [s for s in self.live if s.num_uncomputed_tokens]
        seq = todo[pick % len(todo)]
        n = min(n, seq.num_uncomputed_tokens)
        need = self.bm.blocks_needed(seq, n)
        free_before = self.bm.num_free_blocks
        ok = self.bm.allocate(seq, n)
        assert ok == (need <= free_before)
        if ok:
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
            self._compute(seq, n)

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.live))
    @rule(pick=st.integers(0, 99), token=st.integers(3, 60))
    def sample_token(self, pick: int, token: int) -> None:
        done = [s for s in self.live if not s.num_uncomputed_tokens]
        done[pick % len(done)].token_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), requeue=st.booleans())
    def free_seq(self, pick: int, requeue: bool) -> None:
        seq = self.live.pop(pick % len(self.live))
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        if requeue:  # like a preemption: recomputed later, maybe from the prefix cache
            self.waiting.append(seq)

    # ---- checks ----------------------------------------------------------------------
    def _compute(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        for pos in range(start, start + n):
            self.kv[seq.block_table[pos // BS]][pos % BS] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)
        n_full = seq.num_computed_tokens // BS
        assert seq.block_hashes == block_hashes(seq.token_ids, BS, max_blocks=n_full)
        for i, h in enumerate(seq.block_hashes):
            self.hash_prefix[h] = tuple(seq.token_ids[:(i + 1) * BS])

    @invariant()
    def bookkeeping_consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        holders = Counter(b for s in self.live for b in s.block_table)
        for s in self.live:
            assert len(set(s.block_table)) == len(s.block_table), "a seq holds a block twice"
        assert sum(b.ref_count for b in bm.blocks) == sum(holders.values())
        for b in bm.blocks:
            assert b.ref_count == holders[b.block_id], f"block {b.block_id}"
        assert bm.num_free_blocks == NUM_BLOCKS - len(holders)
        for s in self.waiting:
            assert s.block_table == []

    @invariant()
    def cache_matches_events_and_content(self) -> None:
        for kind, h in self.bm.take_events():
            if kind == "stored":
                assert h not in self.cached_hashes, "stored twice without an eviction"
                self.cached_hashes.add(h)
            else:
                assert kind == "evicted" and h in self.cached_hashes
                self.cached_hashes.remove(h)
        hashed = {b.block_id: b.hash for b in self.bm.blocks if b.hash is not None}
        assert set(hashed.values()) == self.cached_hashes
        for b, h in hashed.items():
            prefix = self.hash_prefix[h]
            start = len(prefix) - BS
            assert self.kv[b] == [prefix[:start + o + 1] for o in range(BS)], f"block {b} content != its hash"
        # a block in use is never evicted: it keeps its hash until it is freed
        for b, h in self.used_hash.items():
            if self.bm.blocks[b].ref_count > 0:
                assert self.bm.blocks[b].hash == h, f"in-use block {b} lost its hash"
        self.used_hash = {b: h for b, h in hashed.items() if self.bm.blocks[b].ref_count > 0}

    def teardown(self) -> None:
        for s in self.live:
            self.bm.free(s)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        assert all(b.ref_count == 0 for b in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---- targeted cases ------------------------------------------------------------------
def test_repeated_prompt_hits_the_same_blocks():
    bm = BlockManager(16, BS)
    first = _seq(0, list(range(10, 20)))  # 10 tokens: 2 full blocks + 2 tokens
    _run_prefill(bm, first)
    again = _seq(1, list(range(10, 20)))
    assert bm.find_cached_prefix(again.token_ids) == first.block_table[:2]
    _run_prefill(bm, again)
    assert again.block_table[:2] == first.block_table[:2]
    assert again.block_table[2] != first.block_table[2]  # the partial block is never shared
    assert again.num_cached_tokens == 2 * BS
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    shared = first.block_table[:2]
    bm.free(first)
    bm.free(again)
    assert bm.find_cached_prefix(list(range(10, 20))) == shared, "still cached after both are freed"
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_final_token_is_never_matched():
    bm = BlockManager(16, BS)
    prompt = list(range(30, 30 + 2 * BS))  # exactly two full blocks
    seq = _seq(0, prompt)
    _run_prefill(bm, seq)
    assert [k for k, _ in bm.take_events()] == ["stored", "stored"]
    hit = bm.find_cached_prefix(prompt)
    assert hit == seq.block_table[:1], "the final token must stay to be computed"
    assert bm.find_cached_prefix(prompt + [99]) == seq.block_table[:2]
    assert bm.find_cached_prefix(prompt[:BS]) == []  # one full block: its last token is the final one
    bm.free(seq)
    again = _seq(1, prompt)
    _run_prefill(bm, again)
    assert again.num_cached_tokens == BS and again.num_uncomputed_tokens == 0


def test_eviction_takes_free_blocks_oldest_freed_first_and_reports_events():
    bm = BlockManager(4, BS)
    a = _seq(0, list(range(40, 40 + 3 * BS)))  # 3 full blocks
    _run_prefill(bm, a)
    a_blocks, a_hashes = list(a.block_table), list(a.block_hashes)
    assert a_hashes == block_hashes(a.token_ids, BS)
    assert bm.take_events() == [("stored", h) for h in a_hashes]
    bm.free(a)  # tail first: a's last block is the oldest free hashed block
    # 5 tokens need 2 blocks: the never-used block goes first, then a's tail block
    b = _seq(1, [1, 2, 3, 4, 5])
    _run_prefill(bm, b)
    never_used = (set(range(4)) - set(a_blocks)).pop()
    # (blocks taken in one allocation are handed out in ascending id order)
    assert b.block_table == sorted([never_used, a_blocks[2]])
    hash_b = b.block_hashes[0]
    assert bm.take_events() == [("evicted", a_hashes[2]), ("stored", hash_b)]
    assert bm.blocks[b.block_table[0]].hash == hash_b
    # a's first two blocks survive and are still a hit
    assert bm.find_cached_prefix(a.token_ids) == a_blocks[:2]
    # with b holding 2 blocks, only a's 2 free blocks can be handed out: a[1] then a[0]
    c = _seq(2, list(range(300, 300 + 2 * BS)))
    assert not bm.allocate(c, 3 * BS), "must not evict blocks in use"
    assert bm.take_events() == []
    assert bm.allocate(c, 2 * BS)
    assert c.block_table == sorted([a_blocks[1], a_blocks[0]])
    assert bm.take_events() == [("evicted", a_hashes[1]), ("evicted", a_hashes[0])]
    assert bm.find_cached_prefix(a.token_ids) == []
    assert bm.blocks[b.block_table[0]].hash == hash_b, "an in-use block kept its hash"
    bm.check_invariants()


def test_no_prefix_caching_stores_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = _seq(0, list(range(50, 50 + 3 * BS)))
    _run_prefill(bm, seq)
    assert bm.find_cached_prefix(seq.token_ids + [1]) == []
    assert bm.take_events() == []
    assert all(b.hash is None for b in bm.blocks)
    bm.free(seq)
    assert bm.num_free_blocks == 8


def test_block_hashes_equal_across_processes_and_to_stored_hashes():
    tokens = [(i * 7919) % 150_000 for i in range(5 * 16 + 3)]
    code = ("import json, sys; from pdserve.common.hashing import block_hashes; "
            "print(json.dumps(block_hashes(json.loads(sys.argv[1]), 16)))")
    other = [json.loads(subprocess.run([sys.executable, "-c", code, json.dumps(tokens)], check=True,
                                       capture_output=True, text=True,
                                       env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout)
             for seed in (1, 2)]
    here = block_hashes(tokens, 16)
    assert len(here) == 5
    assert other[0] == other[1] == here
    assert all(0 <= h < 2**64 for h in here)
    bm = BlockManager(8, 16)
    seq = _seq(0, tokens)
    _run_prefill(bm, seq)
    stored = [h for kind, h in bm.take_events() if kind == "stored"]
    assert stored == here
    assert [bm.blocks[b].hash for b in seq.block_table[:5]] == here
