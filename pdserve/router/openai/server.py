"""The HTTP front end (FastAPI on uvicorn/uvloop) speaking the OpenAI API on top of the
same Router core as the ZeroMQ front end."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import sys
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.common.wire.messages import ErrorReply, SubmitRequest, TokenOutput
from pdserve.common.sampling_params import MAX_N, SamplingParams
from pdserve.router.core.router import Router
from pdserve.router.core.requests import Prepared, RouteError
from pdserve.router.openai.protocol import (ChatBody, CompletionBody, DetokenizeBody, StructuredOutputError, TokenizeBody, sampling_fields,
                             structured_output, unknown_fields, unsupported)
from pdserve.router.openai.envelope import COMPLETION, CHAT, ChoiceOutputs, Envelope, PromptEcho, Shape
from pdserve.router.openai.edge import EdgeMiddleware, error, install_error_handlers, sse_error
from pdserve.router.openai.chat_output import ChoiceOutput
from pdserve.router.parsers.reasoning import grammar_after_reasoning, thinking_on
from pdserve.router.core.text import merge_outputs, openai_usage
from pdserve.router.openai.tools import ToolError, ToolPlan, tool_plan, wire_tool_calls

MAX_LOGGED_UNKNOWN = 256  # distinct unknown field names logged; a client inventing names cannot grow the set further
COMPLETION_MAX_TOKENS = 16  # the legacy completions default (OpenAI's, vLLM's); a chat gets the rest of the context

Body = CompletionBody | ChatBody


def _status_for(code: str) -> int:
    return {"unavailable": 503, "worker_failed": 502, "transfer_error": 502, "overloaded": 429}.get(code, 400)


def _route_error(e: RouteError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return error(_status_for(e.code), str(e), code="rate_limit_exceeded" if e.code == "overloaded" else e.code,
                 headers=headers)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


class OpenAIServer:
    """Owns the FastAPI app of the OpenAI API, the Router it submits to, and the names of
    the unknown body fields it has already logged (each once). The edge limits (body
    size, API key) are the app's middleware, from the router's config; the methods below
    are the app's handlers."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.model_name = router.config.model_name
        self.version = _version()
        self.logged_unknown: set[str] = set()
        self.token_strings: dict[int, str] = {}  # token id -> its string in logprobs
        self.app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
        self.app.add_middleware(EdgeMiddleware, max_body_bytes=router.config.max_body_bytes,
                                api_key=router.config.api_key)
        install_error_handlers(self.app)
        # response_model=None: the handlers' return types are not response schemas
        for path, handler, method in (("/v1/completions", self.completions, "POST"),
                                      ("/v1/chat/completions", self.chat, "POST"),
                                      ("/v1/models", self.models, "GET"), ("/health", self.health, "GET"),
                                      ("/metrics", self.metrics, "GET"), ("/tokenize", self.tokenize, "POST"),
                                      ("/detokenize", self.detokenize, "POST"), ("/version", self.get_version, "GET")):
            self.app.add_api_route(path, handler, methods=[method], response_model=None)

    # ---- handlers --------------------------------------------------------------------------
    async def completions(self, body: CompletionBody) -> Response | dict:
        """One choice per prompt; several prompts are routed as requests of their own, at once."""
        if (refused := await self.refusal(body)) is not None:
            return refused
        subs = [self.submit_request(body, COMPLETION_MAX_TOKENS, add_special_tokens=body.add_special_tokens,
                                    **({"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}))
                for p in body.prompts()]
        return await self.respond(body, subs, COMPLETION)

    async def chat(self, body: ChatBody) -> Response | dict:
        if (refused := await self.refusal(body)) is not None:
            return refused
        try:
            msgs = _messages(body.messages)
        except ValueError as e:
            return error(400, str(e), param="messages")
        cfg = self.router.config
        try:
            plan_args = (_tools(body.tools), body.tool_choice, body.parallel_tool_calls, cfg.enable_auto_tool_choice,
                         structured_output(body) is not None)
            plan = await asyncio.to_thread(tool_plan, *plan_args) if body.tools else tool_plan(*plan_args)  # compiles
        except ToolError as e:
            return error(400, str(e), param=e.param)
        sub = self.submit_request(body, cfg.max_model_len, messages=msgs, add_special_tokens=body.add_special_tokens,
                                  add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message,
                                  chat_template_kwargs=body.chat_template_kwargs,
                                  tools=plan.tools if plan is not None else None)
        forced = plan.structured() if plan is not None else None
        so = grammar_after_reasoning(forced or sub.sampling.structured, self.router.tokenizer,
                                     cfg.reasoning_parser, body.chat_template_kwargs)
        if so is not sub.sampling.structured:
            sub = dataclasses.replace(sub, sampling=dataclasses.replace(sub.sampling, structured=so))
        waits = so is not None and so.reasoning_end is not None
        return await self.respond(body, [sub], CHAT, self.chat_shaping(body, plan, waits))

    def chat_shaping(self, body: ChatBody, plan: ToolPlan | None, waits: bool) -> ChoiceOutputs | None:
        """How each choice's output is shaped, or None where it is plain text: tool calls
        ("auto", named, required) and the reasoning split (router/openai/chat_output.py), which a
        forced call's output has only where its grammar `waits` for the reasoning's end."""
        parser = self.router.config.reasoning_parser
        if (plan is None or plan.choice == "none") and parser is None:
            return None
        live = plan if plan is not None and plan.choice != "none" else None
        split = parser is not None and (live is None or live.choice == "auto" or waits)
        return functools.partial(ChoiceOutput, live, split, thinking_on(parser or "", body.chat_template_kwargs))

    async def tokenize(self, body: TokenizeBody) -> Response | dict:
        """vLLM's /tokenize: the ids a completion (prompt) or chat (messages) would be served."""
        self.log_unknown(body)
        if (refused := self.wrong_model(body.model)) is not None:
            return refused
        if body.messages is not None:
            try:
                form: dict[str, Any] = {"messages": _messages(body.messages),
                                        "add_generation_prompt": body.add_generation_prompt,
                                        "continue_final_message": body.continue_final_message,
                                        "chat_template_kwargs": body.chat_template_kwargs,
                                        "tools": _tools(body.tools)}
            except ValueError as e:
                return error(400, str(e), param="messages")
        else:
            form = {"prompt": body.prompt}
        sub = SubmitRequest(request_id=uuid.uuid4().hex, sampling=SamplingParams(),
                            add_special_tokens=body.add_special_tokens, **form)
        try:
            ids = await self.router.tokenize_async(sub)
        except RouteError as e:
            return _route_error(e)
        return {"count": len(ids), "max_model_len": self.router.config.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeBody) -> Response | dict:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        self.log_unknown(body)
        if (refused := self.wrong_model(body.model)) is not None:
            return refused
        vocab = self.router.tokenizer.vocab_size
        if (bad := next((t for t in body.tokens if not 0 <= t < vocab), None)) is not None:
            return error(400, f"token id {bad} is out of range: ids are in [0, {vocab})", param="tokens")
        return {"prompt": self.router.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def get_version(self) -> dict:
        return {"version": self.version}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": self.router.config.max_model_len}]}

    async def health(self) -> JSONResponse:
        reg = self.router.registry
        live = {r: len(reg.live((r,))) for r in ("prefill", "decode", "colocated")}
        ok = (live["prefill"] and live["decode"]) or live["colocated"]
        dead = sorted(e.worker_id for e in reg.workers.values() if not e.alive)  # docs/reliability.md
        pools = {e.worker_id: {"role": e.role, "state": e.state if e.alive else "dead", "inflight": e.inflight,
                               "routed": e.routed} for e in reg.workers.values()}  # docs/deploy.md
        failed = {w: {"role": role, "state": "failed", "reason": why} for w, (role, why) in self.router.failed.items()
                  if w not in pools}  # its launcher gave up starting it (router/pools/ray_pool.py)
        return JSONResponse({"status": "ok" if ok else "unavailable", "workers": live, "dead": dead,
                             "failed": sorted(failed), "pools": {**pools, **failed}},
                            status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        self.router.metrics.pools(self.router.registry.pool_counts())
        return Response(self.router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- one request -----------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """One token's string in logprobs (router/openai/logprobs.py): its decode, special tokens kept;
        memoized (at most one string per vocabulary entry)."""
        s = self.token_strings.get(token_id)
        if s is None:
            s = self.token_strings[token_id] = self.router.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def log_unknown(self, body: Any) -> None:
        """Unknown fields are ignored, as OpenAI and vLLM do; each name is logged once, so
        a client's typo can be found without a log line per request."""
        for name in unknown_fields(body):
            if name in self.logged_unknown or len(self.logged_unknown) > MAX_LOGGED_UNKNOWN:
                continue
            self.logged_unknown.add(name)
            if len(self.logged_unknown) > MAX_LOGGED_UNKNOWN:
                print(f"router: {MAX_LOGGED_UNKNOWN} unknown request field names logged; no more will be",
                      file=sys.stderr, flush=True)
            else:
                print(f"router: ignoring the unknown request field {name[:100]!r} (logged once)",
                      file=sys.stderr, flush=True)

    def wrong_model(self, model: str | None) -> JSONResponse | None:
        if model is not None and model != self.model_name:
            return error(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                         param="model", code="model_not_found")
        return None

    async def refusal(self, body: Body) -> JSONResponse | None:
        """The error response for a body this server cannot serve as asked, or None. A
        grammar is compiled in a thread: the first one imports xgrammar (seconds), and no
        compile may stall the loop that streams every other request."""
        self.log_unknown(body)
        if (wrong := self.wrong_model(body.model)) is not None:
            return wrong
        if not 1 <= body.n <= MAX_N:
            return error(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n")
        if (name := unsupported(body)) is not None:
            return error(400, f"{name} is not supported by this server; leave it out", param=name,
                         code="unsupported_parameter")
        if body.requested_max_tokens() == 0 and not (isinstance(body, CompletionBody) and body.echo):
            return error(400, "max_tokens 0 (generate nothing) is served only on /v1/completions with echo=true "
                              "(scoring the prompt), as vLLM", param="max_tokens")
        if body.prompt_logprobs is not None and body.stream:
            return error(400, "prompt_logprobs are not available when stream=true (as vLLM); with echo, "
                              "logprobs carry the prompt's in the first chunk", param="prompt_logprobs")
        try:
            if structured_output(body) is not None:
                await asyncio.to_thread(structured_output, body, True)
        except StructuredOutputError as e:
            return error(400, str(e), param=e.param)
        return None

    def submit_request(self, body: Body, default_max_tokens: int, **prompt: Any) -> SubmitRequest:
        """The wire request for one prompt of `body` (`max_tokens` left out: `default_max_tokens`,
        which the router lowers to what fits the context)."""
        max_tokens = body.requested_max_tokens()
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        sampling = SamplingParams.unchecked(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                            stop=stop, seed=body.seed, ignore_eos=body.ignore_eos,
                                            logprobs=body.num_logprobs(), structured=structured_output(body),
                                            prompt_logprobs=body.num_prompt_logprobs(),
                                            n=body.n, **sampling_fields(body))
        return SubmitRequest(request_id=uuid.uuid4().hex, sampling=sampling, stream=body.stream,
                             return_timeline=body.return_timeline, **prompt)

    async def admitted(self, subs: list[SubmitRequest]) -> list[Prepared] | JSONResponse:
        """Every request checked and admitted by the router, or the error response that
        says why not (the first refusal). Done before answering, so even a streamed
        request gets a 4xx (or a 429), not an SSE error."""
        results = await asyncio.gather(*(self.router.prepare_async(s) for s in subs), return_exceptions=True)
        for r in results:
            if isinstance(r, RouteError):
                return _route_error(r)
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    async def respond(self, body: Body, subs: list[SubmitRequest], shape: Shape,
                      shaping: ChoiceOutputs | None = None) -> Response | dict:
        """One OpenAI response, streamed (SSE) or whole, with n choices per request."""
        preps = await self.admitted(subs)
        if isinstance(preps, JSONResponse):
            return preps
        envelope = Envelope(shape, preps[0].sub.request_id, self.model_name, self.router.clock.time(), self.token_text,
                            self.prompt_echo(body, preps), shaping)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.sse(preps, envelope, include_usage), media_type="text/event-stream")
        outs: list[list[TokenOutput]] = [[] for _ in range(len(preps) * body.n)]
        async with contextlib.aclosing(self.outputs(preps)) as stream:
            async for i, out in stream:
                if isinstance(out, ErrorReply):
                    return error(_status_for(out.code), out.message, code=out.code)
                outs[i].append(out)
        return envelope.whole([merge_outputs(o) for o in outs])

    def prompt_echo(self, body: Body, preps: list[Prepared]) -> PromptEcho | None:
        """What the response shows of the prompts (completions' echo, vLLM's prompt_logprobs
        -- shown also for echo with logprobs, as vLLM), or None when nothing."""
        echo = isinstance(body, CompletionBody) and body.echo
        show = body.prompt_logprobs is not None or (echo and body.num_logprobs() is not None)
        if not echo and not show:
            return None
        texts = [p.sub.prompt if p.sub.prompt is not None
                 else self.router.tokenizer.decode(p.token_ids, skip_special_tokens=False) if echo else ""
                 for p in preps]
        return PromptEcho(texts, [p.token_ids for p in preps], echo, body.num_logprobs() is not None, show, body.n)

    async def outputs(self, preps: list[Prepared]) -> AsyncIterator[tuple[int, TokenOutput | ErrorReply]]:
        """(choice index, output) of every request as they come; closing this generator
        cancels (aborts) those still running. Request i's choice j (of n) is choice
        i * n + j, vLLM's order."""
        n = preps[0].params.n
        if len(preps) == 1:
            async for out in self.router.generate(preps[0]):
                yield getattr(out, "index", 0), out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prep: Prepared) -> None:
            try:
                async for out in self.router.generate(prep):
                    queue.put_nowait((i, out))
            except Exception as e:  # handed to the consumer, which raises it
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(preps)]
        try:
            running = len(tasks)
            while running:
                i, out = await queue.get()
                if out is None:
                    running -= 1
                elif isinstance(out, Exception):
                    raise out
                else:
                    yield i * n + getattr(out, "index", 0), out
        finally:
            for t in tasks:
                t.cancel()

    async def sse(self, preps: list[Prepared], envelope: Envelope, include_usage: bool) -> AsyncIterator[str]:
        """The event stream; an error after the 200 is one `data: {"error": ...}` event, and
        `data: [DONE]` always ends the stream."""
        outs: list[list[TokenOutput]] = [[] for _ in range(len(preps) * preps[0].params.n)]
        finished = 0
        try:
            async with contextlib.aclosing(self.outputs(preps)) as stream:
                async for i, out in stream:
                    if isinstance(out, ErrorReply):
                        yield sse_error(_status_for(out.code), out.message, out.code)
                        break
                    outs[i].append(out)
                    yield f"data: {json.dumps(envelope.chunk(out, index=i))}\n\n"
                    finished += out.finished
                    if finished == len(outs) and include_usage:
                        use = openai_usage(merge_outputs(o) for o in outs)
                        yield f"data: {json.dumps(envelope.chunk(None, usage=use))}\n\n"
        except Exception as e:  # the headers are out: say it in the stream
            print(f"router: stream {preps[0].sub.request_id} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            yield sse_error(500, f"internal error: {type(e).__name__}", "internal_error")
        yield "data: [DONE]\n\n"


def _tools(tools: list | None) -> list[dict[str, Any]] | None:
    """Tool definitions in the wire form, fields left out where not given (None: no tools)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _messages(messages: list) -> list[dict[str, Any]]:
    """Chat messages in the wire form: content as one string (text parts joined), and the
    tool fields that are set; ValueError names a part that is not text."""
    out = []
    for m in messages:
        wire: dict[str, Any] = {"role": m.role, "content": m.text()}
        wire.update((k, v) for k in ("name", "tool_call_id", "reasoning_content") if (v := getattr(m, k)) is not None)
        if m.tool_calls:
            wire["tool_calls"] = wire_tool_calls([c.model_dump() for c in m.tool_calls])
        out.append(wire)
    return out
