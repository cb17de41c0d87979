"""`BaseDataset`: task rows with an ``id``, a ``prompt`` and the fields a reward needs.

A dataset source is a local file, a bundled set's name or a Hugging Face hub id (``hf:ORG/NAME`` with
optional ``?key=value&...`` passed to ``datasets.load_dataset``, e.g. a config ``name`` or LiveCodeBench's
``version_tag``; the hub needs ``areal-agents[hf]`` and a network); `areal_agents.data.sources` says which
wins and which an env server may load.

    ds = load_task_dataset("math500")                              # bundled; prompt_key from the set
    ds = load_task_dataset("gsm8k", split="test")                  # a set's train split is its default
    ds = load_task_dataset("problems.jsonl", prompt_key="question")
    ds[0]   # {"id": "...", "prompt": "...", "answer": "...", ...the row's other fields}

Loaded datasets are cached per process and shared by every env over them (bounded; a load that fails is not
kept): treat rows as read-only. Subclass and override `to_row` to reshape rows (name the subclass as
``module:Class`` in config).
"""

from __future__ import annotations

import collections
import threading
from typing import Any
from urllib.parse import parse_qsl

from areal_agents.data.builtin import BUILTIN
from areal_agents.data.jsonl import read_jsonl
from areal_agents.data.sources import HUB_PREFIX, Source, resolve_source
from areal_agents.errors import ArealAgentsError

CACHED_DATASETS = 8  # per cache: the rows as stored, and the normalised datasets


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


class _Cache:
    """A thread-safe LRU of at most ``maxsize`` loaded datasets; only what loaded is put in."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize, self.items, self.lock = maxsize, collections.OrderedDict(), threading.Lock()

    def get(self, key: Any) -> Any:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
            return self.items.get(key)

    def put(self, key: Any, value: Any) -> None:
        with self.lock:
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.maxsize:
                self.items.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


_rows_cache, _datasets_cache = _Cache(CACHED_DATASETS), _Cache(CACHED_DATASETS)


def _rows_key(source: Source, split: str | None) -> tuple[Source, str | None]:
    """Equal keys for equal rows: a file has one split; a bundled set's and a hub id's default are named."""
    if source.kind == "file":
        return source, None
    if source.kind == "bundled":
        return source, split or BUILTIN[source.location].default_split
    return source, split or "test"


def _read(source: Source, split: str | None) -> tuple[dict[str, Any], ...]:
    if source.kind == "hub":
        return tuple(_hub_rows(source.location, split or "test"))
    if source.kind == "bundled":
        return tuple(read_jsonl(BUILTIN[source.location].path(split)))
    return tuple(read_jsonl(source.location))


class _RawRows:
    """``raw_rows(source, split)``: the rows of a source as stored, cached per process (many envs over one
    dataset read it once; every spelling of one file is one entry). ``split`` picks a bundled set's or a
    hub dataset's split (default: the set's first, or "test"). ``raw_rows.cache_clear()`` empties the caches."""

    def __call__(self, source: str, split: str | None = None) -> tuple[dict[str, Any], ...]:
        key = _rows_key(resolve_source(str(source)), split)
        rows = _rows_cache.get(key)
        if rows is None:
            rows = _read(*key)
            _rows_cache.put(key, rows)
        return rows

    def cache_clear(self) -> None:
        _rows_cache.clear()
        _datasets_cache.clear()

    def cached(self) -> int:
        """How many datasets the caches hold now (rows as stored, and normalised)."""
        return len(_rows_cache.items) + len(_datasets_cache.items)


raw_rows = _RawRows()


def load_task_dataset(
    source: str,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    id_key: str | None = None,
    cls: type[BaseDataset] = BaseDataset,
) -> BaseDataset:
    """The rows of ``source`` (see the module docstring) as a `BaseDataset`, shared with every other caller
    that asks for the same one.

    ``prompt_key``/``id_key`` default to the bundled set's own keys, else ``prompt``/``id``.
    """
    resolved = resolve_source(str(source))
    builtin = BUILTIN[resolved.location] if resolved.kind == "bundled" else None
    prompt_key = prompt_key or (builtin.prompt_key if builtin else "prompt")
    id_key = id_key or (builtin.id_key if builtin else "id")
    rows_key = _rows_key(resolved, split)
    key = (cls, rows_key, prompt_key, id_key)
    dataset = _datasets_cache.get(key)
    if dataset is None:
        rows = _rows_cache.get(rows_key) or _read(*rows_key)  # not cached on its own: this load may still fail
        dataset = cls(list(rows), prompt_key=prompt_key, id_key=id_key, source=str(source))
        _datasets_cache.put(key, dataset)
    return dataset
