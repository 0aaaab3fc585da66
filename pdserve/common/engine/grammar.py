"""Structured output through xgrammar: compiling a request's constraint (cached per
process), each sequence's matcher, and the per-step token bitmask.

Why xgrammar (over llguidance): its compiled grammars are reusable objects we cache per
(kind, spec), the per-step work is one `fill_next_token_bitmask` per constrained row
(~0.1 ms for a JSON schema over a 49k vocabulary), `apply_token_bitmask_inplace` runs on
CPU and CUDA logits alike, and `TokenizerInfo.from_huggingface` builds the vocabulary
offline from our tokenizer.json. vLLM and SGLang default to it too.

A sequence's matcher is rebuilt from its output tokens whenever it is missing or behind
(`sync`): matching is deterministic, so the decode worker continues the prefill worker's
grammar state from the tokens alone, and a preempted (recomputed) sequence stays in sync.
A grammar with `reasoning_end` starts after the first output token of that id (the end
of reasoning): where that is is read from the output tokens too, so nothing more crosses
the P/D hand-off; until then the sequence samples unconstrained.
A matcher only ever accepts tokens already appended to the sequence, so a failed step
(re-run by the engine's isolation) leaves it as it was."""
from __future__ import annotations

import functools
import json
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.common.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from pdserve.common.engine.sequence import Sequence

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per process (LRU); a JSON schema's is ~100 KB


class GrammarError(ValueError):
    """A structured output spec does not compile; the message says why."""


def _xgr() -> Any:
    import xgrammar  # imported on first use: ~4 s, and plain requests never need it
    return xgrammar


def _choice_ebnf(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"choice must be a JSON list of strings: {e}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings")
    # json.dumps gives a double-quoted literal with C-style escapes, which xgrammar's EBNF reads
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check(so: StructuredOutput) -> None:
    """GrammarError unless `so` compiles; needs no tokenizer (the router's edge check).
    Answers are cached per (kind, spec), as clients resend the same schema."""
    problem = _problem(so.kind, so.spec)
    if problem is not None:
        raise GrammarError(problem)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _problem(kind: str, spec: str) -> str | None:
    xgr = _xgr()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except GrammarError as e:
        return str(e)
    except (RuntimeError, ValueError) as e:  # xgrammar raises RuntimeError with the parser's message
        return _short(e)
    return None


def _short(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    head, sep, tail = text.partition(": ")
    return tail if sep and ".cc:" in head else text


class Grammars:
    """Owns one process's xgrammar tokenizer view (built on first use from the model's
    tokenizer.json), its compiler and the LRU of compiled grammars; makes each
    constrained sequence's matcher and the step's bitmask."""

    def __init__(self, model_dir: str | Path, vocab_size: int, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.stop_token_ids: list[int] = []  # set by the engine (its EOS ids) before first use
        self.cache_size = cache_size
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def compiler(self) -> Any:
        if self._compiler is None:
            import transformers
            xgr = _xgr()
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            # our LRU is the cache: bounded by entries, keyed by what the request sent
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar of `so` (cached); GrammarError if it does not compile."""
        key = (so.kind, so.spec)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        c = self.compiler()
        try:
            if so.kind == "json":
                compiled = c.compile_json_schema(so.spec, any_whitespace=False)
            elif so.kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif so.kind == "regex":
                compiled = c.compile_regex(so.spec)
            elif so.kind == "choice":
                compiled = c.compile_grammar(_choice_ebnf(so.spec))
            else:
                compiled = c.compile_grammar(so.spec)
        except RuntimeError as e:
            raise GrammarError(_short(e)) from None
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def sync(self, seq: Sequence) -> Any | None:
        """`seq`'s matcher, advanced through every output token since its grammar began
        (made fresh when missing); None while the grammar waits for the end of reasoning.
        ValueError if an output token breaks the grammar."""
        state: _MatcherState | None = seq.grammar
        so = seq.sampling_params.structured
        assert so is not None
        if state is None:
            state = seq.grammar = _MatcherState(_xgr().GrammarMatcher(self.compile(so)), so.reasoning_end is None)
        out = seq.output_token_ids
        if state.start is None:
            try:
                state.start = out.index(so.reasoning_end, state.scanned) + 1
            except ValueError:
                state.scanned = len(out)
                return None
        for token in out[state.start + state.num_accepted:]:
            if not state.matcher.accept_token(token):
                raise ValueError(f"output token {token} does not fit the request's structured output")
            state.num_accepted += 1
        return state.matcher

    def is_complete(self, seq: Sequence) -> bool:
        """Whether `seq`'s grammar has reached its end (its stop token accepted)."""
        matcher = self.sync(seq)
        return matcher is not None and bool(matcher.is_terminated())

    def bitmask(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed-token bitmask [B, ceil(V/32)] int32 (CPU) of a step's sampled rows,
        filled on the rows whose grammar applies, and those rows' indices (None: no row's)."""
        xgr = _xgr()
        mask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        rows = []
        for i, s in enumerate(seqs):
            matcher = self.sync(s) if s.sampling_params.structured is not None else None
            if matcher is not None:
                matcher.fill_next_token_bitmask(mask, i)
                rows.append(i)
        return (mask, rows) if rows else None


    def draft_bitmask(self, seqs: list[Sequence]) -> tuple[tuple[torch.Tensor, list[int]] | None, dict[int, int]]:
        """A verification step's bitmask (as `bitmask`) over each sequence's 1 + k rows (k
        its draft tokens `spec_token_ids`): row i masks what the grammar allows after the
        first i drafts. The matcher accepts the drafts one by one while it fills the rows,
        and is rolled back to where it was after (also when this raises), so it still
        holds only appended tokens. Also {seq_id: i} for a sequence whose grammar ends
        (accepts its stop token) with draft i - 1: nothing follows that draft."""
        xgr = _xgr()
        mask = xgr.allocate_token_bitmask(sum(1 + len(s.spec_token_ids) for s in seqs), self.vocab_size)
        rows: list[int] = []
        ends: dict[int, int] = {}
        r = 0
        for s in seqs:
            drafts = s.spec_token_ids
            matcher = self.sync(s) if s.sampling_params.structured is not None else None
            accepted = 0
            try:
                for i in range(1 + len(drafts) if matcher is not None else 0):
                    if matcher.is_terminated():
                        ends[s.seq_id] = i
                        break
                    matcher.fill_next_token_bitmask(mask, r + i)
                    rows.append(r + i)
                    if i == len(drafts) or not matcher.accept_token(drafts[i]):
                        break  # the target's mask at row i refuses that draft: later rows go unused
                    accepted += 1
            finally:
                if accepted:
                    matcher.rollback(accepted)
            r += 1 + len(drafts)
        return ((mask, rows) if rows else None), ends


class _MatcherState:
    """A sequence's matcher, the output index its grammar starts at (None: reasoning goes
    on; `scanned` output tokens hold no end of it) and how many tokens it has accepted."""

    __slots__ = ("matcher", "start", "scanned", "num_accepted")

    def __init__(self, matcher: Any, started: bool) -> None:
        self.matcher = matcher
        self.start: int | None = 0 if started else None
        self.scanned = 0
        self.num_accepted = 0


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits [B, V] of tokens the rows' grammars forbid."""
    _xgr().apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=rows)
