"""The engine of one process, for every role: the offline `LLM`, the colocated worker,
the decode worker (which reserves blocks for prompts computed elsewhere and starts
decoding them when their KV lands) and the prefill worker (prefill-only: a sequence is
handed off after its first token, its KV blocks reported as they complete)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.config import EngineConfig
from pdserve.common.engine.grammar import GrammarError
from pdserve.common.engine.graph_runner import GraphRunner
from pdserve.common.hashing import block_hashes
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.sampler import Sampled
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.common.engine.sequence import SeqIdCounter, Sequence, SequenceStatus
from pdserve.common.engine.spec.speculator import SpecStats, Speculator
from pdserve.common.text.tokenizer import Tokenizer, eos_token_id
from pdserve.common.validation import RequestError, check_sampling, prompt_token_ids

__all__ = ["KVProgress", "KVWriter", "LLMEngine", "RequestError", "StepOutput"]


@dataclass
class StepOutput:
    """What one step produced for one sequence. `error` set: the step failed for this
    sequence alone (new_token is -1); the engine has released it, its caller answers it.
    new_token -1 without an error: the prompt is computed and nothing is sampled
    (max_tokens 0). `prompt_logprobs` ride on the output that ends the prompt."""

    seq: Sequence
    new_token: int
    finished: bool
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asks (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (SamplingParams.prompt_logprobs)
    # prefill-only engine, n > 1: the first tokens of the other choices, sampled from the same logits
    forks: list["StepOutput"] = field(default_factory=list)
    # speculative decoding: a step may give a sequence several outputs, one per token; the last of
    # them carries how many draft tokens it verified and how many of those it accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class KVProgress:
    """A scheduled sequence and how many of its KV blocks are complete once this step's
    forward has run (its final, partial block counts when the prompt completes)."""

    seq: Sequence
    complete_blocks: int


class KVWriter(Protocol):
    """Moves KV out while a step runs (the prefill worker's transfer plan)."""

    def plan(self, progress: list[KVProgress]) -> bool:
        """Called before the forward; True asks for `write_layer` after every layer."""

    def write_layer(self, layer: int) -> None:
        """Layer `layer`'s KV of this step is in the cache."""


class LLMEngine:
    """Owns the scheduler, block manager and model runner of one process (and, loaded
    when a text prompt needs it, the tokenizer).

    Sequence life: `add_request` (WAITING) or `reserve` (RESERVED) -> RUNNING ->
    FINISHED; a prefill-only engine stops at PREFILLED after the first token. Every exit
    goes through `release`, which frees exactly what the sequence holds."""

    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None, *,
                 prefill_only: bool = False, warm_up: bool = False) -> None:
        self.config = config
        self.prefill_only = prefill_only
        spec = None if prefill_only else config.speculative  # speculation is the decoding side's
        runner_cls = GraphRunner if config.decode_graphs else ModelRunner
        self.runner: ModelRunner = runner_cls(config, kv_cache, speculates=spec is not None)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.scheduler.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   num_lookahead=spec.num_speculative_tokens if spec is not None else 0)
        self.eos_token_ids = set(config.model.eos_token_ids)
        tokenizer_eos = eos_token_id(config.model.model_dir)
        if tokenizer_eos is not None:
            self.eos_token_ids.add(tokenizer_eos)
        self.runner.sampler.eos_token_ids = frozenset(self.eos_token_ids)  # what min_tokens hides
        self.runner.grammars.stop_token_ids = sorted(self.eos_token_ids)  # what ends a grammar
        self.speculator = None if spec is None else Speculator(config, spec, self.runner.model, self.runner.kv_cache,
                                                               frozenset(self.eos_token_ids))
        self._tokenizer: Tokenizer | None = None
        self._ids = SeqIdCounter()
        self.warm_up_s = self.warm_up() if warm_up else None

    def warm_up(self) -> float:
        """Run one short prompt through a prefill and, unless prefill-only, three decode
        steps, then release it: the device's first-use costs (on a GPU ~0.9 s of kernel
        compilation and library set-up, and batch 1's CUDA graph) are paid at start, not by
        the first request a worker serves (workers ask for it before they say hello). The
        prompt and its tokens fit in one block (of 8 tokens or more), so nothing enters the
        prefix cache or its events, and every block is free after. Returns the seconds it took."""
        t0 = time.perf_counter()
        bs = self.config.cache.block_size
        n = max(1, min(8, bs // 2, self.config.scheduler.max_model_len - 4))
        params = SamplingParams(temperature=0.0, max_tokens=1 if self.prefill_only else 4, ignore_eos=True)
        seq = self.add_request([0] * n, params)
        while self.has_work():
            self.step()
        self.release(seq, "warm_up")  # a prefill-only engine's sequence holds its blocks until released
        self.block_manager.take_events()
        if self.speculator is not None:
            self.speculator.stats = SpecStats()  # counts of requests served (its step costs it keeps)
        return time.perf_counter() - t0

    @property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: only text prompts (the offline `LLM`) need it; workers get
        token ids and the router makes the text."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.config.model.model_dir)
        return self._tokenizer

    # ---- requests ----------------------------------------------------------------------
    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, or RequestError naming what is wrong with it."""
        # a lambda: token-id prompts (every worker's) must not load the tokenizer
        return prompt_token_ids(prompt, lambda text: self.tokenizer.encode(text), self.config.model.vocab_size,
                                self.config.scheduler.max_model_len)

    def new_sequence(self, prompt: str | list[int], params: SamplingParams,
                     prompt_hashes: list[int] | None = None) -> Sequence:
        """A validated Sequence, not yet scheduled. `prompt_hashes` are the chained hashes
        of the prompt's full blocks when the caller computed them already (the router)."""
        check_sampling(params, self.config.model.vocab_size)
        if params.structured is not None:
            try:
                self.runner.grammars.compile(params.structured)  # into the cache, before any step needs it
            except GrammarError as e:
                raise RequestError(f"structured output ({params.structured.kind}) does not compile: {e}") from None
        token_ids = self.validate_prompt(prompt)
        n_full = len(token_ids) // self.config.cache.block_size
        if prompt_hashes is None or not prompt_hashes:
            prompt_hashes = block_hashes(token_ids, self.config.cache.block_size)
        elif len(prompt_hashes) != n_full:
            raise RequestError(f"{len(prompt_hashes)} block hashes given for a prompt of {n_full} full blocks")
        seq = Sequence(self._ids.next(), token_ids, params, prompt_hashes=list(prompt_hashes))
        seq.forks = [Sequence(self._ids.next(), list(token_ids), params, prompt_hashes=list(prompt_hashes), index=i)
                     for i in range(1, params.n)]
        return seq

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Queue a prompt to be computed here (offline, colocated)."""
        seq = self.new_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by `new_sequence` to be computed here."""
        self.scheduler.add(seq)

    def reserve(self, seq: Sequence) -> list[int] | None:
        """Decode role: hold blocks for `seq`'s whole prompt, reusing this engine's
        prefix cache. Returns the block ids whose KV must come from a prefill worker (the
        rest are cached here), or None when there is no room now (retry later, FIFO)."""
        cached = self.scheduler.reserve(seq)
        return None if cached is None else seq.block_table[cached:]

    def start_decoding(self, seq: Sequence, first_token: int, sampler_state: bytes = b"",
                       logprobs: TokenLogprobs | None = None,
                       forks: list[tuple[int, bytes, TokenLogprobs | None]] = ()) -> list[StepOutput]:
        """Decode role: `seq`'s prompt KV has landed in its reserved blocks and a prefill
        worker sampled `first_token` (with its generator left at `sampler_state`, and its
        `logprobs` when the request asks); `forks` are the same for each of `seq.forks`
        (n > 1), which take the prompt's blocks here. One output per choice, in order. A
        sampler state that does not fit this engine is logged; the seed alone goes on.
        first_token -1: it sampled nothing (max_tokens 0, n 1) and sent no KV; the sequence
        ends here ("length"), its blocks freed uncached."""
        assert seq.status == SequenceStatus.RESERVED, seq.status
        seq.prompt_logprobs = None  # computed, and sent, by the prefill worker
        if first_token < 0:
            self.release(seq, "length")
            return [StepOutput(seq, -1, True)]
        assert len(forks) == len(seq.forks), "one first token per fork"
        seq.num_computed_tokens = len(seq)
        self.block_manager.cache_full_blocks(seq)
        self.scheduler.start_running(seq)
        firsts = [(first_token, sampler_state, logprobs), *forks]
        choices = [seq, *seq.forks]
        self.fork(seq)
        outs = []
        for choice, (token, state, lps) in zip(choices, firsts):
            choice.token_ids.append(token)
            out = self._finish_if_stopped(choice, token, lps)
            if not out.finished and state:
                try:
                    self.runner.restore_generator(choice, state)
                except ValueError as e:  # a P on another kind of device
                    print(f"[engine] sequence {choice.seq_id}: {e}; sampling goes on from the seed alone",
                          file=sys.stderr, flush=True)
            outs.append(out)
        return outs

    def fork(self, seq: Sequence) -> None:
        """`seq`'s prompt is computed: each of its forks takes the prompt's blocks (the
        full ones shared, a partial last one copied) and joins the batch -- or, with no
        block free for its copy, waits to be computed again (as a preempted sequence)."""
        bm = self.block_manager
        copies = []
        forks, seq.forks = seq.forks, []
        for child in forks:
            if bm.num_free_blocks >= bm.fork_blocks_needed(seq):
                if (pair := bm.fork(seq, child)) is not None:
                    copies.append(pair)
                self.scheduler.add_forked(child)
            else:
                self.scheduler.requeue(child)
        self.runner.copy_blocks(copies)

    def sampler_state(self, seq: Sequence) -> bytes:
        """The state of a seeded request's generator (b"" if none): hand it with the KV."""
        return self.runner.generator_state(seq.seq_id)

    def release(self, seq: Sequence, reason: str = "abort") -> None:
        """End `seq` here whatever its state, freeing its blocks and generator, and its
        forks' (choices not forked off yet hold nothing else)."""
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.finish(seq, reason)
        self.runner.release(seq.seq_id)
        seq.grammar = None
        seq.spec_token_ids = []
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)
        for child in seq.forks:
            child.status, child.finish_reason = SequenceStatus.FINISHED, reason
            self.runner.release(child.seq_id)
            child.grammar = None
        seq.forks = []

    def abort(self, seq: Sequence) -> None:
        self.release(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop -----------------------------------------------------------------------
    def step(self, kv_writer: KVWriter | None = None) -> list[StepOutput]:
        """Schedule and run one step; one output per sequence that sampled a token. A
        finished sequence has released everything; a prefill-only engine's sequences are
        PREFILLED after their first token and hold their blocks until `release`."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)  # draft tokens, verified in this step
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            for victim in batch.preempted:  # its draft KV went with its blocks
                self.speculator.release(victim.seq_id)
        if not batch.seqs:
            return []
        layer_hook = None
        if kv_writer is not None:
            bs = self.config.cache.block_size
            progress = []
            for seq, n in zip(batch.seqs, batch.num_tokens):
                end = seq.num_computed_tokens + n
                progress.append(KVProgress(seq, -(-end // bs) if end == len(seq) else end // bs))
            if kv_writer.plan(progress):
                layer_hook = kv_writer.write_layer
        failed: dict[int, str] = {}
        generators = self.runner.generator_states([r for s in batch.seqs for r in (s, *s.forks)])
        try:
            t0 = time.thread_time()  # the step's cost in CPU seconds (spec/policy.py says why)
            sampled = self.runner.execute(batch, layer_hook)
            if self.speculator is not None:
                self.speculator.observe_step(batch, time.thread_time() - t0)
        except Exception as e:
            sampled, failed = self._isolate(batch, e, generators)
            if kv_writer is not None and layer_hook is not None:
                for layer in range(self.config.model.num_layers):  # every layer's KV is in the cache now
                    kv_writer.write_layer(layer)
        outputs = []
        if failed:
            for seq in [s for s in batch.seqs if s.seq_id in failed]:
                self.release(seq, "error")
                outputs.append(StepOutput(seq, -1, True, error=failed[seq.seq_id]))
            keep = [i for i, s in enumerate(batch.seqs) if s.seq_id not in failed]
            batch = ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_tokens[i] for i in keep])
        kept = self.speculator.settle(batch, sampled, self._kept) if self.speculator is not None else {}
        self.scheduler.advance(batch)
        for seq in batch.seqs:
            s = sampled.get(seq.seq_id)
            if s is None:
                continue
            prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None  # None unless asked; sent once
            if seq.sampling_params.max_tokens == 0:  # the prompt is scored: nothing is sampled
                outputs.append(self._unsampled(seq, prompt_lps))
                continue
            if seq.seq_id in kept:  # verified: one output per kept token, the last one's stop checked as ever
                tokens = kept[seq.seq_id]
                outputs += [StepOutput(seq, t, False, logprobs=lp) for t, lp in tokens[:-1]]
                token, lps = tokens[-1]
                seq.token_ids.append(token)
                out = self._finish_if_stopped(seq, token, lps)
                out.num_draft_tokens, out.num_accepted_tokens = s.num_draft, len(s.more)
                outputs.append(out)
                continue
            seq.token_ids.append(s.token)
            choices = [seq, *seq.forks]
            for child in seq.forks:
                child.token_ids.append(sampled[child.seq_id].token)
            if self.prefill_only:
                self.scheduler.detach(seq)
                forks = [StepOutput(c, c.token_ids[-1], True, logprobs=sampled[c.seq_id].logprobs) for c in seq.forks]
                outputs.append(StepOutput(seq, s.token, True, logprobs=s.logprobs, forks=forks,
                                          prompt_logprobs=prompt_lps))
                continue
            if seq.forks:
                self.fork(seq)
            outs = [self._finish_if_stopped(c, c.token_ids[-1], sampled[c.seq_id].logprobs) for c in choices]
            outs[0].prompt_logprobs = prompt_lps  # once per request: on choice 0's first output
            outputs += outs
        return outputs

    def _kept(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of `tokens`, appended to `seq` in order, come before it stops (the one
        that stops it included): `check_stop`'s rules but the grammar's (`verify` ends a
        grammar's tokens where it ends)."""
        n_out, length = seq.num_output_tokens, len(seq)
        for j, t in enumerate(tokens[:-1], 1):
            n_out, length = n_out + 1, length + 1
            if self._stops(seq.sampling_params, t, n_out, length):
                return j
        return len(tokens)

    def _unsampled(self, seq: Sequence, prompt_logprobs: list[TokenLogprobs | None] | None) -> StepOutput:
        """A max_tokens 0 sequence whose prompt is computed: it ends ("length"), or, prefill
        only, is PREFILLED for its KV's hand-off."""
        if self.prefill_only:
            self.scheduler.detach(seq)
        else:
            self.release(seq, "length")
        return StepOutput(seq, -1, True, prompt_logprobs=prompt_logprobs)

    def _isolate(self, batch: ScheduledBatch, error: Exception, generators: dict[int, bytes]
                 ) -> tuple[dict[int, Sampled], dict[int, str]]:
        """The batch's step raised: run it again in halves, down to single sequences, to
        find which sequence(s) make it raise. Returns the tokens of the rest and an error
        per culprit. Token-exact for the rest: a failed attempt advanced nothing (the
        scheduler and the prefix cache only learn of a step after it succeeded), the
        KV it wrote is overwritten by the re-run at the same slots, and seeded
        generators are put back as they were before it."""
        print(f"[engine] a step of {len(batch)} sequence(s) raised {type(error).__name__}: {error}; "
              f"isolating the sequence(s) that cause it", file=sys.stderr, flush=True)
        sampled: dict[int, Sampled] = {}
        failed: dict[int, str] = {}

        def fail(seq: Sequence, e: Exception) -> None:
            failed[seq.seq_id] = f"the engine failed on this request: {type(e).__name__}: {e}"
            print(f"[engine] sequence {seq.seq_id} fails the step alone ({type(e).__name__}: {e}); "
                  f"failing it, the other {len(batch) - 1} go on", file=sys.stderr, flush=True)

        if len(batch) == 1:  # the step was that sequence alone
            fail(batch.seqs[0], error)
            return sampled, failed
        whole = list(range(len(batch)))  # it raised already: its halves next
        parts = [whole[:len(whole) // 2], whole[len(whole) // 2:]]
        while parts:
            part = parts.pop()
            sub = ScheduledBatch([batch.seqs[i] for i in part], [batch.num_tokens[i] for i in part])
            self.runner.restore_generator_states([r for s in sub.seqs for r in (s, *s.forks)], generators)
            try:
                sampled.update(self.runner.execute(sub))
            except Exception as e:
                if len(part) == 1:
                    fail(sub.seqs[0], e)
                else:
                    parts += [part[:len(part) // 2], part[len(part) // 2:]]
        return sampled, failed

    def _finish_if_stopped(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        reason = self.check_stop(seq)
        if reason:
            self.release(seq, reason)
        return StepOutput(seq, token, reason is not None, logprobs=logprobs)

    def check_stop(self, seq: Sequence) -> str | None:
        """'stop' on EOS or a `stop_token_ids` token, 'length' on max_tokens /
        max_model_len, else None. Neither stop counts before `min_tokens` output tokens
        (the sampler masks them until then; this holds also for a token it did not
        choose, as vLLM's stop checker). Stop strings are text: whoever makes the text
        matches them (common/text/detokenizer.py) and ends the sequence (`release`)."""
        p = seq.sampling_params
        last = seq.token_ids[-1]
        if p.structured is not None:
            try:
                if self.runner.grammars.is_complete(seq):
                    return "stop"  # the grammar accepted its stop token: ends even with ignore_eos
            except ValueError:  # only a first token handed over from elsewhere can break it
                return "abort"
        return self._stops(p, last, seq.num_output_tokens, len(seq))

    def _stops(self, p: SamplingParams, last: int, num_output: int, length: int) -> str | None:
        """`check_stop` without the grammar, for a sequence of `length` tokens, `num_output`
        of them output, ending in `last`."""
        if num_output >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return "stop"
            if p.stop_token_ids and last in p.stop_token_ids:
                return "stop"
        if num_output >= p.max_tokens or length >= self.config.scheduler.max_model_len:
            return "length"
        return None
