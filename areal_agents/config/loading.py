"""`load_config`: a config dataclass from a YAML file plus ``a.b=c`` overrides, every key checked.

An unknown key or a value of the wrong type is a `ConfigError` that names the key and where it came
from (the file, or the override), with a near-match suggestion. Hand-written rather than OmegaConf for
exactly these messages and for ``Literal`` choices, which OmegaConf's structured configs do not support.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from areal_agents.errors import ConfigError, did_you_mean

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build ``cls`` from a YAML file and ``a.b=c`` overrides; raise `ConfigError` naming the key."""
    data: dict[str, Any] = {}
    source = "defaults"
    set_by: dict[str, str] = {}  # dotted key -> the override that set it, so an error names the override
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}".replace("\n", " ")) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expects a mapping at the top level, got {type(loaded).__name__}")
        data = loaded or {}
        _check_keys(cls, data, "", f"in {path}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expects the form key.sub=value")
        where = f"in override {item!r}"
        _check_keys(cls, _nest(key.split("."), None), "", where)
        _set_nested(data, key.split("."), yaml.safe_load(raw) if raw != "" else "")
        set_by[key] = item
    return _build(cls, data, "", _Where(f"in {source}" + (" + overrides" if set_by else ""), set_by))


class _Where(str):
    """Where the config came from (``in rl.yaml + overrides``); `at` names the override that set a key."""

    set_by: dict[str, str]

    def __new__(cls, text: str, set_by: dict[str, str]) -> _Where:
        where = super().__new__(cls, text)
        where.set_by = set_by
        return where

    def at(self, key: str) -> str:
        """``in override 'steps=abc'`` for a key an override set (or one of its parents did), else all of it."""
        for prefix, item in reversed(self.set_by.items()):
            if key == prefix or key.startswith(prefix + ".") or key.startswith(prefix + "["):
                return f"in override {item!r}"
        return str(self)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict view of a config, for saving next to a run."""
    return dataclasses.asdict(cfg)


_ABSENT = object()


def config_diff(
    old: dict[str, Any], new: dict[str, Any], *, ignore: Sequence[str] = (), defaults: dict[str, Any] | None = None
) -> list[str]:
    """``"dotted.key: old -> new"`` for each key whose value differs between two config dicts (as saved: a
    resumed run's ``config.json``, an eval's ``run.json``), sorted, the values as JSON. Sections compare key
    by key, lists as whole values; a key under one of ``ignore`` (a dotted key or a section) is skipped. A key
    ``old`` lacks (it predates the key) has its value in ``defaults`` when given, else shows as ``(absent)``.

        config_diff({"ppo": {"lr": 1e-4}, "steps": 5}, {"ppo": {"lr": 1e-3}, "steps": 9}, ignore=["steps"])
        # ["ppo.lr: 0.0001 -> 0.001"]
    """
    before, after = _flat(_as_json(old)), _flat(_as_json(new))
    base = _flat(_as_json(defaults)) if defaults is not None else {}
    lines = []
    for key in sorted(before.keys() | after.keys()):
        if any(key == k or key.startswith(k + ".") for k in ignore):
            continue
        a, b = before.get(key, base.get(key, _ABSENT)), after.get(key, _ABSENT)
        if a != b:
            lines.append(f"{key}: {_show(a)} -> {_show(b)}")
    return lines


def _as_json(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as it reads back from JSON (tuples are lists), so a live config compares with a saved one."""
    return json.loads(json.dumps(data))


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": {}}`` -> ``{"a.b": 1}`` (lists stay whole values)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


def _nest(keys: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for k in reversed(keys):
        out = {k: out}
    return out


def _set_nested(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        if not isinstance(data.get(k), dict):
            data[k] = {}
        data = data[k]
    data[keys[-1]] = value


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _check_keys(cls: type, data: dict[str, Any], prefix: str, where: str) -> None:
    """Reject unknown keys anywhere below ``cls`` (free-form dict fields excepted)."""
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            choices = [f"{prefix}{name}" for name in fields]
            raise ConfigError(f"unknown config key {full!r} {where}.{did_you_mean(full, choices)}")
        section = _dataclass_of(hints[key])
        if section is not None:
            if isinstance(value, dict):
                _check_keys(section, value, f"{full}.", where)
            elif value is not None:
                raise ConfigError(f"config key {full!r} {where}: expects a mapping, got {value!r}")


def _dataclass_of(tp: Any) -> type | None:
    """The section class of a field typed ``Section`` or ``Section | None`` (None for any other type)."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _build(cls: type[T], data: dict[str, Any], prefix: str, where: str) -> T:
    _check_keys(cls, data, prefix, where)  # also below dict fields (``policies.AGENT``), which the root's check skips
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], f"{prefix}{name}", where)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"config key {prefix}{e} ({where})") from None


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(expected: str) -> ConfigError:
        at = where.at(key) if isinstance(where, _Where) else where
        return ConfigError(f"config key {key!r} {at}: expects {expected}, got {value!r}")

    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad("a mapping")
        return _build(tp, value, f"{key}.", where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1:  # e.g. ``str | Section``: a mapping is the section, anything else the scalar
            section = [a for a in inner if dataclasses.is_dataclass(a)]
            scalar = [a for a in inner if not dataclasses.is_dataclass(a)]
            if section and (isinstance(value, dict) or not scalar):
                return _convert(value, section[0], key, where)
            return _convert(value, scalar[0], key, where)
        return _convert(value, inner[0], key, where)
    if origin is Literal:
        if value not in args:
            raise bad("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad("a list")
        return [_convert(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad("a mapping")
        if args and args[1] is not Any:
            return {k: _convert(v, args[1], f"{key}.{k}", where) for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise bad("a string")
        return str(value)
    if tp is Any:
        return value
    raise TypeError(f"config field {key!r} has unsupported type {tp!r}")


def config_help(cls: type, prefix: str = "") -> list[str]:
    """``  key = default    # help`` per field of a config dataclass (dotted into sections): `--help`'s list."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines += config_help(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  {prefix}{f.name} = {default!r}    # {f.metadata.get('help', '')}")
    return lines
