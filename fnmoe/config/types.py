"""Each config field's own check, read from its annotation: its type, a Literal's choices, a `Range`'s
bounds, finiteness for floats and the int64 range for ints.

A value read from a file (TOML, a checkpoint's config.toml, a tree's index.json) is checked here
before any dataclass is built from it, and a built config again by `field_errors` (configs made in
code). A problem reads `model.dim = "128" is a str, expected int`: the field, the value as the file
writes it, its type and the expected one. Floats take ints (TOML writes `lr = 1`); ints take no
floats (2.5) and bools no 0/1; tuples are checked element by element.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Annotated, Any, Literal

from fnmoe.config.ranges import INT64, Range


def read_json(path, error: type[Exception] = ValueError, obj: bool = True) -> Any:
    """The JSON in the file at path (with obj, which is the default, a JSON object), or `error` naming
    the file: how every index.json (a checkpoint's, a tree's, a prepared corpus's) and config.json
    is read before its fields are checked."""
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if obj and not isinstance(out, dict):
        raise error(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Field name -> annotation of a config dataclass, Annotated extras (a Range) kept."""
    return typing.get_type_hints(cls, include_extras=True)


def split(hint: Any) -> tuple[Any, Range | None]:
    """(the type of an annotation without Annotated, its Range or None)."""
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        return base, next((x for x in extras if isinstance(x, Range)), None)
    return hint, None


def dataclass_elements(hint: Any) -> type | None:
    """The element type of a tuple-of-dataclasses annotation (data.mix), else None."""
    base, _ = split(hint)
    if typing.get_origin(base) is tuple:
        elem = typing.get_args(base)[0]
        return elem if dataclasses.is_dataclass(elem) else None
    return None


def describe(hint: Any) -> str:
    """An annotation in words: int, float, a list of int, ..."""
    base, _ = split(hint)
    origin = typing.get_origin(base)
    if origin is tuple:
        elem = typing.get_args(base)[0]
        return "a list of tables" if dataclasses.is_dataclass(elem) else f"a list of {describe(elem)}"
    if origin is Literal:
        return " or ".join(sorted({type(a).__name__ for a in typing.get_args(base)}))
    if origin in (typing.Union, types.UnionType):  # None is a field left unset: no file writes it
        return " or ".join(describe(a) for a in typing.get_args(base) if a is not type(None))
    return getattr(base, "__name__", str(base))


def show(value: Any) -> str:
    """value as a TOML or JSON file writes it ("128", 2.5, true, [1, 2])."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def kind(value: Any) -> str:
    """'a str', 'an int', ...: value's type with its article."""
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _fits(value: Any, base: Any) -> bool:
    origin = typing.get_origin(base)
    if origin is Literal:  # the choices' type; which choice is the choice check's
        return any(type(value) is type(a) for a in typing.get_args(base))
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, split(a)[0]) for a in typing.get_args(base))
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is str:
        return isinstance(value, str)
    return isinstance(value, base) if isinstance(base, type) else True  # dict, list, None


def type_errors(value: Any, hint: Any, name: str) -> list[str]:
    """[] when value is of the annotation's type, else the problem(s), naming the field (elements
    of a tuple by index)."""
    base, _ = split(hint)
    if typing.get_origin(base) is tuple:
        if not isinstance(value, (list, tuple)):
            return [f"{name} = {show(value)} is {kind(value)}, expected {describe(base)}"]
        (elem, *_), out = typing.get_args(base), []
        for i, v in enumerate(value):
            out += type_errors(v, elem, f"{name}[{i}]")
        return out
    if _fits(value, base):
        return []
    return [f"{name} = {show(value)} is {kind(value)}, expected {describe(base)}"]


def field_errors(obj: Any, where: str = "") -> list[str]:
    """Every field of a config dataclass (and of the ones nested in it) that is not what its
    annotation says: of the wrong type, not one of its Literal's choices, outside its Range, or a
    float that is not finite. One problem per field."""
    out = []
    for f in dataclasses.fields(obj):
        value, hint, name = getattr(obj, f.name), hints(type(obj))[f.name], f"{where}{f.name}"
        if dataclasses.is_dataclass(hint):
            out += field_errors(value, f"{name}.") if isinstance(value, hint) else \
                [f"{name} = {value!r} is {kind(value)}, expected {hint.__name__}"]
            continue
        problem = type_errors(value, hint, name)
        if not problem and dataclass_elements(hint):
            for i, v in enumerate(value):
                out += field_errors(v, f"{name}[{i}].")
            continue
        out += problem or _value_errors(value, hint, name)
    return out


def _value_errors(value: Any, hint: Any, name: str) -> list[str]:
    """The problem of a value of the right type: not a choice, not finite, out of range."""
    base, bounds = split(hint)
    if typing.get_origin(base) is Literal and value not in typing.get_args(base):
        return [f"{name} must be one of {typing.get_args(base)}, got {value!r}"]
    if base is float and not math.isfinite(value):
        return [f"{name} must be finite, got {value}"]
    if bounds is not None and value not in bounds:
        return [f"{name} must be {bounds}, got {value}"]
    if base is int and value not in INT64:
        return [f"{name} = {value} does not fit in a 64-bit integer ({INT64})"]
    return []
