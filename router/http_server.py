"""The HTTP front end (FastAPI on uvicorn/uvloop) speaking the OpenAI API on top of the
same Router core as the ZeroMQ front end."""
from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.wire.messages import ErrorReply, SubmitRequest, TokenOutput
from common.sampling_params import SamplingParams
from router.core import Router
from router.requests import Prepared, RouteError
from router.http_api import ChatBody, CompletionBody, unsupported
from router.http_edge import EdgeMiddleware, error, install_error_handlers, sse_error
from router.text import merge_outputs, usage


def _status_for(code: str) -> int:
    return {"unavailable": 503, "worker_failed": 502, "transfer_error": 502, "overloaded": 429}.get(code, 400)


def _route_error(e: RouteError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return error(_status_for(e.code), str(e), code="rate_limit_exceeded" if e.code == "overloaded" else e.code,
                 headers=headers)


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    model_name = router.config.model_name
    app.add_middleware(EdgeMiddleware, max_body_bytes=router.config.max_body_bytes, api_key=router.config.api_key)
    install_error_handlers(app)

    async def submission(body, **prompt: Any) -> Prepared | JSONResponse:
        if body.model is not None and body.model != model_name:
            return error(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                         param="model", code="model_not_found")
        if body.n != 1:
            return error(400, f"n={body.n} is not supported; only n=1", param="n")
        if (name := unsupported(body)) is not None:
            return error(400, f"{name} is not supported by this server; leave it out", param=name,
                         code="unsupported_parameter")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        sampling = SamplingParams.unchecked(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            max_tokens=16 if max_tokens is None else max_tokens, stop=stop, seed=body.seed,
                            ignore_eos=body.ignore_eos)
        sub = SubmitRequest(request_id=uuid.uuid4().hex, sampling=sampling, stream=body.stream,
                            return_timeline=body.return_timeline, **prompt)
        try:  # now, so even a streamed request gets a 4xx (or a 429), not an SSE error
            return await router.prepare_async(sub)
        except RouteError as e:
            return _route_error(e)

    async def collect(sub: Prepared) -> tuple[dict | None, JSONResponse | None]:
        outs: list[TokenOutput] = []
        async for out in router.generate(sub):
            if isinstance(out, ErrorReply):
                return None, error(_status_for(out.code), out.message, code=out.code)
            outs.append(out)
        res = merge_outputs(outs)
        return {"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                "usage": usage(res), "timeline": res.timeline}, None

    async def sse(sub: Prepared, chunk, include_usage: bool) -> AsyncIterator[str]:
        """The event stream; an error after the 200 is one `data: {"error": ...}` event, and
        `data: [DONE]` always ends the stream."""
        outs: list[TokenOutput] = []
        try:
            async for out in router.generate(sub):
                if isinstance(out, ErrorReply):
                    yield sse_error(_status_for(out.code), out.message, out.code)
                    break
                outs.append(out)
                yield f"data: {json.dumps(chunk(out))}\n\n"
                if out.finished and include_usage:
                    yield f"data: {json.dumps(chunk(None, usage=usage(merge_outputs(outs))))}\n\n"
        except Exception as e:  # the headers are out: say it in the stream
            print(f"router: stream {sub.sub.request_id} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            yield sse_error(500, f"internal error: {type(e).__name__}", "internal_error")
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return error(400, "a list of several prompts is not supported; send one", param="prompt")
            prompt = prompt[0]
        sub = await submission(body, **({"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}))
        if isinstance(sub, JSONResponse):
            return sub
        return await respond(body, sub, "cmpl", "text_completion", "text_completion",
                             lambda text, first: {"text": text})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        sub = await submission(body, messages=msgs)
        if isinstance(sub, JSONResponse):
            return sub

        def content(text: str, first: bool | None) -> dict:
            if first is None:  # the whole, non-streamed answer
                return {"message": {"role": "assistant", "content": text}}
            return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}

        return await respond(body, sub, "chatcmpl", "chat.completion", "chat.completion.chunk", content)

    async def respond(body, sub: Prepared, prefix: str, obj: str, chunk_obj: str, content):
        """One OpenAI response, streamed (SSE) or whole; `content(text, first)` shapes a
        choice's text part (`first` is None for a whole response)."""
        rid, created = f"{prefix}-{sub.sub.request_id}", int(time.time())

        def envelope(kind: str, choices: list, usage: dict | None, timeline: dict | None) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
                    **({"usage": usage} if usage else {}), **({"timeline": timeline} if timeline else {})}

        if body.stream:
            first = [True]

            def chunk(out: TokenOutput | None, usage: dict | None = None) -> dict:
                if out is None:
                    return envelope(chunk_obj, [], usage, None)
                choice = {"index": 0, **content(out.text, first[0]), "token_ids": out.token_ids, "logprobs": None,
                          "finish_reason": out.finish_reason}
                first[0] = False
                return envelope(chunk_obj, [choice], usage, out.timeline)

            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(sub, chunk, include), media_type="text/event-stream")
        res, err = await collect(sub)
        if err:
            return err
        choice = {"index": 0, **content(res["text"], None), "token_ids": res["token_ids"], "logprobs": None,
                  "finish_reason": res["finish_reason"]}
        return envelope(obj, [choice], res["usage"], res["timeline"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                                            "max_model_len": router.config.max_model_len}]}

    @app.get("/health")
    async def health():
        reg = router.registry
        live = {r: len(reg.live((r,))) for r in ("prefill", "decode", "colocated")}
        ok = (live["prefill"] and live["decode"]) or live["colocated"]
        dead = sorted(e.worker_id for e in reg.workers.values() if not e.alive)  # docs/reliability.md
        return JSONResponse({"status": "ok" if ok else "unavailable", "workers": live, "dead": dead},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
