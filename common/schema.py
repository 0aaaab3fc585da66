"""The one type checker for data from outside the process: wire messages (msgpack) and
config files (JSON) are both checked against their dataclass's field types here.

A dataclass decodes from a map of its field names: unknown fields, missing required
fields and values of the wrong type are refused with an error naming the field by its
path (`generate.sampling.max_tokens`, `engine.block_size`). The caller says which error
to raise (MessageError for messages, ConfigError for configs), so each edge keeps its own
exception while both reject the same bad values with the same words.

Types understood: bool, int, float, str, bytes, None, Any, X | Y, list[X],
tuple[X, ...], dict[K, V] and nested dataclasses. A bool is not an int (True is not a
token id); an int is accepted for a float and becomes one. Torch-free: the router uses it.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, TypeVar, Union

T = TypeVar("T")
Error = type[Exception]  # the edge's exception class: MessageError, ConfigError

_INT = frozenset({int})


class Slot(NamedTuple):
    """One field a map may hold: its type and whether it must be present."""

    type: Any
    required: bool


class _Shape(NamedTuple):
    """A dataclass's fields resolved once (typing.get_type_hints costs ~1 ms a class)."""

    slots: dict[str, Slot]
    make: Callable[..., Any]


@functools.cache
def slots(cls: type) -> dict[str, Slot]:
    """The fields of dataclass `cls` by name (the dict is shared: do not change it)."""
    hints = typing.get_type_hints(cls)
    return {f.name: Slot(hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


@functools.cache
def _shape(cls: type) -> _Shape:
    # a class may name an `unchecked` constructor: its values are range-checked later by
    # whoever serves them, so the refusal can name the request (SamplingParams)
    return _Shape(slots(cls), getattr(cls, "unchecked", cls))


def build(cls: type[T], data: object, where: str, error: Error) -> T:
    """An instance of dataclass `cls` from the map `data`, every field checked; `where`
    names the map in error messages. The dataclass's own validation runs as usual."""
    shape = _shape(cls)
    return shape.make(**check_fields(shape.slots, data, where, error))


def check_fields(fields: Mapping[str, Slot], data: object, where: str, error: Error) -> dict[str, Any]:
    """The values of the map `data`, each checked against its slot in `fields`."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected a map, got {_describe(data)}")
    unknown = data.keys() - fields.keys()
    if unknown:
        raise error(f"{where}: unknown field(s) {', '.join(sorted(map(repr, unknown)))}")
    missing = [name for name, slot in fields.items() if slot.required and name not in data]
    if missing:
        raise error(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
    return {name: check(fields[name].type, v, f"{where}.{name}", error) for name, v in data.items()}


def check(tp: Any, v: Any, where: str, error: Error) -> Any:
    """`v` checked against the type hint `tp`: returned as that type (float for an int,
    a tuple for a list, nested dataclasses built), or `error` naming `where`."""
    if tp is Any:
        return v
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # X | None: X's own error says what is wrong, to the item
            return check(arms[0], v, where, error)
        for arm in arms:
            try:
                return check(arm, v, where, error)
            except error:
                pass
        raise error(f"{where}: expected {' or '.join(map(expected, args))}, got {_describe(v)}")
    if origin is list or origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise error(f"{where}: expected a list, got {_describe(v)}")
        args = typing.get_args(tp)
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            raise TypeError(f"unsupported field type {tp} at {where}: only tuple[X, ...]")  # a bug in a schema
        item = args[0]
        if item is int and _INT.issuperset(map(type, v)):  # token ids: the long, common case
            out = v
        else:
            out = [check(item, x, f"{where}[{i}]", error) for i, x in enumerate(v)]
        if origin is tuple:
            return tuple(out)
        return out if type(out) is list else list(out)
    if origin is dict:
        if not isinstance(v, dict):
            raise error(f"{where}: expected a map, got {_describe(v)}")
        karg, varg = typing.get_args(tp)
        return {check(karg, k, where, error): check(varg, x, f"{where}[{k!r}]", error) for k, x in v.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, v, where, error)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    elif tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    elif tp is str or tp is bool or tp is bytes:
        if isinstance(v, tp):
            return v
    elif tp is type(None):
        if v is None:
            return v
    else:
        raise TypeError(f"unsupported field type {tp} at {where}")  # a bug in a schema, not input
    raise error(f"{where}: expected {expected(tp)}, got {_describe(v)}")


_EXPECTED = {int: "an integer", float: "a number", str: "str", bool: "bool", bytes: "binary data", type(None): "null"}


def expected(tp: Any) -> str:
    """How an error message names what type `tp` wants."""
    if typing.get_origin(tp) in (list, tuple):
        return "a list"
    if typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        return "a map"
    return _EXPECTED.get(tp, str(tp))


def _describe(v: object) -> str:
    """A received value, for an error message: its type, and a short scalar itself."""
    kind = "null" if v is None else type(v).__name__
    if isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 40):
        return f"{kind} {v!r}"
    return kind
