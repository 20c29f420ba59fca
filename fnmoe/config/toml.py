"""TOML presets <-> config dataclasses: read a preset (`load_config`), write a resolved config (`to_toml`).

A preset's tables mirror the dataclass tree; an unknown key is an error naming it.
"""
from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from fnmoe.config.check import validate
from fnmoe.config.schema import RunConfig


def from_dict(cls: type, d: dict[str, Any], where: str = "") -> Any:
    """Build a dataclass from a nested dict; unknown keys are errors naming the key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in d.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ValueError(f"config: unknown key '{where}{key}' (known: {', '.join(sorted(fields))})")
        ftype = fields[name].default_factory if fields[name].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(ftype):
            if not isinstance(value, dict):
                raise ValueError(f"config: '{where}{key}' must be a table, got {value!r}")
            value = from_dict(ftype, value, f"{where}{key}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else (list(v) if isinstance(v, tuple) else v)
    return out


def to_toml(cfg: Any) -> str:
    """Serialise a config tree as TOML (tables for nested dataclasses)."""
    lines: list[str] = []

    def emit(d: dict, prefix: str) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        if prefix and scalars:
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        if scalars:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(to_dict(cfg), "")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def load_config(path: str | Path, validate_config: bool = True) -> RunConfig:
    """Read a TOML preset into a RunConfig (named after the file's stem) and validate it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        d = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path}: invalid TOML: {e}") from None
    d.setdefault("name", path.stem)
    cfg = from_dict(RunConfig, d)
    return validate(cfg) if validate_config else cfg
