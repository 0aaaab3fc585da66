"""A chat request's tools, as OpenAI and vLLM take them: `tools`, `tool_choice` and
`parallel_tool_calls`, checked at the edge (ToolError names the field). A named or
`"required"` choice becomes a structured-output grammar, so it works on any model;
`"auto"` lets the model write calls in its own format, for the server's
`--tool-call-parser` to read (router/parsers/tool_calls.py). As vLLM: `tool_choice` defaults to
`"auto"` when tools are given, and `"auto"` needs `--enable-auto-tool-choice` and a parser."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.common.sampling_params import StructuredOutput

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for a function's name
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """The request's tools cannot be served as given; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for: the tools its chat template renders (as given),
    `choice` ("none", "auto", "required" or "named", with `name`), and whether several
    calls may come (`parallel`)."""

    tools: list[dict[str, Any]]
    choice: str
    name: str | None = None
    parallel: bool = True

    def parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or EMPTY_PARAMETERS

    def structured(self) -> StructuredOutput | None:
        """The grammar a named or required choice is enforced with: the function's
        parameters, or (vLLM's form) a list of {"name", "parameters"} objects, one of each
        tool's (at most one when parallel calls are off)."""
        if self.choice == "named":
            return StructuredOutput("json", json.dumps(self.parameters(self.name or "")))
        if self.choice != "required":
            return None
        defs = lifted_defs(self.tools)  # at the root, where each tool's "#/$defs/..." refs point
        items = []
        for t in self.tools:
            params = dict(self.parameters(t["function"]["name"]))
            params.pop("$defs", None)
            items.append({"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                         "parameters": params}, "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return StructuredOutput("json", json.dumps(schema))


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
              auto_ready: bool, has_grammar: bool = False) -> ToolPlan | None:
    """The plan of a request's tool fields (None: no tools, nothing to do); ToolError when
    they are malformed, name a function not in `tools`, ask for "auto" on a server not
    started for it (`auto_ready`: --enable-auto-tool-choice with a --tool-call-parser), or
    force a call where the request brings its own grammar (`has_grammar`)."""
    tools = tools or []
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]")
    names = [t["function"]["name"] for t in tools]
    choice, name = _choice(tool_choice, bool(tools))
    if choice != "none" and not tools:
        raise ToolError("tool_choice", f"tool_choice {choice!r} needs `tools`")
    if choice == "named" and name not in names:
        raise ToolError("tool_choice", f"tool_choice names the function {name!r}, which is not in `tools`")
    if choice == "auto" and not auto_ready:
        raise ToolError("tool_choice", 'tool_choice "auto" (the default when tools are given) needs a server '
                                       'started with --enable-auto-tool-choice and --tool-call-parser; or set '
                                       'tool_choice to "none", "required" or a named function')
    if choice == "required":
        lifted_defs(tools)
    if has_grammar and choice in ("named", "required"):
        raise ToolError("tool_choice", "a named or required tool_choice is enforced with a grammar of its own: "
                                       "leave out response_format / structured_outputs")
    if not tools:
        return None
    return ToolPlan(tools, choice, name, parallel is not False)


def lifted_defs(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Every tool's parameters' `$defs` in one map (a "required" choice's one schema);
    ToolError where two tools define a name differently."""
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        for key, value in ((tool["function"].get("parameters") or {}).get("$defs") or {}).items():
            if defs.setdefault(key, value) != value:
                raise ToolError(f"tools[{i}].function.parameters", f'tools[{i}].function.parameters defines '
                                f'$defs.{key} unlike an earlier tool, which tool_choice "required" cannot join')
    return defs


def _choice(tool_choice: Any, have_tools: bool) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if have_tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        return "named", tool_choice["function"]["name"]
    raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                   '{"type": "function", "function": {"name": ...}}')


def _check_tool(tool: dict[str, Any], where: str) -> None:
    fn = tool["function"]
    if not NAME.fullmatch(fn["name"]):
        raise ToolError(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, '_', "
                                                  f"'-' or '.', got {fn['name'][:80]!r}")
    params = fn.get("parameters")
    if params is None:
        return
    from pdserve.common.engine.grammar import GrammarError, check  # xgrammar: only when tools are given
    try:
        check(StructuredOutput("json", json.dumps(params)))
    except (GrammarError, ValueError) as e:
        raise ToolError(f"{where}.function.parameters", f"{where}.function.parameters is not a JSON schema "
                                                        f"this server can follow: {e}") from None


def wire_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template: `arguments` JSON text read
    into an object where it parses (as vLLM does: templates render it with tojson; empty
    is {}), kept as text where it does not."""
    out = []
    for call in calls:
        fn = dict(call["function"])
        try:
            fn["arguments"] = json.loads(fn["arguments"]) if fn.get("arguments") else {}
        except (TypeError, ValueError):
            pass
        out.append({**call, "function": fn})
    return out
