"""What a decode (or colocated) worker sends the router per loop turn: every request's
output entry of the turn, gathered per router connection and sent as one `StepOutputs`
message (vLLM and mini-sglang send one output batch per engine step, not a message per
token per request)."""
from __future__ import annotations

from pdserve.common.wire.messages import RequestOutput


class Outbox:
    """Owns the entries produced since the last flush, per router connection (its
    ZeroMQ identity), one per request and choice (n > 1), in the order the requests first produced one (a
    request whose KV landed this turn and then decoded in the step has both tokens in
    one entry)."""

    def __init__(self) -> None:
        self._entries: dict[bytes, dict[tuple[str, int], RequestOutput]] = {}

    def add(self, identity: bytes, entry: RequestOutput) -> None:
        entries = self._entries.setdefault(identity, {})
        key = (entry.request_id, entry.index)
        last = entries.get(key)
        if last is None:
            entries[key] = entry
            return
        # invariant: nothing follows a finished entry (the request has left the worker)
        assert not last.finished, f"request {entry.request_id} choice {entry.index}: output after its last one"
        last.token_ids += entry.token_ids
        if entry.logprobs:  # a request that asks has one per token; an entry without tokens has none
            last.logprobs = (last.logprobs or []) + entry.logprobs
        last.finished, last.finish_reason, last.timeline = entry.finished, entry.finish_reason, entry.timeline
        if entry.num_prompt_tokens:
            last.num_prompt_tokens, last.num_cached_tokens = entry.num_prompt_tokens, entry.num_cached_tokens
        if entry.prompt_logprobs is not None:  # on a request's first entry only
            last.prompt_logprobs = entry.prompt_logprobs
        last.num_draft_tokens += entry.num_draft_tokens
        last.num_accepted_tokens += entry.num_accepted_tokens

    def take(self, identity: bytes) -> list[RequestOutput]:
        """One connection's entries, removed (an error for a request must follow its tokens)."""
        return list(self._entries.pop(identity, {}).values())

    def take_all(self) -> list[tuple[bytes, list[RequestOutput]]]:
        entries, self._entries = self._entries, {}
        return [(identity, list(e.values())) for identity, e in entries.items()]

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
