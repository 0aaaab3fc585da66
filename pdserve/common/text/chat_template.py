"""A model folder's chat template(s), found where transformers looks for them and rendered
as transformers renders them, in a sandbox: a model folder must not be able to run code.

Sources, first found wins: `chat_template.jinja` (+ `additional_chat_templates/*.jinja`),
`chat_template.json`, then `tokenizer_config.json`'s `chat_template` as a string or as a
list of named templates (`default`, `tool_use`, ...)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.common.config import ConfigError, read_json


class ChatTemplateError(ValueError):
    """Rendering failed for these messages (the template raised, or they do not fit it)."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # as transformers: jinja's own tojson escapes HTML characters, which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def find_templates(model_dir: Path, tokenizer_config: dict) -> tuple[dict[str, str], str]:
    """({name: template source}, where they came from); empty when the folder has none."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates = {"default": jinja_file.read_text(encoding="utf-8")}
        extra = model_dir / "additional_chat_templates"
        if extra.is_dir():
            templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
        return templates, str(jinja_file)
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        found, where = read_json(json_file).get("chat_template"), str(json_file)
    else:
        found, where = tokenizer_config.get("chat_template"), str(model_dir / "tokenizer_config.json")
    if found is None:
        return {}, where
    if isinstance(found, str):
        return {"default": found}, where
    if isinstance(found, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in found):
        return {t["name"]: t["template"] for t in found}, where
    raise ConfigError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


class ChatTemplate:
    """Owns a model's compiled chat templates and the special-token strings they are given."""

    def __init__(self, templates: dict[str, str], where: str, tokenizer_config: dict) -> None:
        env = _environment()
        try:
            self._compiled = {name: env.from_string(src) for name, src in templates.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{where}: chat template has a syntax error at line {e.lineno}: {e.message}") from None
        self.where = where
        # transformers passes every named special token (bos_token, eos_token, ...) to the template
        self._special = {key: _token_text(tokenizer_config.get(key)) for key in
                         ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}

    @property
    def names(self) -> list[str]:
        return sorted(self._compiled)

    def _pick(self, tools: list[dict] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        raise ChatTemplateError(f"{self.where} has several chat templates {self.names} and none named 'default'")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict[str, Any] | None = None) -> str:
        """The rendered prompt; `variables` are extra template variables (a request's
        chat_template_kwargs), which may not replace the ones the request's fields set."""
        template = self._pick(tools)
        extra = variables or {}
        taken = sorted({"messages", "add_generation_prompt", "tools", "documents"} & extra.keys())
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own "
                                    f"fields say that")
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   documents=None, **{**self._special, **extra})
        except jinja2.TemplateError as e:  # raise_exception(...) and errors inside the template
            raise ChatTemplateError(f"chat template: {e}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise ChatTemplateError(f"chat template cannot render these messages: {e}") from None


def load_chat_template(model_dir: Path, tokenizer_config: dict) -> ChatTemplate | None:
    templates, where = find_templates(model_dir, tokenizer_config)
    return ChatTemplate(templates, where, tokenizer_config) if templates else None
