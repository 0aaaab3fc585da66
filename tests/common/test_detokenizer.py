"""Property: whatever the tokens and however they arrive, the streamed deltas concatenate
to decode(all tokens, skip_special_tokens=True) cut before the first stop string; while
the request runs no delta ends inside a character split across byte-level tokens, and no
special token's text leaks. Checked on the tiny test tokenizer and the real one."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.pre_tokenizers import ByteLevel

from common.wire.messages import TokenOutput
from common.text.tokenizer import Tokenizer
from common.text.detokenizer import IncrementalDetokenizer, held_back_tail
from router.text import merge_outputs, usage


@pytest.fixture(scope="module", params=["tiny", "real"])
def tok(request, model_dirs) -> Tokenizer:
    if request.param == "tiny":
        return Tokenizer(model_dirs["qwen3"])
    return Tokenizer(request.getfixturevalue("real_model_dir"))


def _pools(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(single-byte tokens, which split multi-byte characters; special tokens)."""
    vocab = tok._tok.get_vocab()
    byte_ids = sorted(vocab[c] for c in ByteLevel.alphabet() if c in vocab)
    special = [i for t, i in vocab.items() if t.startswith("<|") and t.endswith("|>")]
    return byte_ids, special


def _run(tok: Tokenizer, ids: list[int], cuts: list[int], stop: list[str]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, stop)
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    deltas = []
    for a, b in zip(bounds, bounds[1:]):
        deltas.append(detok.add(ids[a:b], finished=b == len(ids)))
    return deltas, detok.text


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
    full = tok.decode(ids, skip_special_tokens=True)
    stop: list[str] = []
    if full and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(full) - 1))
        stop = [full[i:i + data.draw(st.integers(1, 4))]]
    deltas, text = _run(tok, ids, cuts, stop)
    expected = full[:full.find(stop[0])] if stop else full
    assert "".join(deltas) == expected == text
    for t in special:
        assert tok.decode([t], skip_special_tokens=False) not in "".join(deltas)
    sent = ""
    for d in deltas[:-1]:  # while running: a trailing U+FFFD is only sent if the final text has it there
        sent += d
        assert not sent.endswith("\ufffd") or expected[:len(sent)].endswith("\ufffd")


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
