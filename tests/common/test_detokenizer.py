"""Property: whatever the tokens and however they arrive, the streamed deltas concatenate
to decode(all tokens, skip_special_tokens) cut before the first stop string (after it
with include_stop_str_in_output) that ends at output token min_tokens or later; while the
request runs no delta ends inside a character split across byte-level tokens, and no
skipped special token's text leaks. Checked on the tiny test tokenizer and the real one."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.pre_tokenizers import ByteLevel

from pdserve.common.wire.messages import TokenOutput
from pdserve.common.text.tokenizer import Tokenizer
from pdserve.common.text.detokenizer import IncrementalDetokenizer, held_back_tail
from pdserve.router.core.text import merge_outputs, usage


@pytest.fixture(scope="module", params=["tiny", "real"])
def tok(request, model_dirs) -> Tokenizer:
    if request.param == "tiny":
        return Tokenizer(model_dirs["qwen3"])
    return Tokenizer(request.getfixturevalue("real_model_dir"))


def _pools(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(single-byte tokens, which split multi-byte characters; special tokens)."""
    vocab = tok._tok.get_vocab()
    byte_ids = sorted(vocab[c] for c in ByteLevel.alphabet() if c in vocab)
    special = sorted(i for t, i in vocab.items() if t.startswith("<|") and t.endswith("|>"))  # get_vocab() order varies
    return byte_ids, special


def _run(tok: Tokenizer, ids: list[int], cuts: list[int], stop: list[str], **options: object
         ) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` in batches cut at `cuts`: (the detokenizer, the deltas it returned)."""
    detok = IncrementalDetokenizer(tok, stop, **options)  # type: ignore[arg-type]
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    deltas = []
    for a, b in zip(bounds, bounds[1:]):
        deltas.append(detok.add(ids[a:b], finished=b == len(ids)))
    return detok, deltas


def _settled(tok: Tokenizer, ids: list[int], j: int, skip: bool = True) -> str:
    """The text of the first j tokens that no later token can change: a trailing U+FFFD
    may still become another character, unless no token follows."""
    text = tok.decode(ids[:j], skip_special_tokens=skip)
    return text if j == len(ids) else text.rstrip("\ufffd")


def _reference(tok: Tokenizer, ids: list[int], stop: list[str], min_tokens: int = 0, include: bool = False,
               skip: bool = True) -> tuple[str, int]:
    """(final text, tokens reported): the first token count j >= min_tokens whose settled
    text holds a stop string ending after token j-1's settled text ends the request there,
    cut before the earliest such match (after it if included; the first listed of those
    starting there)."""
    for j in range(max(1, min_tokens), len(ids) + 1):
        text, before = _settled(tok, ids, j, skip), len(_settled(tok, ids, j - 1, skip)) if j > 1 else 0
        hits = [(i, k) for k, s in enumerate(stop) if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            i, k = min(hits)
            return text[:i + (len(stop[k]) if include else 0)], j
    return tok.decode(ids, skip_special_tokens=skip), len(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_concatenate_to_the_decoded_text(tok, data):
    byte_ids, special = _pools(tok)
    token = st.one_of(st.sampled_from(byte_ids), st.integers(0, tok.vocab_size - 1), st.sampled_from(special))
    # whole characters cut into byte tokens: accents, CJK, emoji
    chars = st.text(alphabet="aé日🎉ß€ ", min_size=1, max_size=6).map(lambda s: tok.encode(s))
    pieces = data.draw(st.lists(st.one_of(token.map(lambda t: [t]), chars), min_size=1, max_size=12))
    ids = [t for p in pieces for t in p]
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=8))
    skip = data.draw(st.booleans())
    min_tokens = data.draw(st.sampled_from([0, 0, 1, 2, len(ids) // 2, len(ids)]))
    include = data.draw(st.booleans())
    full = tok.decode(ids, skip_special_tokens=skip)
    stop: list[str] = []
    for _ in range(data.draw(st.integers(0, 2)) if full else 0):  # stop strings that occur, at any boundary
        i = data.draw(st.integers(0, len(full) - 1))
        stop.append(full[i:i + data.draw(st.integers(1, 4))])
    if data.draw(st.booleans()):
        stop.append("never 🎉 here")  # one that never matches: no effect but the held-back tail
    detok, deltas = _run(tok, ids, cuts, stop, min_tokens=min_tokens, include_stop_str=include,
                         skip_special_tokens=skip)
    expected, n_tokens = _reference(tok, ids, stop, min_tokens, include, skip)
    assert "".join(deltas) == expected == detok.text
    assert detok.token_ids == ids[:n_tokens], "tokens reported up to the one that completed the stop string"
    if min_tokens == 0:
        assert detok.stopped == (n_tokens < len(ids) or any(s in _settled(tok, ids, len(ids), skip) for s in stop))
    for t in special if skip else ():
        assert tok.decode([t], skip_special_tokens=False) not in "".join(deltas)
    sent = ""
    for d in deltas[:-1]:  # while running: a trailing U+FFFD is only sent if the final text has it there
        sent += d
        assert not sent.endswith("\ufffd") or expected[:len(sent)].endswith("\ufffd")
        # (with min_tokens a sent tail may begin a stop string that already ended before min_tokens:
        # that one can never match, and the text being a prefix of the final one is checked above)
        assert held_back_tail(sent, stop) == 0 or detok.stopped or min_tokens, \
            "sent a tail that could grow into a stop string"


def test_a_split_character_is_held_back_until_complete(model_dirs):
    tok = Tokenizer(model_dirs["qwen3"])
    ids = tok.encode("a🎉")
    assert len(ids) >= 3, "the emoji should need several byte tokens"
    detok = IncrementalDetokenizer(tok, None)
    deltas = [detok.add([t], finished=False) for t in ids]
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-1]) and deltas[-1] == "🎉"


def test_held_back_tail():
    assert held_back_tail("hello wor", ["world"]) == 3
    assert held_back_tail("hello", ["xyz"]) == 0
    assert held_back_tail("ab", ["b", "abc"]) == 2


def test_merge_outputs_and_usage():
    outs = [TokenOutput("r", [1, 2], "he"), TokenOutput("r", [3], "llo", finished=True, finish_reason="stop",
                                                        num_prompt_tokens=5)]
    merged = merge_outputs(outs)
    assert (merged.token_ids, merged.text, merged.finish_reason, merged.finished) == ([1, 2, 3], "hello", "stop", True)
    assert usage(merged) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def _one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_stop_string_across_token_boundaries(model_dirs):
    tok = Tokenizer(model_dirs["qwen3"])
    words = ["the", " model", " serving", " request"]
    ids = [t for w in words for t in tok.encode(w)]
    detok = IncrementalDetokenizer(tok, ["el serv"])  # the end of " model", the start of " serving"
    deltas = _one_by_one(detok, ids)
    assert detok.stopped and "".join(deltas) == detok.text == "the mod"
    assert detok.token_ids == ids[:len(tok.encode("the")) + len(tok.encode(" model")) + len(tok.encode(" serving"))]
    assert "el" not in "".join(deltas[:2]), "a tail that could begin the stop string was sent"


def test_stop_string_at_the_very_start(model_dirs):
    tok = Tokenizer(model_dirs["qwen3"])
    ids = tok.encode("the model")
    detok = IncrementalDetokenizer(tok, ["th"])
    deltas = _one_by_one(detok, ids)
    assert deltas == [""] * len(ids) and detok.text == "" and detok.stopped
    assert detok.token_ids == ids[:1]


def test_multi_byte_stop_string_completes_with_its_last_byte(model_dirs):
    tok = Tokenizer(model_dirs["qwen3"])
    ids = tok.encode("a日b")
    assert len(ids) >= 4, "日 should take several byte tokens"
    detok = IncrementalDetokenizer(tok, ["日"])
    deltas = _one_by_one(detok, ids)
    assert "".join(deltas) == detok.text == "a" and detok.token_ids == ids[:-1]  # not "b"'s token


def test_text_without_a_match_keeps_nothing_back_at_the_end(model_dirs):
    """A tail that could have begun a stop string is held while running and sent at the end."""
    tok = Tokenizer(model_dirs["qwen3"])
    ids = tok.encode("hello wor")
    detok = IncrementalDetokenizer(tok, ["world"])
    running = [detok.add([t], finished=False) for t in ids]
    assert "".join(running) == "hello " and detok.add([], finished=True) == "wor"
    assert detok.text == "hello wor" and not detok.stopped


class _CountingTokenizer:
    """A Tokenizer that counts the token ids it decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_output(model_dirs):
    """O(new tokens): 3000 tokens fed one by one decode a few ids each, not the whole output
    (the old path decoded ~n^2/2 = 4.5M ids)."""
    tok = Tokenizer(model_dirs["qwen3"])
    ids = (tok.encode("the model serving request a日🎉 token cache, ") * 400)[:3000]
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, ["never here", "nor this"])  # type: ignore[arg-type]
    deltas = _one_by_one(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert counting.decoded < 10 * len(ids), counting.decoded
