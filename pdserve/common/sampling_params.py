"""Per-request sampling parameters: the one form they take everywhere, from the offline
API and the HTTP body to the wire (common/wire/messages.py registers this class as the
"sampling" structure) and the sampler. Torch-free: the router imports it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


# The one set of limits on sampling values, checked at the edge and again by every engine.
# Each keeps a value inside what msgpack (64-bit ints) and torch (int64, float32) hold.
GREEDY_EPSILON = 1e-5  # temperatures below this sample greedily, as in vLLM (1/t would overflow float32)
MAX_TEMPERATURE = 100.0  # above ~10 the distribution is already flat; bounded so 1/t stays normal
MAX_TOP_K = 2**31 - 1  # the sampler clamps it to the vocabulary
MAX_TOKENS_LIMIT = 2**31 - 1  # the engine also stops at max_model_len
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64  # each is checked per sampled token (a set lookup) and masked while min_tokens holds
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300. Each is one scattered value per step
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range [-100, 100]: -100 bans a token, 100 forces it
MAX_PENALTY = 2.0  # presence/frequency: OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # > 0; 1 is off. Bounded so logit/penalty stays finite in float32
SEED_RANGE = (-2**63, 2**63)  # any int64, as vLLM; the generator is seeded with seed mod 2**64
MAX_N = 128  # choices per request: they share one prefill, but each decodes (and holds KV) on its own
MAX_LOGPROBS = 20  # top log-probabilities per token, OpenAI's limit (top_logprobs <= 20)
# structured output: what each kind's spec holds (common/engine/grammar.py compiles it)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # JSON schema text, "", regex, JSON list, EBNF
MAX_STRUCTURED_SPEC_CHARS = 64 * 1024  # compiled once per process (LRU), but a huge spec is a DoS on the compiler


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and its limit."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text: `kind` (one of STRUCTURED_KINDS) and `spec`, its
    text (a JSON schema, a regex, a JSON list of choices, an EBNF grammar; "" for
    json_object). Only the shape is checked here; whether it compiles is checked at the
    edge and by each engine (common/engine/grammar.py). `reasoning_end` (a token id, the
    end of reasoning such as Qwen3's `</think>`): the grammar applies only from the token
    after the first output token of that id, as vLLM's with a reasoning parser; None: from
    the first output token."""

    kind: str
    spec: str = ""
    reasoning_end: int | None = None

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {str(self.kind)[:40]!r}")
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise SamplingParamsError(f"a structured output spec may hold at most {MAX_STRUCTURED_SPEC_CHARS} "
                                      f"characters, got {len(self.spec)}")
        if self.reasoning_end is not None and not 0 <= self.reasoning_end < 2**31:
            raise SamplingParamsError(f"structured reasoning_end must be a token id, got {self.reasoning_end}")


def prompt_logprobs_problem(n: int) -> str | None:
    """Why `prompt_logprobs` n cannot be served, or None. -1 (vLLM: the whole vocabulary
    at each prompt position) is refused, as vLLM does under its default `--max-logprobs`
    20: it is vocab_size entries per prompt token."""
    if n == -1:
        return (f"prompt_logprobs -1 (every vocabulary token at each prompt position) is not served: that is "
                f"vocab_size entries per prompt token (vLLM refuses it too unless started with --max-logprobs -1); "
                f"ask for 0..{MAX_LOGPROBS}")
    if not 0 <= n <= MAX_LOGPROBS:
        return f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {n}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature=0` (or anything below `GREEDY_EPSILON`) is greedy (exact argmax).
    `top_k=-1` (or 0, as vLLM), `top_p=1.0` and `min_p=0` disable those filters. The same
    `seed` gives the same output for the same prompt.

    The logits of a step pass, in this order (vLLM's): `logit_bias` (token id -> bias),
    the `min_tokens` mask (EOS and `stop_token_ids` cannot be sampled before that many
    output tokens, unless the grammar allows nothing else), `repetition_penalty` (prompt and output tokens; transformers'
    semantics), `frequency_penalty` / `presence_penalty` (output tokens; OpenAI's), then
    temperature, `min_p`, top-k and top-p. A sampled `stop_token_ids` token ends the
    request with "stop" (kept in the output, like EOS). `logit_bias` is held as sorted
    (token id, bias) pairs: msgpack map keys on the wire are strings only, and a tuple
    keeps the params frozen; a dict given here is turned into them. `structured`
    constrains the output to a grammar (its mask comes first, before logit_bias); the
    request stops with "stop" when the grammar is complete.

    Built by a user, it is checked at once. Decoded off the wire (`unchecked`) it is
    checked by whoever serves it (`validate()`), so the refusal can name the request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] | None = field(default=None)
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # None: no log-probabilities; n: the sampled token's and the n most likely (common/logprobs.py)
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    # choices: one prefill, then n sequences that share the prompt's KV blocks; choice i of a
    # seeded request samples from a generator seeded with seed + i (choice 0: the seed's own stream)
    n: int = 1
    # None: none; n: each prompt token's logprob (the first has none) and the n most likely
    # there (vLLM's prompt_logprobs). Every prompt position is computed: no prefix-cache reuse
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        self.validate()

    @classmethod
    def unchecked(cls, **values: Any) -> "SamplingParams":
        """An instance from wire data, not yet validated (the codec checked the types)."""
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        obj = object.__new__(cls)
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            object.__setattr__(obj, f.name, values.get(f.name, default))
        return obj

    def validate(self) -> None:
        """SamplingParamsError naming the first value out of range (see the limits above)."""
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN and inf
            raise SamplingParamsError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                                      f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise SamplingParamsError(f"top_k must be -1 or 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens < (0 if self.prompt_logprobs is not None and self.n == 1 else 1):
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens} (0 only with "
                                      f"prompt_logprobs and n 1: score the prompt, generate nothing)")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise SamplingParamsError(f"max_tokens must be <= {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if self.stop is not None:
            if len(self.stop) > MAX_STOP_STRINGS:
                raise SamplingParamsError(f"stop may list at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
            for s in self.stop:
                if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                    raise SamplingParamsError(f"each stop string must be non-empty text of at most "
                                              f"{MAX_STOP_CHARS} characters, got {str(s)[:40]!r}")
                if not _is_unicode(s):
                    raise SamplingParamsError(f"stop string {s[:40]!r} is not valid Unicode (lone surrogate)")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise SamplingParamsError(f"seed must be an int64, in [-2**63, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and (problem := prompt_logprobs_problem(self.prompt_logprobs)):
            raise SamplingParamsError(problem)
        self._validate_stops()
        self._validate_penalties()
        if self.structured is not None:
            self.structured.validate()

    def _validate_stops(self) -> None:
        if self.stop_token_ids is not None:
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise SamplingParamsError(f"stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} ids, "
                                          f"got {len(self.stop_token_ids)}")
            bad = next((t for t in self.stop_token_ids if not 0 <= t < 2**31), None)
            if bad is not None:
                raise SamplingParamsError(f"stop_token_ids must be token ids in [0, 2**31), got {bad}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    def _validate_penalties(self) -> None:
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:  # NaN fails this too
            raise SamplingParamsError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
                                      f"(1 is off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingParamsError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, "
                                          f"got {len(self.logit_bias)}")
            for token, bias in self.logit_bias:
                if not 0 <= token < 2**31:
                    raise SamplingParamsError(f"logit_bias keys must be token ids in [0, 2**31), got {token}")
                if not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
                    raise SamplingParamsError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                              f"{MAX_LOGIT_BIAS_VALUE:g}], got {bias} for token {token}")
            if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
                raise SamplingParamsError("logit_bias lists a token id twice")

    def token_ids_out_of(self, vocab_size: int) -> int | None:
        """The first of `stop_token_ids` and `logit_bias`'s ids outside [0, vocab_size), or None."""
        ids = list(self.stop_token_ids or []) + [t for t, _ in self.logit_bias or ()]
        return next((t for t in ids if t >= vocab_size), None)

    @property
    def uses_penalties(self) -> bool:
        """Whether the logits need this request's token history (the sampler's costly part)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def logit_bias_pairs(bias: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` map (JSON keys are strings of token ids) as sorted (id, bias)
    pairs; SamplingParamsError for a key that is not a token id."""
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        except ValueError:
            token = key
        if isinstance(token, bool) or not isinstance(token, int):
            raise SamplingParamsError(f"logit_bias keys must be token ids, got {str(key)[:40]!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SamplingParamsError(f"logit_bias values must be numbers, got {str(value)[:40]!r} for token {token}")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def _is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (JSON lets "\\ud800" through; UTF-8 cannot carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
