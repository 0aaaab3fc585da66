"""The engine loop shared by the offline `LLM` and the colocated worker: admit
requests, schedule a step, run it, append sampled tokens, finish what stopped."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.block_manager import BlockManager
from common.config import EngineConfig
from common.model_runner import ModelRunner
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.sequence import SeqIdCounter, Sequence
from common.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request cannot be served as given; the message names the value and the limit."""


@dataclass
class StepOutput:
    """What one step produced for one sequence."""

    seq: Sequence
    new_token: int
    finished: bool


class LLMEngine:
    """Owns the tokenizer, scheduler, block manager and model runner of one process."""

    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model.model_dir)
        self.runner = ModelRunner(config, kv_cache)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.scheduler.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = set(config.model.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._ids = SeqIdCounter()

    # ---- requests ----------------------------------------------------------
    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, or RequestError naming what is wrong with it."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        vocab = self.config.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.config.scheduler.max_model_len
        if len(token_ids) >= limit:
            raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is {limit}, "
                               f"so a prompt may have at most {limit - 1}")
        return token_ids

    def new_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """A validated Sequence, not yet scheduled."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        return Sequence(self._ids.next(), self.validate_prompt(prompt), params)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        seq = self.new_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self.runner.release(seq.seq_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop -----------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        sampled = self.runner.execute(batch)
        self.scheduler.advance(batch)
        outputs = []
        for seq in batch.seqs:
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = self.check_stop(seq)
            if reason:
                self.scheduler.finish(seq, reason)
                self.runner.release(seq.seq_id)
            outputs.append(StepOutput(seq, token, reason is not None))
        return outputs

    def check_stop(self, seq: Sequence) -> str | None:
        """'stop' on EOS or a stop string, 'length' on max_tokens / max_model_len, else None."""
        p = seq.sampling_params
        if not p.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(seq.output_token_ids)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                seq.stop_text_len = min(hits)
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.config.scheduler.max_model_len:
            return "length"
        return None

    def output_text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.output_token_ids)
        return text[:seq.stop_text_len] if seq.stop_text_len is not None else text
