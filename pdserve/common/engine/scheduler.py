"""What runs next: continuous batching with a token budget, chunked prefill and
preemption by recompute. Owns the waiting and running queues; asks the BlockManager
for blocks and never touches its free lists.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.config import SchedulerConfig
from pdserve.common.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: each seq computes `num_tokens` tokens from its num_computed_tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Running sequences are served first (oldest first); waiting ones are admitted
    FCFS while the budget, the sequence limit and free blocks allow. When a running
    sequence cannot get a block, the newest running sequence is preempted: its blocks
    are freed and it goes back to the front of the queue to be recomputed (its prefix
    blocks usually survive in the prefix cache).

    Speculative decoding: a running sequence's draft tokens (`spec_token_ids`) are
    scheduled with its last token, within the budget, and are the first thing it gives up
    (before anyone is preempted) when blocks run short. A sequence keeps room for up to
    `num_lookahead` tokens past its own (`lookahead`; taken back in `advance` beyond that),
    so a speculating sequence does not free and take a block every step."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_lookahead: int = 0) -> None:
        self.config = config
        self.block_manager = block_manager
        self.num_lookahead = num_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Reserved for a transfer (decode role): they count against max_num_seqs like
        # running ones, so a landed transfer always finds a batch slot.
        self.reserved: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def reserve(self, seq: Sequence) -> int | None:
        """Blocks for a whole prompt whose KV another worker computes (decode role).
        Returns how many leading blocks came from the prefix cache, or None when the
        sequence limit or the free blocks do not allow it now (the caller retries later,
        in arrival order). A RESERVED seq holds its blocks until `start_running` or `finish`."""
        if not self._has_seats(seq, self._seats_taken()):
            return None
        bm = self.block_manager
        cached = bm.find_cached_prefix(seq.token_ids, seq.prompt_hashes)
        n_new = len(seq) - len(cached) * bm.block_size
        if not bm.can_admit(seq, cached, n_new):
            return None
        bm.admit(seq, cached)
        allocated = bm.allocate(seq, n_new)
        assert allocated, "can_admit promised room"
        seq.status = SequenceStatus.RESERVED
        self.reserved.append(seq)
        return len(cached)

    def _seats_taken(self) -> int:
        """Batch slots held: one per running or reserved sequence, and one per choice that
        a sequence not yet forked will fork into (n > 1)."""
        forks = sum(len(s.forks) for s in self.reserved) + sum(len(s.forks) for s in self.running)
        return len(self.running) + len(self.reserved) + forks

    def _has_seats(self, seq: Sequence, taken: int) -> bool:
        """Whether `seq` and its forks fit max_num_seqs; a request of more choices than
        that is admitted into an empty batch (so it runs, alone)."""
        return taken == 0 or taken + 1 + len(seq.forks) <= self.config.max_num_seqs

    def add_forked(self, seq: Sequence) -> None:
        """A choice just forked off a running sequence, holding its blocks: in the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A sequence holding no blocks goes first in the queue, to be computed (a forked
        choice that found no block for its copy is recomputed, as a preempted one is)."""
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def start_running(self, seq: Sequence) -> None:
        """A reserved seq whose prompt KV has landed: decode it from the next step on."""
        self.reserved.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a running seq out of the batch but leave it its blocks (prefill-only role:
        its KV is being handed to a decode worker); `finish` releases them."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def lookahead(self, seq: Sequence, num_tokens: int) -> bool:
        """Room in `seq`'s blocks for `num_tokens` tokens from its first uncomputed one (its
        last token and the drafts a proposer is about to write KV for), taken now unless
        that would leave fewer free blocks than there are running sequences (each may need
        one to go on): False then, and nothing is taken."""
        bm = self.block_manager
        need = bm.blocks_needed(seq, num_tokens)
        if need and bm.num_free_blocks - need < len(self.running):
            return False
        return bm.allocate(seq, num_tokens)

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            del seq.spec_token_ids[max(0, n - seq.num_uncomputed_tokens):]  # the drafts the budget holds
            while not bm.allocate(seq, n):
                if seq.spec_token_ids:  # drafts go before anyone is preempted
                    n -= len(seq.spec_token_ids)
                    seq.spec_token_ids.clear()
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
                i += 1
        if batch.preempted:
            return batch
        taken = self._seats_taken() if self.waiting else 0
        while self.waiting and budget > 0 and self._has_seats(self.waiting[0], taken):
            seq = self.waiting[0]
            # prompt logprobs need every prompt position's logits: no prefix-cache reuse
            cached = [] if seq.prompt_logprobs is not None else bm.find_cached_prefix(seq.token_ids, seq.prompt_hashes)
            n = len(seq) - len(cached) * bm.block_size
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not bm.can_admit(seq, cached, n):
                break
            bm.admit(seq, cached)
            allocated = bm.allocate(seq, n)
            assert allocated, "can_admit promised room"
            self.waiting.popleft()
            taken += 1 + len(seq.forks)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def advance(self, batch: ScheduledBatch) -> None:
        """Account a step that succeeded: its tokens are computed and its full blocks
        enter the prefix cache. Returns nothing: which sequences sampled a token is the
        runner's answer (the engine reads it from `execute`), not the scheduler's. A
        verified sequence's count is its last token and the drafts it accepted (the
        engine sets it), so only accepted tokens are ever hashed; the KV the rejected
        ones left is past the sequence's end and is written over by its next tokens."""
        bm = self.block_manager
        keep = self.num_lookahead + 1
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
            if self.num_lookahead and len(seq.block_table) * bm.block_size > seq.num_computed_tokens + keep:
                bm.trim(seq, seq.num_computed_tokens + keep)  # beyond the room it keeps for its next drafts

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.reserved:
            self.reserved.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
