"""Parsers of a model's own output, behind one registry: tool calls (vLLM's
`--tool-call-parser`) and reasoning (`--reasoning-parser`), by the names those flags take."""
from __future__ import annotations

from pdserve.router.parsers.reasoning import ReasoningSplitter
from pdserve.router.parsers.tool_calls import HermesParser

# name -> the incremental parser one output's text goes through
TOOL_CALL_PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}
# both split at </think>; `qwen3` also honours `enable_thinking: false` (reasoning.thinking_on)
REASONING_PARSERS: dict[str, type[ReasoningSplitter]] = {"qwen3": ReasoningSplitter, "deepseek_r1": ReasoningSplitter}
