"""Where a dataset name points (a file, a bundled set, a hub id), and which names an env server may load.

Locally any name loads, first match wins: ``hf:ORG/NAME``; a file (``.jsonl``/``.json``, or anything on disk);
a bundled set's name; any other ``ORG/NAME``, as a hub id. Inside `serving(allowed)` (an env server making a
client's env) only the bundled sets and what the operator allowed at start load: ``--dataset NAME=PATH`` (or
``--dataset PATH``, named by itself) and JSONL files under a ``--data-dir``. Any other name is refused with the
same message whether or not such a file exists, so a client learns nothing of the server's files.

    allowed = ServedData.from_args(["train=/data/train.jsonl"], data_dirs=["/data/more"])
    with serving(allowed):
        resolve_source("train")            # Source("file", "/data/train.jsonl")
        resolve_source("more/x.jsonl")     # DatasetNotServed (names under a data dir are relative to it)
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from areal_agents.data.builtin import BUILTIN
from areal_agents.errors import ArealAgentsError, ConfigError, did_you_mean

HUB_PREFIX = "hf:"
DATA_SUFFIXES = (".jsonl", ".json")
_NAMED = re.compile(r"([\w.-]+)=(.*)")  # --dataset NAME=PATH: a NAME of letters, digits, _ . -
# A process-mode env server's worker processes learn its allowed datasets from this variable (set by the
# serve-env process before its workers start); a process that has it loads nothing else.
SERVED_DATA_ENV = "AREAL_AGENTS_SERVED_DATA"


@dataclass(frozen=True)
class Source:
    """A resolved dataset name: ``kind`` and ``location`` (an absolute path, a bundled set's name, a hub id)."""

    kind: Literal["file", "bundled", "hub"]
    location: str


class DatasetNotServed(ArealAgentsError):
    """An env server was asked for a dataset its operator did not allow."""


def local_source(name: str) -> Source:
    """What ``name`` means outside an env server (the module docstring's rules); equal files resolve equal."""
    if name.startswith(HUB_PREFIX):
        return Source("hub", name)
    path = Path(name)
    if path.suffix in DATA_SUFFIXES or path.exists():
        return Source("file", str(path.resolve()))
    if name in BUILTIN:
        return Source("bundled", name)
    if "/" not in name:  # hub ids are ORG/NAME: this is a mistyped bundled name or file
        raise ArealAgentsError(
            f"dataset {name!r} is not a file, a bundled set or a hub id (ORG/NAME).{did_you_mean(name, BUILTIN)}"
            f" Bundled: {', '.join(BUILTIN)}"
        )
    return Source("hub", name)


def _under(directory: Path, name: str) -> Path | None:
    """The JSONL file ``name`` names inside ``directory`` (relative to it; symlinks out of it do not count)."""
    try:
        path = (directory / name).resolve()
        return path if path.is_relative_to(directory) and path.suffix in DATA_SUFFIXES and path.is_file() else None
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, a symlink loop
        return None


@dataclass(frozen=True)
class ServedData:
    """The datasets an env server's clients may name: bundled sets, ``named`` ones and files under ``dirs``."""

    named: Mapping[str, Source]
    dirs: tuple[Path, ...] = ()

    @classmethod
    def from_args(cls, datasets: Sequence[str] = (), data_dirs: Sequence[str] = ()) -> ServedData:
        """From serve-env's ``--dataset NAME=PATH`` (or ``PATH``, or a hub id) and ``--data-dir DIR``;
        a named file that does not exist, or a data dir that is not a directory, fails here, at start."""
        named: dict[str, Source] = {}
        for arg in datasets:
            match = _NAMED.fullmatch(arg)  # a hub id's ?key=value is no NAME=
            name, target = match.groups() if match else (arg, arg)
            if not target:
                raise ConfigError(f"--dataset {arg!r}: expects NAME=PATH, a file path or a hub id")
            source = local_source(target)
            if source.kind == "file" and not Path(source.location).is_file():
                raise ConfigError(f"--dataset {arg!r}: no such file {source.location}")
            named[name] = source
        dirs = []
        for d in data_dirs:
            if not Path(d).is_dir():
                raise ConfigError(f"--data-dir {d!r}: not a directory")
            dirs.append(Path(d).resolve())
        return cls(named, tuple(dirs))

    def resolve(self, name: str) -> Source:
        """The source ``name`` stands for here, or `DatasetNotServed` (the same for any name not allowed)."""
        if name in self.named:
            return self.named[name]
        if name in BUILTIN:
            return Source("bundled", name)
        for directory in self.dirs:
            path = _under(directory, name)
            if path is not None:
                return Source("file", str(path))
        shown = name if len(name) <= 200 else name[:200] + "..."
        named = f"; named by its operator: {', '.join(sorted(self.named))}" if self.named else ""
        dirs = f"; JSONL files under its {len(self.dirs)} data dir(s), named relative to it" if self.dirs else ""
        raise DatasetNotServed(
            f"dataset {shown!r} is not served here: this env server loads bundled sets ({', '.join(BUILTIN)})"
            f"{named}{dirs}. Its operator allows more at start: serve-env --dataset NAME=PATH, --data-dir DIR"
        )

    def to_json(self) -> str:
        named = {name: [s.kind, s.location] for name, s in self.named.items()}
        return json.dumps({"named": named, "dirs": [str(d) for d in self.dirs]})

    @classmethod
    def from_json(cls, text: str) -> ServedData:
        data: dict[str, Any] = json.loads(text)
        named = {name: Source(kind, location) for name, (kind, location) in data["named"].items()}
        return cls(named, tuple(Path(d) for d in data["dirs"]))


_serving: contextvars.ContextVar[ServedData | None] = contextvars.ContextVar("served_data", default=None)


class serving:  # noqa: N801  (used as a function: ``with serving(allowed):``)
    """Within this block (an env server making or stepping a client's env) datasets resolve through ``allowed``
    alone. A class, not a generator: the env server enters one around every step."""

    __slots__ = ("allowed", "token")

    def __init__(self, allowed: ServedData) -> None:
        self.allowed = allowed

    def __enter__(self) -> None:
        self.token = _serving.set(self.allowed)

    def __exit__(self, *exc: object) -> None:
        _serving.reset(self.token)


def export_to_workers(allowed: ServedData) -> None:
    """Make this process, and the worker processes it starts from now on, load only ``allowed``: for a
    process that exists to serve clients (serve-env, an env-server actor), whose workers re-make envs."""
    os.environ[SERVED_DATA_ENV] = allowed.to_json()


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> ServedData:
    return ServedData.from_json(text)


def resolve_source(name: str) -> Source:
    """The source ``name`` stands for: through the allowed datasets inside an env server, else `local_source`."""
    allowed = _serving.get()
    if allowed is None and (exported := os.environ.get(SERVED_DATA_ENV)):
        allowed = _parsed(exported)
    return allowed.resolve(name) if allowed is not None else local_source(name)


def datasets_in(kwargs: Mapping[str, Any]) -> list[str]:
    """Every string under a ``dataset`` key of env kwargs, at any depth (Debate's ``task_kwargs``): what a
    run's launcher allows the env server it starts to load."""
    found: list[str] = []
    for key, value in kwargs.items():
        if key == "dataset" and isinstance(value, str) and value:
            found.append(value)
        elif isinstance(value, Mapping):
            found += datasets_in(value)
    return list(dict.fromkeys(found))
