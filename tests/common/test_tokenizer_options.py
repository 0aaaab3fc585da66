"""The tokenizer options a request can set, checked against transformers on the same
folder: special tokens (a BOS from tokenizer.json's post-processor), template variables
(`chat_template_kwargs`), and `continue_final_message`."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.common.text.chat_template import ChatTemplateError
from pdserve.common.text.tokenizer import Tokenizer
from tests.support.helpers import bos_thinking_model

MSGS = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Which worker decodes?"}]
OPEN = [*MSGS, {"role": "assistant", "content": "The decode worker, which "}]


@pytest.fixture(scope="module")
def folder(model_dirs, tmp_path_factory) -> str:
    return bos_thinking_model(model_dirs["qwen3"], tmp_path_factory.mktemp("bos") / "model")


@pytest.fixture(scope="module")
def ours(folder) -> Tokenizer:
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return AutoTokenizer.from_pretrained(folder)


def test_special_tokens_as_transformers(ours, hf):
    text = "The router sends each request to"
    with_bos = ours.encode(text, add_special_tokens=True)
    assert with_bos == hf.encode(text, add_special_tokens=True)
    assert ours.encode(text) == ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert with_bos == [hf.convert_tokens_to_ids("<|endoftext|>"), *ours.encode(text)]


@pytest.mark.parametrize("thinking", [True, False])
def test_template_kwargs_reach_the_template(ours, hf, thinking):
    got = ours.apply_chat_template(MSGS, template_kwargs={"enable_thinking": thinking})
    assert got == hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    assert ("<think>" in got) is (not thinking)


def test_continue_final_message_as_transformers(ours, hf):
    got = ours.apply_chat_template(OPEN, continue_final_message=True)
    assert got == hf.apply_chat_template(OPEN, tokenize=False, continue_final_message=True)
    assert got.endswith("The decode worker, which ")
    assert ours.apply_chat_template(OPEN, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_template_kwargs_cannot_replace_the_request_fields(ours):
    with pytest.raises(ChatTemplateError, match="messages"):
        ours.apply_chat_template(MSGS, template_kwargs={"messages": []})
