"""`BaseDataset`: task rows with an ``id``, a ``prompt`` and the fields a reward needs, from JSONL or Hugging Face.

    ds = load_task_dataset("../shared/data/math500.jsonl", prompt_key="problem")      # a local path
    ds = load_task_dataset("HuggingFaceH4/MATH-500", split="test", prompt_key="problem")  # needs `datasets`
    ds[0]   # {"id": "...", "prompt": "...", "answer": "...", ...the row's other fields}

Subclass and override `to_row` to reshape rows (name the subclass as ``module:Class`` in config).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from areal_agents.data.jsonl import read_jsonl
from areal_agents.errors import ArealAgentsError


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


def _hf_rows(name: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ArealAgentsError(
            f"dataset {name!r} is not a local file, and loading Hugging Face ids needs the `datasets` package: "
            "pip install 'areal-agents[hf]' (or pass a local JSONL path)"
        ) from None
    try:
        return [dict(r) for r in datasets.load_dataset(name, split=split)]
    except Exception as e:  # offline, unknown id, unknown split
        raise ArealAgentsError(f"cannot load Hugging Face dataset {name!r} split {split!r}: {e}") from None


@functools.lru_cache(maxsize=32)
def _cached_rows(source: str, split: str) -> tuple[dict[str, Any], ...]:
    path = Path(source)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return tuple(read_jsonl(path))
    return tuple(_hf_rows(source, split))


def load_task_dataset(
    source: str,
    *,
    split: str = "test",
    prompt_key: str = "prompt",
    id_key: str = "id",
    cls: type[BaseDataset] = BaseDataset,
) -> BaseDataset:
    """Rows from a JSONL path (anything ending in .jsonl or existing on disk) or a Hugging Face dataset id.

    Raw rows are cached per process, so many envs over one dataset read it once.
    """
    return cls(list(_cached_rows(str(source), split)), prompt_key=prompt_key, id_key=id_key, source=str(source))
