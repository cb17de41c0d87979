"""`BaseDataset`: task rows with an ``id``, a ``prompt`` and the fields a reward needs.

A dataset source is one of (first match wins):
- a local file (``problems.jsonl``; anything ending in .jsonl/.json or existing on disk);
- a bundled set by name (``aime24``, ``gsm8k``, ...; see `areal_agents.data.builtin`): offline, pinned;
- ``hf:ORG/NAME`` with optional ``?key=value&...`` passed to ``datasets.load_dataset`` (a config ``name``,
  LiveCodeBench's ``version_tag``): the Hugging Face hub, needs ``areal-agents[hf]`` and a network;
- any other string: a plain Hugging Face id, as ``hf:`` without the prefix.

    ds = load_task_dataset("math500")                              # bundled; prompt_key from the set
    ds = load_task_dataset("gsm8k", split="test")                  # a set's train split is its default
    ds = load_task_dataset("problems.jsonl", prompt_key="question")
    ds[0]   # {"id": "...", "prompt": "...", "answer": "...", ...the row's other fields}

Subclass and override `to_row` to reshape rows (name the subclass as ``module:Class`` in config).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from areal_agents.data.builtin import BUILTIN, BuiltinDataset
from areal_agents.data.jsonl import read_jsonl
from areal_agents.errors import ArealAgentsError, did_you_mean


class BaseDataset:
    """A list of normalised task rows; every row has ``id`` and ``prompt``."""

    def __init__(
        self, raw_rows: list[dict[str, Any]], *, prompt_key: str = "prompt", id_key: str = "id", source: str = ""
    ) -> None:
        self.prompt_key, self.id_key, self.source = prompt_key, id_key, source
        self.rows = [self.to_row(i, row) for i, row in enumerate(raw_rows)]
        if not self.rows:
            raise ArealAgentsError(f"dataset {source or '(rows)'} is empty")

    def to_row(self, index: int, raw: dict[str, Any]) -> dict[str, Any]:
        if self.prompt_key not in raw:
            raise ArealAgentsError(
                f"dataset {self.source}: row {index} has no key {self.prompt_key!r} (keys: {sorted(raw)}); "
                "set prompt_key"
            )
        return {**raw, "id": str(raw.get(self.id_key, index)), "prompt": str(raw[self.prompt_key])}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


HUB_PREFIX = "hf:"


def builtin_for(source: str) -> BuiltinDataset | None:
    """The bundled set a source names, or None (a file on disk of the same name wins)."""
    if source in BUILTIN and not Path(source).exists():
        return BUILTIN[source]
    return None


def _hub_rows(source: str, split: str) -> list[dict[str, Any]]:
    """Rows of ``[hf:]ORG/NAME[?key=value&...]`` from the Hugging Face hub (true/false values are booleans)."""
    name, _, query = source.removeprefix(HUB_PREFIX).partition("?")
    params: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
    params = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in params.items()}
    try:
        import datasets
    except ImportError:
        raise ArealAgentsError(
            f"dataset {source!r} is not a local file or a bundled set, and loading from the Hugging Face hub "
            "needs the `datasets` package: pip install 'areal-agents[hf]' (or use a bundled set: "
            f"{', '.join(BUILTIN)})"
        ) from None
    try:
        return [dict(r) for r in datasets.load_dataset(name, split=split, **params)]
    except Exception as e:  # offline, unknown id, unknown split or config
        raise ArealAgentsError(
            f"cannot load Hugging Face dataset {name!r} split {split!r} {params or ''}: {e}"
        ) from None


@functools.lru_cache(maxsize=32)
def raw_rows(source: str, split: str | None = None) -> tuple[dict[str, Any], ...]:
    """The rows of a source as stored, cached per process (many envs over one dataset read it once).

    ``split`` picks a bundled set's or a hub dataset's split (default: the set's first, or "test")."""
    path = Path(source)
    if source.startswith(HUB_PREFIX):
        return tuple(_hub_rows(source, split or "test"))
    if path.suffix in (".jsonl", ".json") or path.exists():
        return tuple(read_jsonl(path))
    builtin = builtin_for(source)
    if builtin is not None:
        return tuple(read_jsonl(builtin.path(split)))
    if "/" not in source:  # hub ids are ORG/NAME: this is a mistyped bundled name or file
        raise ArealAgentsError(
            f"dataset {source!r} is not a file, a bundled set or a hub id (ORG/NAME).{did_you_mean(source, BUILTIN)}"
            f" Bundled: {', '.join(BUILTIN)}"
        )
    return tuple(_hub_rows(source, split or "test"))


def load_task_dataset(
    source: str,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    id_key: str | None = None,
    cls: type[BaseDataset] = BaseDataset,
) -> BaseDataset:
    """The rows of ``source`` (see the module docstring) as a `BaseDataset`.

    ``prompt_key``/``id_key`` default to the bundled set's own keys, else ``prompt``/``id``.
    """
    builtin = builtin_for(str(source))
    prompt_key = prompt_key or (builtin.prompt_key if builtin else "prompt")
    id_key = id_key or (builtin.id_key if builtin else "id")
    return cls(list(raw_rows(str(source), split)), prompt_key=prompt_key, id_key=id_key, source=str(source))
