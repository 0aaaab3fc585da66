"""The HTTP front end (FastAPI on uvicorn/uvloop) speaking the OpenAI API on top of the
same Router core as the ZeroMQ front end."""
from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.wire.messages import ErrorReply, SubmitRequest, TokenOutput
from common.sampling_params import SamplingParams
from router.core import Router
from router.requests import Prepared, RouteError
from router.http_api import ChatBody, CompletionBody, sampling_fields, unsupported
from router.http_edge import EdgeMiddleware, error, install_error_handlers, sse_error
from router.text import merge_outputs, usage

Body = CompletionBody | ChatBody


def _status_for(code: str) -> int:
    return {"unavailable": 503, "worker_failed": 502, "transfer_error": 502, "overloaded": 429}.get(code, 400)


def _route_error(e: RouteError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return error(_status_for(e.code), str(e), code="rate_limit_exceeded" if e.code == "overloaded" else e.code,
                 headers=headers)


def _completion_content(text: str, first: bool | None) -> dict:
    return {"text": text}


def _chat_content(text: str, first: bool | None) -> dict:
    if first is None:  # the whole, non-streamed answer
        return {"message": {"role": "assistant", "content": text}}
    return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}


@dataclass(frozen=True)
class Shape:
    """How one endpoint's responses read: the id prefix, the object names of a whole
    response and of a chunk, and a choice's text part (`content(text, first)`, where
    `first` is None for a whole response and says whether a chunk is the stream's first)."""

    prefix: str
    obj: str
    chunk_obj: str
    content: Callable[[str, bool | None], dict]


COMPLETION = Shape("cmpl", "text_completion", "text_completion", _completion_content)
CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", _chat_content)


class Envelope:
    """One response's id, creation time and model, around its choices; for a stream it
    also owns whether its first chunk went out (a chat stream's first delta names the
    role)."""

    def __init__(self, shape: Shape, request_id: str, model: str, created: float) -> None:
        self.shape = shape
        self.id = f"{shape.prefix}-{request_id}"
        self.created = int(created)
        self.model = model
        self.first = True

    def wrap(self, kind: str, choices: list, usage: dict | None, timeline: dict | None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **({"usage": usage} if usage else {}), **({"timeline": timeline} if timeline else {})}

    def chunk(self, out: TokenOutput | None, usage: dict | None = None) -> dict:
        """A stream's next chunk: `out`'s tokens, or (None) the usage-only last chunk."""
        if out is None:
            return self.wrap(self.shape.chunk_obj, [], usage, None)
        choice = {"index": 0, **self.shape.content(out.text, self.first), "token_ids": out.token_ids,
                  "logprobs": None, "finish_reason": out.finish_reason}
        self.first = False
        return self.wrap(self.shape.chunk_obj, [choice], usage, out.timeline)

    def whole(self, res: TokenOutput) -> dict:
        """The response of a request that was not streamed (`res`: its merged outputs)."""
        choice = {"index": 0, **self.shape.content(res.text, None), "token_ids": res.token_ids, "logprobs": None,
                  "finish_reason": res.finish_reason}
        return self.wrap(self.shape.obj, [choice], usage(res), res.timeline)


class OpenAIServer:
    """Owns the FastAPI app of the OpenAI API and the Router it submits to. The edge
    limits (body size, API key) are the app's middleware, from the router's config; the
    methods below are the app's handlers."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.model_name = router.config.model_name
        self.app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
        self.app.add_middleware(EdgeMiddleware, max_body_bytes=router.config.max_body_bytes,
                                api_key=router.config.api_key)
        install_error_handlers(self.app)
        # response_model=None: the handlers' return types are not response schemas
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        self.app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], response_model=None)
        self.app.add_api_route("/v1/models", self.models, methods=["GET"], response_model=None)
        self.app.add_api_route("/health", self.health, methods=["GET"], response_model=None)
        self.app.add_api_route("/metrics", self.metrics, methods=["GET"], response_model=None)

    # ---- handlers --------------------------------------------------------------------------
    async def completions(self, body: CompletionBody) -> Response | dict:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return error(400, "a list of several prompts is not supported; send one", param="prompt")
            prompt = prompt[0]
        sub = await self.submission(body, **({"prompt": prompt} if isinstance(prompt, str)
                                             else {"prompt_token_ids": prompt}))
        if isinstance(sub, JSONResponse):
            return sub
        return await self.respond(body, sub, COMPLETION)

    async def chat(self, body: ChatBody) -> Response | dict:
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        sub = await self.submission(body, messages=msgs)
        if isinstance(sub, JSONResponse):
            return sub
        return await self.respond(body, sub, CHAT)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": self.router.config.max_model_len}]}

    async def health(self) -> JSONResponse:
        reg = self.router.registry
        live = {r: len(reg.live((r,))) for r in ("prefill", "decode", "colocated")}
        ok = (live["prefill"] and live["decode"]) or live["colocated"]
        dead = sorted(e.worker_id for e in reg.workers.values() if not e.alive)  # docs/reliability.md
        return JSONResponse({"status": "ok" if ok else "unavailable", "workers": live, "dead": dead},
                            status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(self.router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- one request -----------------------------------------------------------------------
    async def submission(self, body: Body, **prompt: Any) -> Prepared | JSONResponse:
        """The request checked and admitted by the router, or the error response that says why not."""
        if body.model is not None and body.model != self.model_name:
            return error(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                         param="model", code="model_not_found")
        if body.n != 1:
            return error(400, f"n={body.n} is not supported; only n=1", param="n")
        if (name := unsupported(body)) is not None:
            return error(400, f"{name} is not supported by this server; leave it out", param=name,
                         code="unsupported_parameter")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        sampling = SamplingParams.unchecked(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                            max_tokens=16 if max_tokens is None else max_tokens, stop=stop,
                                            seed=body.seed, ignore_eos=body.ignore_eos, **sampling_fields(body))
        sub = SubmitRequest(request_id=uuid.uuid4().hex, sampling=sampling, stream=body.stream,
                            return_timeline=body.return_timeline, **prompt)
        try:  # now, so even a streamed request gets a 4xx (or a 429), not an SSE error
            return await self.router.prepare_async(sub)
        except RouteError as e:
            return _route_error(e)

    async def respond(self, body: Body, sub: Prepared, shape: Shape) -> Response | dict:
        """One OpenAI response, streamed (SSE) or whole."""
        envelope = Envelope(shape, sub.sub.request_id, self.model_name, self.router.clock.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.sse(sub, envelope, include_usage), media_type="text/event-stream")
        outs: list[TokenOutput] = []
        async for out in self.router.generate(sub):
            if isinstance(out, ErrorReply):
                return error(_status_for(out.code), out.message, code=out.code)
            outs.append(out)
        return envelope.whole(merge_outputs(outs))

    async def sse(self, sub: Prepared, envelope: Envelope, include_usage: bool) -> AsyncIterator[str]:
        """The event stream; an error after the 200 is one `data: {"error": ...}` event, and
        `data: [DONE]` always ends the stream."""
        outs: list[TokenOutput] = []
        try:
            async for out in self.router.generate(sub):
                if isinstance(out, ErrorReply):
                    yield sse_error(_status_for(out.code), out.message, out.code)
                    break
                outs.append(out)
                yield f"data: {json.dumps(envelope.chunk(out))}\n\n"
                if out.finished and include_usage:
                    yield f"data: {json.dumps(envelope.chunk(None, usage=usage(merge_outputs(outs))))}\n\n"
        except Exception as e:  # the headers are out: say it in the stream
            print(f"router: stream {sub.sub.request_id} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            yield sse_error(500, f"internal error: {type(e).__name__}", "internal_error")
        yield "data: [DONE]\n\n"
