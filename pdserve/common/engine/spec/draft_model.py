"""Draft-model proposals (vLLM's `draft_model` method): a smaller model with the target's
tokenizer, or the target itself in another precision (`"model": "self"`, e.g. int4
weights: common/quantization.py), proposes the next tokens greedily, one pass per token.

Where the draft's KV lies:

- `"model": "self"`: in the target's own cache (the same layers, heads and dtype; as
  QSpec, Zhao et al. 2024). The draft reads the target's KV of every computed position and
  writes its own only at the positions it drafts, from the target's last token on, which
  the verification step then computes and writes again (every row's K/V is stored before
  any row attends), so the target never reads a draft's KV; those slots are the ones the
  scheduler holds for the verification (`Scheduler.lookahead`), which no other sequence
  shares. Nothing is kept per sequence: each proposal starts from the target's cache as it
  is, a prompt whose KV came from a prefill worker or the prefix cache included.
- another model: in a KV cache of its own with as many blocks as the target's, paged by
  the target's block tables (a sequence's draft KV of position p at the slot of its target
  KV), so it needs no blocks of its own. What it holds for a sequence is tracked here: a
  sequence starts with none (the draft computes its prompt on its first proposal), and
  after a verification its draft KV stays valid up to the first rejected draft."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.common.config import ConfigError, EngineConfig, EngineOptions, ModelConfig, SpeculativeConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.scheduler import ScheduledBatch
from pdserve.common.engine.sequence import Sequence
from pdserve.common.sampling_params import SamplingParams

CATCH_UP_ROWS = 8  # a catch-up of up to this many tokens runs as one-query rows (the native decode stack)


def draft_config(target: EngineConfig, spec: SpeculativeConfig, num_blocks: int) -> EngineConfig:
    """The draft model's engine config: the target's options (dtype, device, threads,
    block size, max_model_len) with the draft's folder and quantization, and a KV cache of
    the target's `num_blocks`. ConfigError if its tokenizer is not the target's."""
    options = {**target.to_dict(), "quantization": spec.quantization, "num_kv_blocks": num_blocks,
               "speculative_config": None, "decode_graphs": False}
    draft = EngineOptions.of(**options).engine_config(spec.draft_dir(target.model.model_dir))
    check_same_tokenizer(target.model, draft.model)
    return draft


def check_same_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """ConfigError unless the draft reads and writes the target's token ids: the same
    vocabulary size and the same token -> id map."""
    if Path(draft.model_dir).resolve() == Path(target.model_dir).resolve():
        return
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config: the draft model {draft.model_dir} has a vocabulary of "
                          f"{draft.vocab_size}, the target {target.vocab_size}: it must share the target's tokenizer")
    from tokenizers import Tokenizer  # the one time the two are compared
    try:
        same = (Tokenizer.from_file(str(Path(draft.model_dir) / "tokenizer.json")).get_vocab()
                == Tokenizer.from_file(str(Path(target.model_dir) / "tokenizer.json")).get_vocab())
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ConfigError(f"speculative_config: cannot compare the draft model's tokenizer with the target's: {e}") \
            from None
    if not same:
        raise ConfigError(f"speculative_config: the draft model {draft.model_dir} has another tokenizer than "
                          f"the target {target.model_dir}")


def shadow_params(params: SamplingParams) -> SamplingParams:
    """What a draft samples by: greedily, with the request's logit bias, min_tokens and
    penalties (they shape what the target will accept), without its grammar."""
    return dataclasses.replace(params, temperature=0.0, seed=None, n=1, logprobs=None, prompt_logprobs=None,
                               structured=None, stop=None)


@dataclasses.dataclass
class _DraftState:
    """One sequence as the draft model sees it: `shadow` holds the target's tokens then the
    drafts of the last proposal, the target's block table, and (num_computed_tokens) how
    many leading positions have draft KV; `base`: the target's length at that proposal."""

    shadow: Sequence
    base: int = 0


def shares_kv(spec: SpeculativeConfig) -> bool:
    """Whether the draft writes its KV into the target's cache (the target itself: "self")."""
    return spec.method == "draft_model" and spec.model == "self"


class DraftModelProposer:
    """Owns the draft model's runner (its weights; its KV cache unless it `shares_kv` the
    target's) and each proposing sequence's draft state."""

    free = False

    def __init__(self, target: EngineConfig, spec: SpeculativeConfig, target_cache: torch.Tensor,
                 eos_token_ids: frozenset[int]) -> None:
        self.shared = shares_kv(spec)
        config = draft_config(target, spec, target_cache.shape[2])
        self.runner = ModelRunner(config, target_cache if self.shared else None)
        self.runner.rows_per_chunk = CATCH_UP_ROWS
        self.runner.sampler.eos_token_ids = eos_token_ids  # what min_tokens hides from drafts too
        self._states: dict[int, _DraftState] = {}
        self.on_pass: Callable[[int, float], None] | None = None  # (sequences, CPU seconds) of each draft pass

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        shadows = [self._catch_up(s) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:  # the first pass catches each shadow up to its target's last token, then one token each
            batch = ScheduledBatch([shadows[i] for i in active],
                                   [len(shadows[i]) - shadows[i].num_computed_tokens for i in active])
            t0 = time.thread_time()  # CPU seconds, as the target's steps are timed (spec/policy.py)
            sampled = self.runner.execute(batch)
            if self.on_pass is not None and batch.total_tokens <= 2 * len(batch):  # not a prompt's catch-up
                self.on_pass(len(batch), time.thread_time() - t0)
            for i in active:
                shadow = shadows[i]
                shadow.num_computed_tokens = len(shadow)
                token = sampled[shadow.seq_id].token
                drafts[i].append(token)
                shadow.token_ids.append(token)  # fed in the next pass (the last draft never is)
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
        return drafts

    def _catch_up(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow, its tokens the target's again and its draft KV counted up to
        the first position where the last proposal's drafts and the target's tokens part."""
        state = self._states.get(seq.seq_id)
        if state is None:
            params = shadow_params(seq.sampling_params)
            state = self._states[seq.seq_id] = _DraftState(
                Sequence(seq.seq_id, [], params, num_prompt_tokens=seq.num_prompt_tokens))
        shadow = state.shadow
        if self.shared:  # the target's cache holds every computed position: from its last token on
            shadow.token_ids, shadow.block_table = list(seq.token_ids), seq.block_table
            shadow.num_computed_tokens = seq.num_computed_tokens
            return shadow
        old, new = shadow.token_ids, seq.token_ids
        valid = state.base  # tokens [0, base) were the target's at the last proposal: still its
        end = min(len(old), len(new))
        while valid < end and old[valid] == new[valid]:
            valid += 1
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid, len(new) - 1)
        shadow.token_ids = list(new)
        shadow.block_table = seq.block_table  # the same slots (the list itself: never changed here)
        state.base = len(new)
        return shadow

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
