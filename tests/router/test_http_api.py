"""The OpenAI request bodies at the HTTP edge, without a server: explicit nulls take
defaults, content parts become text, several prompts, unknown fields kept aside."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.router.openai.protocol import ChatBody, ChatMessage, CompletionBody, TokenizeBody, unknown_fields, unsupported


def test_explicit_nulls_take_the_defaults():
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
                               "stream_options", "ignore_eos", "logprobs", "echo", "user", "add_special_tokens")}
    body = CompletionBody.model_validate({"prompt": "hi", **nulls})
    assert body.model_dump() == CompletionBody.model_validate({"prompt": "hi"}).model_dump()
    assert body.temperature == 1.0 and body.n == 1 and body.add_special_tokens is True and unsupported(body) is None
    chat = ChatBody.model_validate({"messages": [{"role": "assistant", "content": None, "name": None}],
                                    "chat_template_kwargs": None, "add_generation_prompt": None,
                                    "stream_options": {"include_usage": None}})
    assert chat.add_generation_prompt is True and chat.add_special_tokens is False
    assert chat.messages[0].text() == ""


def test_text_parts_join_with_newlines_and_other_parts_are_named():
    msg = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]})
    assert msg.text() == "a\nb"
    image = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]})
    with pytest.raises(ValueError, match="'image_url'"):
        image.text()


def test_prompt_forms():
    assert CompletionBody(prompt="a").prompts() == ["a"]
    assert CompletionBody(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionBody(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionBody(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionBody(prompt=[]).prompts() == [[]]  # one prompt, refused as empty by the router
    with pytest.raises(ValidationError):
        CompletionBody(prompt=[1, "a"])


def test_unknown_fields_are_kept_aside_known_unsupported_ones_named():
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1,
                                    "parallel_tool_calls": False, "reasoning_effort": "low"})
    assert unknown_fields(body) == ["frobnicate", "reasoning_effort"] and body.parallel_tool_calls is False
    assert unsupported(ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "best_of": 2})) == "best_of"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert unsupported(ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                "tool_choice": "required"})) is None  # chat serves them
    assert unsupported(CompletionBody.model_validate({"prompt": "x", "tools": tools})) == "tools"  # completions do not


def test_logprobs_fields_map_to_the_sampling_count():
    msgs = [{"role": "user", "content": "x"}]
    chat = lambda **kw: ChatBody.model_validate({"messages": msgs, **kw})  # noqa: E731
    assert chat().num_logprobs() is None and chat(logprobs=False).num_logprobs() is None
    assert chat(logprobs=True).num_logprobs() == 0 and chat(logprobs=True, top_logprobs=20).num_logprobs() == 20
    assert CompletionBody(prompt="hi", logprobs=0).num_logprobs() == 0
    assert CompletionBody(prompt="hi").num_logprobs() is None
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"logprobs": 1}):
        with pytest.raises(ValidationError, match="logprobs"):
            chat(**bad)
    for bad in (-1, 21, True):
        with pytest.raises(ValidationError, match="logprobs"):
            CompletionBody(prompt="hi", logprobs=bad)


def test_continue_final_message_excludes_an_explicit_generation_prompt():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValidationError, match="cannot both be true"):
        ChatBody.model_validate({"messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    assert ChatBody.model_validate({"messages": msgs, "continue_final_message": True}).continue_final_message


def test_tokenize_takes_one_form():
    with pytest.raises(ValidationError, match="exactly one"):
        TokenizeBody.model_validate({"prompt": "a", "messages": [{"role": "user", "content": "x"}]})
    assert TokenizeBody.model_validate({"prompt": "a", "messages": None}).add_special_tokens is None


def test_unknown_names_are_logged_once_each_and_boundedly(capsys):
    from types import SimpleNamespace

    from pdserve.router.openai.server import MAX_LOGGED_UNKNOWN, OpenAIServer
    server = SimpleNamespace(logged_unknown=set())
    body = lambda *names: CompletionBody.model_validate({"prompt": "x", **{n: 1 for n in names}})  # noqa: E731
    OpenAIServer.log_unknown(server, body("frob", "nicate"))
    OpenAIServer.log_unknown(server, body("frob"))
    assert capsys.readouterr().err.count("'frob'") == 1
    for i in range(MAX_LOGGED_UNKNOWN + 50):
        OpenAIServer.log_unknown(server, body(f"f{i}"))
    assert len(server.logged_unknown) == MAX_LOGGED_UNKNOWN + 1
    assert capsys.readouterr().err.count("logged once") == MAX_LOGGED_UNKNOWN - 2


def test_echo_and_prompt_logprobs_as_vllm():
    """Completions serve echo (chat's echo is refused); prompt_logprobs defaults to logprobs
    under echo, and echo with max_tokens 0 asks for 0 (the request must compute something)."""
    assert unsupported(ChatBody(messages=[{"role": "user", "content": "x"}], echo=True)) == "echo"
    assert unsupported(CompletionBody(prompt="x", echo=True)) is None
    assert CompletionBody(prompt="x", echo=True, logprobs=3).num_prompt_logprobs() == 3
    assert CompletionBody(prompt="x", echo=True, max_tokens=0).num_prompt_logprobs() == 0
    assert CompletionBody(prompt="x", echo=True).num_prompt_logprobs() is None
    assert CompletionBody(prompt="x", echo=True, logprobs=1, prompt_logprobs=5).num_prompt_logprobs() == 5
    assert CompletionBody(prompt="x", logprobs=1).num_prompt_logprobs() is None
    assert ChatBody(messages=[{"role": "user", "content": "x"}], prompt_logprobs=2).num_prompt_logprobs() == 2


def test_a_grammar_compiles_off_the_event_loop(monkeypatch):
    """Compiling a request's grammar (seconds for the first, which imports xgrammar) runs in
    a thread: the loop keeps ticking meanwhile, and a bad grammar is still a 400."""
    import asyncio
    import time
    from types import SimpleNamespace

    import pdserve.common.engine.grammar as grammar
    from pdserve.router.openai.server import OpenAIServer

    def slow_check(so):
        time.sleep(0.4)
        if so.spec == '"bad"':
            raise grammar.GrammarError("no")
    monkeypatch.setattr(grammar, "check", slow_check)
    server = SimpleNamespace(logged_unknown=set(), log_unknown=lambda body: None, wrong_model=lambda model: None)

    async def run(spec: str):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.create_task(ticker())
        body = ChatBody(messages=[{"role": "user", "content": "x"}], structured_outputs={"json": spec})
        refused = await OpenAIServer.refusal(server, body)
        t.cancel()
        return refused, ticks
    refused, ticks = asyncio.run(run('{"type": "object"}'))
    assert refused is None and ticks >= 10  # a check on the loop would leave it at 0
    refused, _ = asyncio.run(run('"bad"'))
    assert refused.status_code == 400 and b"structured_outputs" in refused.body
