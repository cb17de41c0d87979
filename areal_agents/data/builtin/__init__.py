"""Datasets shipped inside the package: pinned, offline copies of public evaluation and training sets.

    load_task_dataset("aime24")                    # the bundled AIME 2024 (its one split, "test")
    load_task_dataset("gsm8k", split="test")       # GSM8K test (a set's train split is its default)
    load_task_dataset("hf:HuggingFaceH4/aime_2024", split="train")   # the hub's copy instead

Origins and licences are in SOURCES.md beside the files; ``areal-agents datasets`` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from areal_agents.errors import ArealAgentsError, did_you_mean


@dataclass(frozen=True)
class BuiltinDataset:
    """One bundled set: its files by split, the keys its rows use, and where the hub keeps it."""

    name: str
    description: str
    files: dict[str, str]  # split -> file name in this package folder; the first is the default split
    prompt_key: str
    id_key: str
    hub: str  # the same set, with the same fields, on the Hugging Face hub ("" when there is none)
    hub_split: str
    licence: str
    public_tests_only: bool = False  # LiveCodeBench copies without hidden tests: scores not comparable

    @property
    def default_split(self) -> str:
        return next(iter(self.files))

    def path(self, split: str | None = None) -> Path:
        """The bundled file of ``split`` (default: the set's first split)."""
        split = split or self.default_split
        if split not in self.files:
            raise ArealAgentsError(
                f"bundled dataset {self.name!r} has no split {split!r}; it has: {', '.join(self.files)}"
            )
        return Path(str(resources.files(__name__).joinpath(self.files[split])))


def _lcb(name: str, description: str, file: str, public_only: bool = True) -> BuiltinDataset:
    return BuiltinDataset(
        name,
        description,
        {"test": file},
        "question_content",
        "question_id",
        "hf:livecodebench/code_generation_lite?version_tag=release_v5",
        "test",
        "MIT" if public_only else "Apache-2.0",
        public_tests_only=public_only,
    )


BUILTIN: dict[str, BuiltinDataset] = {
    d.name: d
    for d in (
        BuiltinDataset(
            "aime24",
            "AIME 2024 I+II",
            {"test": "aime24.jsonl"},
            "problem",
            "id",
            "hf:HuggingFaceH4/aime_2024",
            "train",
            "MIT",
        ),
        BuiltinDataset(
            "aime25",
            "AIME 2025 I+II",
            {"test": "aime25.jsonl"},
            "problem",
            "id",
            "hf:math-ai/aime25",
            "test",
            "Apache-2.0",
        ),
        BuiltinDataset(
            "math500",
            "MATH-500 (the PRM800K test split)",
            {"test": "math500.jsonl"},
            "problem",
            "id",
            "hf:HuggingFaceH4/MATH-500",
            "test",
            "MIT",
        ),
        BuiltinDataset(
            "gsm8k",
            "GSM8K grade-school math",
            {"train": "gsm8k_train.jsonl", "test": "gsm8k_test.jsonl"},
            "question",
            "id",
            "",
            "test",
            "MIT",  # the hub's rows keep the worked solution under "answer"
        ),
        _lcb("lcb_v5", "LiveCodeBench v5, public tests only", "lcb_v5_public.jsonl"),
        _lcb("lcb_v5_subset", "LiveCodeBench v5, 20 stdin + 20 functional, public tests only", "lcb_v5_subset.jsonl"),
        _lcb("lcb_hidden3", "LiveCodeBench, 3 problems with their hidden tests", "lcb_hidden3.jsonl", False),
        BuiltinDataset(
            "humaneval",
            "HumanEval",
            {"test": "humaneval.jsonl"},
            "prompt",
            "task_id",
            "hf:openai/openai_humaneval",
            "test",
            "MIT",
        ),
        BuiltinDataset(
            "mbpp",
            "MBPP train split (task ids 601-974)",
            {"train": "mbpp_train.jsonl"},
            "text",
            "task_id",
            "hf:google-research-datasets/mbpp?name=full",
            "train",
            "CC BY 4.0",
        ),
        BuiltinDataset(
            "mbpp_test20",
            "MBPP test tasks 11-30 (a smoke-test sample)",
            {"test": "mbpp_test20.jsonl"},
            "text",
            "task_id",
            "hf:google-research-datasets/mbpp?name=full",
            "test",
            "Apache-2.0",
        ),
    )
}


def get_builtin(name: str) -> BuiltinDataset:
    """The bundled set ``name``; an unknown name raises with the closest match and the list."""
    if name not in BUILTIN:
        raise ArealAgentsError(
            f"no bundled dataset {name!r}.{did_you_mean(name, BUILTIN)} Bundled: {', '.join(BUILTIN)}"
        )
    return BUILTIN[name]
