"""The one type checker for data from outside the process: wire messages (msgpack) and
config files (JSON) are both checked against their dataclass's field types here.

A dataclass decodes from a map of its field names: unknown fields, missing required
fields and values of the wrong type are refused with an error naming the field by its
path (`generate.sampling.max_tokens`, `engine.block_size`). The caller says which error
to raise (MessageError for messages, ConfigError for configs), so each edge keeps its own
exception while both reject the same bad values with the same words.

Types understood: bool, int, float, str, bytes, None, Any, X | Y, list[X],
tuple[X, ...], tuple[X, Y] (fixed length), dict[K, V] and nested dataclasses. A bool is not an int (True is not a
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
Check = Callable[[Any, str, Error], Any]  # (value, where, error) -> the value as its type

_INT = frozenset({int})


class Slot(NamedTuple):
    """One field a map may hold: its type, whether it must be present, and the checker
    built for the type (`slot()` makes one)."""

    type: Any
    required: bool
    check: Check


def slot(tp: Any, required: bool) -> Slot:
    return Slot(tp, required, _checker(tp))


class _Shape(NamedTuple):
    """A dataclass's fields and their checkers, built once (typing.get_type_hints alone
    costs ~1 ms a class; checking through prebuilt closures is ~3x faster than
    inspecting the type hints on every message)."""

    slots: dict[str, Slot]
    required: frozenset[str]
    make: Callable[..., Any]


@functools.cache
def slots(cls: type) -> dict[str, Slot]:
    """The fields of dataclass `cls` by name (the dict is shared: do not change it)."""
    hints = typing.get_type_hints(cls)
    return {f.name: slot(hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


@functools.cache
def _shape(cls: type) -> _Shape:
    fields = slots(cls)
    # a class may name an `unchecked` constructor: its values are range-checked later by
    # whoever serves them, so the refusal can name the request (SamplingParams)
    return _Shape(fields, frozenset(n for n, s in fields.items() if s.required), getattr(cls, "unchecked", cls))


def build(cls: type[T], data: object, where: str, error: Error) -> T:
    """An instance of dataclass `cls` from the map `data`, every field checked; `where`
    names the map in error messages. The dataclass's own validation runs as usual."""
    shape = _shape(cls)
    return shape.make(**_check_map(shape.slots, shape.required, data, where, error))


def check_fields(fields: Mapping[str, Slot], data: object, where: str, error: Error) -> dict[str, Any]:
    """The values of the map `data`, each checked against its slot in `fields`."""
    return _check_map(fields, frozenset(n for n, s in fields.items() if s.required), data, where, error)


def _check_map(fields: Mapping[str, Slot], required: frozenset[str], data: object, where: str,
               error: Error) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise error(f"{where}: expected a map, got {_describe(data)}")
    unknown = data.keys() - fields.keys()
    if unknown:
        raise error(f"{where}: unknown field(s) {', '.join(sorted(map(repr, unknown)))}")
    if not required <= data.keys():
        missing = [name for name in fields if name in required and name not in data]
        raise error(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
    return {name: fields[name].check(v, f"{where}.{name}", error) for name, v in data.items()}


# ---- one checker per type hint, built once --------------------------------------------------

@functools.cache
def _checker(tp: Any) -> Check:
    """The function that checks a value against the type hint `tp` and returns it as
    that type (float for an int, a tuple for a list, nested dataclasses built)."""
    if tp is Any:
        return lambda v, where, error: v
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _union(tp)
    if origin is list or origin is tuple:
        return _sequence(tp)
    if origin is dict:
        return _mapping(tp)
    if dataclasses.is_dataclass(tp):
        return lambda v, where, error: build(tp, v, where, error)  # type: ignore[arg-type]
    if tp in _EXPECTED:
        return _scalar(tp)
    raise TypeError(f"unsupported field type {tp}")  # a bug in a schema, not input


def _union(tp: Any) -> Check:
    args = typing.get_args(tp)
    arms = [a for a in args if a is not type(None)]
    if len(arms) == 1:  # X | None: X's own error says what is wrong, down to the item
        arm = _checker(arms[0])
        return lambda v, where, error: None if v is None else arm(v, where, error)
    checks = [_checker(a) for a in args]

    def check(v: Any, where: str, error: Error) -> Any:
        for c in checks:
            try:
                return c(v, where, error)
            except error:
                pass
        raise error(f"{where}: expected {' or '.join(map(_expected, args))}, got {_describe(v)}")
    return check


def _sequence(tp: Any) -> Check:
    args = typing.get_args(tp)
    as_tuple = typing.get_origin(tp) is tuple
    if as_tuple and (len(args) != 2 or args[1] is not Ellipsis):
        return _record(tp)
    item, ints = _checker(args[0]), args[0] is int

    def check(v: Any, where: str, error: Error) -> Any:
        if not isinstance(v, (list, tuple)):
            raise error(f"{where}: expected a list, got {_describe(v)}")
        if ints and _INT.issuperset(map(type, v)):  # token ids, the long common case: one C-level pass
            out = v
        else:
            out = [item(x, f"{where}[{i}]", error) for i, x in enumerate(v)]
        if as_tuple:
            return tuple(out)
        return out if type(out) is list else list(out)
    return check


def _record(tp: Any) -> Check:
    """tuple[X, Y, ...] of fixed length: a list of exactly those items (a pair such as a
    logit bias's (token id, bias), where a map would need keys msgpack refuses)."""
    items = [_checker(a) for a in typing.get_args(tp)]

    def check(v: Any, where: str, error: Error) -> Any:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise error(f"{where}: expected a list of {len(items)} items, got {_describe(v)}")
        return tuple(c(x, f"{where}[{i}]", error) for i, (c, x) in enumerate(zip(items, v)))
    return check


def _mapping(tp: Any) -> Check:
    key, value = map(_checker, typing.get_args(tp))

    def check(v: Any, where: str, error: Error) -> Any:
        if not isinstance(v, dict):
            raise error(f"{where}: expected a map, got {_describe(v)}")
        return {key(k, where, error): value(x, f"{where}[{k!r}]", error) for k, x in v.items()}
    return check


def _scalar(tp: type) -> Check:
    if tp is float:
        def ok(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)
    elif tp is int:
        def ok(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)  # True is not a token id
    elif tp is type(None):
        def ok(v: Any) -> bool:
            return v is None
    else:
        def ok(v: Any) -> bool:
            return isinstance(v, tp)
    convert = float if tp is float else None

    def check(v: Any, where: str, error: Error) -> Any:
        if not ok(v):
            raise error(f"{where}: expected {_expected(tp)}, got {_describe(v)}")
        return convert(v) if convert is not None else v
    return check


_EXPECTED = {int: "an integer", float: "a number", str: "str", bool: "bool", bytes: "binary data", type(None): "null"}


def _expected(tp: Any) -> str:
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
