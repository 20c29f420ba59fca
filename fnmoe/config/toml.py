"""TOML presets <-> config dataclasses: read a preset (`load_config`), write a resolved config (`to_toml`).

A preset's tables mirror the dataclass tree; an unknown key, or a value not of its field's type
(fnmoe/config/types.py), is an error naming the file and the field. The presets ship in the package
(fnmoe/presets/, which a checkout's configs/ links to), so a bare name ("tiny") reads one from an
installed fnmoe too.
"""
from __future__ import annotations

import dataclasses
import logging
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from fnmoe.config import types
from fnmoe.config.check import validate
from fnmoe.config.schema import RunConfig


def from_dict(cls: type, d: dict[str, Any], where: str = "", source: str = "config") -> Any:
    """Build a dataclass from a nested dict read from `source` (a file's name). An unknown key or a
    value of the wrong type is an error naming source, field, value and expected type; every such
    problem at once, before anything is built."""
    errors: list[str] = []
    cfg = _build(cls, d, where, errors)
    if errors:
        raise ValueError("\n".join(f"{source}: {e}" for e in errors))
    return cfg


def _build(cls: type, d: dict[str, Any], where: str, errors: list[str]) -> Any:
    fields = types.hints(cls)
    kwargs = {}
    for key, value in d.items():
        name = key.replace("-", "_")
        if name not in fields:
            errors.append(f"unknown key '{where}{key}' (known: {', '.join(sorted(fields))})")
        elif dataclasses.is_dataclass(fields[name]):
            if isinstance(value, dict):
                kwargs[name] = _build(fields[name], value, f"{where}{key}.", errors)
            else:
                errors.append(f"{where}{key} = {types.show(value)} is {types.kind(value)}, expected a table")
        elif (elem := types.dataclass_elements(fields[name])) and isinstance(value, list):
            # a list of tables (data.mix): each built like a nested table, named by its index
            built = [_build(elem, v, f"{where}{key}[{i}].", errors) if isinstance(v, dict) else
                     errors.append(f"{where}{key}[{i}] = {types.show(v)} is {types.kind(v)}, expected a table")
                     for i, v in enumerate(value)]
            kwargs[name] = tuple(built)
        elif problems := types.type_errors(value, fields[name], f"{where}{key}"):
            errors += problems
        else:
            kwargs[name] = _normal(value, fields[name])
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d:
            errors.append(f"{where}{f.name} is missing (a {cls.__name__} needs it)")
    return None if errors else cls(**kwargs)


def _normal(value: Any, hint: Any) -> Any:
    """A checked value as the dataclass holds it: lists as tuples, a float field's int as a float."""
    if isinstance(value, list):
        return tuple(value)
    return float(value) if types.split(hint)[0] is float else value


def to_dict(cfg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = [to_dict(x) if dataclasses.is_dataclass(x) else x for x in v]
        else:
            out[f.name] = v
    return out


def to_toml(cfg: Any) -> str:
    """Serialise a config tree as TOML (tables for nested dataclasses)."""
    lines: list[str] = []

    def emit(d: dict, prefix: str) -> None:
        # TOML has no null: a field left None (a plan figure taken from the hardware profile) is left out
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and v is not None}
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
    if isinstance(v, dict):  # an element of a list of tables, as an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} to TOML")


def with_token_steps(cfg: RunConfig) -> RunConfig:
    """cfg with train.steps set from train.tokens (unchanged without tokens): for a config that
    gives the tokens and not the steps."""
    if cfg.train.tokens <= 0:  # none (a negative one is refused by its own range check)
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=cfg.token_steps))


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file, with one line naming the file when it is missing or not TOML."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config {path} is a directory; it must name a TOML file")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"config {path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path}: invalid TOML: {e}") from None
    except OSError as e:
        raise ValueError(f"config {path}: cannot read ({e.strerror})") from None


def drop_unknown(cls: type, d: dict[str, Any], where: str = "") -> tuple[dict[str, Any], list[str]]:
    """(d without the keys that no field of cls has, at any depth; those keys' dotted names): a
    config written by a release with more fields, read by this one."""
    fields, kept, unknown = types.hints(cls), {}, []
    for key, value in d.items():
        hint = fields.get(key.replace("-", "_"))
        if hint is None:
            unknown.append(f"{where}{key}")
        elif dataclasses.is_dataclass(hint) and isinstance(value, dict):
            kept[key], deeper = drop_unknown(hint, value, f"{where}{key}.")
            unknown += deeper
        else:
            kept[key] = value
    return kept, unknown


def config_from_tables(d: dict[str, Any], source: Path, validate_config: bool = True) -> RunConfig:
    """A RunConfig from a TOML file's tables (named after the file's stem), every value checked
    against its field's type, and validated."""
    d = {"name": source.stem, **d}
    cfg = from_dict(RunConfig, d, source=str(source))
    train = d.get("train")
    if isinstance(train, dict) and "steps" not in train:  # a preset that states its budget in tokens
        cfg = with_token_steps(cfg)
    return validate(cfg) if validate_config else cfg


def preset_path(path: str | Path) -> Path:
    """path as a Path; a bare name (a str without a directory or suffix: "tiny") is the shipped
    preset of that name, or where there is none a file of that name here, a FileNotFoundError
    listing the presets when neither is. With both, the preset is taken and a warning says so (and
    how to read the file)."""
    if not isinstance(path, str) or Path(path).name != path or Path(path).suffix:
        return Path(path)
    presets = Path(str(resources.files("fnmoe").joinpath("presets")))
    here = Path(path)
    if not (presets / f"{path}.toml").is_file():
        if here.is_file():
            return here
        names = ", ".join(sorted(p.stem for p in presets.glob("*.toml")))
        raise FileNotFoundError(f"no preset named {path!r} (presets: {names}) and no file {path} here; a config file "
                                f"elsewhere is named by its path (dir/{path}.toml)")
    if here.is_file():
        logging.getLogger("fnmoe").warning("config %r: took the preset %s, not the file ./%s here (--config ./%s reads "
                                           "the file)", path, presets / f"{path}.toml", path, path)
    return presets / f"{path}.toml"


def load_config(path: str | Path, validate_config: bool = True) -> RunConfig:
    """Read a TOML preset into a RunConfig (named after the file's stem), every value checked
    against its field's type, and validate it. path is a TOML file, or the name of a preset that
    ships with fnmoe ("tiny", "kimi_k2_1t": preset_path)."""
    path = preset_path(path)
    return config_from_tables(read_toml(path), path, validate_config)
