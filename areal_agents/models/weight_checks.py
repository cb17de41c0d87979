"""New weights read and checked against the served model before any live weight changes (all or nothing).

A weight update (a checkpoint directory, a state dict in this process, broadcast buckets) is checked whole
first: every name a tensor of the model, none missing (a tied tensor counts as given when another of its
tie is), each shape the model's, each dtype castable to the model's (floating point to floating point,
others exactly), every value finite in the dtype it will be served in, every shard of a sharded checkpoint
present and readable. Only then is it copied in place (`copy_into`), which cannot fail on checked tensors.
Errors name the file and the key, never a value or any other content of a file.

    spec = WeightSpec.of(model)
    staged = read_checkpoint(spec, "runs/x/weights/v3", "update_weights_from_disk")  # checked, on the CPU
    copy_into(model, staged)                                                          # at a step boundary
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_agents.errors import EngineError

INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's weight_map (transformers' name)
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")  # model-00001-of-00003.safetensors
_NAMED = 3  # problems (keys, files) an error names; the rest are counted
# safetensors' dtype names (its header's "dtype"); a file's other dtypes are refused by name
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# what safetensors' own errors mean, said without its text (which may quote the file's header)
_UNREADABLE = {
    "not fully covered": "truncated (its header describes more bytes than the file holds)",
    "invalid header length": "too short to be a safetensors file",
    "header too large": "not a safetensors file (its header length is implausible)",
    "invalid json": "not a safetensors file (its header is not safetensors JSON)",
}


@dataclass(frozen=True)
class WeightSpec:
    """The served model's state dict as new weights must match it: each tensor's shape and dtype, and the
    names of tied tensors (one storage: ``lm_head.weight`` and ``model.embed_tokens.weight``)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    tie_of: dict[str, str]  # name -> the first name of the tensors sharing its storage (itself when untied)

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightSpec:
        shapes, dtypes, tie_of, first = {}, {}, {}, {}
        for name, t in model.state_dict().items():
            shapes[name], dtypes[name] = tuple(t.shape), t.dtype
            storage = (t.data_ptr(), t.dtype, tuple(t.shape)) if t.numel() else name  # empty ones tie nothing
            tie_of[name] = first.setdefault(storage, name)
        return cls(shapes, dtypes, tie_of)

    def unknown(self, name: str) -> str:
        """What is wrong with a name that is not one of the model's (with a near match)."""
        close = difflib.get_close_matches(name, list(self.shapes), n=1) if len(name) <= 200 else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{_key(name)} is not a weight of the served model{hint}"

    def mismatch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """What is wrong with a tensor ``name`` of ``shape`` and ``dtype`` (None: nothing); ``name`` is known."""
        want_shape, want_dtype = self.shapes[name], self.dtypes[name]
        if tuple(shape) != want_shape:
            return f"{_key(name)} has shape {_short(list(shape))}, the served model's is {list(want_shape)}"
        castable = dtype.is_floating_point if want_dtype.is_floating_point else dtype == want_dtype
        if not castable:
            return f"{_key(name)} is {_dtype(dtype)}, which does not load into the served model's {_dtype(want_dtype)}"
        return None

    def missing(self, given: Mapping[str, Any] | set[str]) -> list[str]:
        """The model's tensors ``given`` lacks (a tied one is there when another of its tie is)."""
        ties = {self.tie_of[name] for name in given if name in self.tie_of}
        return [name for name in self.shapes if name not in given and self.tie_of[name] not in ties]

    def complete(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (checked: nothing `missing`) under every name the model has; the names of one tie all get
        the first of them given (the model keeps one tensor for them, and a shared one stays shared)."""
        by_tie: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            by_tie.setdefault(self.tie_of[name], t)
        return {name: by_tie[self.tie_of[name]] for name in self.shapes}


def check_state_dict(spec: WeightSpec, state: Mapping[str, Any], where: str) -> dict[str, torch.Tensor]:
    """``state`` checked whole against ``spec`` (names, shapes, dtypes, finite values in the served dtype);
    every name of the model in it (`WeightSpec.complete`). `EngineError` says what was wrong, as ``where``."""
    problems = _Problems(where)
    for name, t in state.items():
        if name not in spec.shapes:
            problems.add(lambda name=name: spec.unknown(name))
        elif not isinstance(t, torch.Tensor):
            problems.add(f"{_key(name)} is not a tensor but a {type(t).__name__}")
    problems.check()
    problems.missing(spec.missing(state))
    for name, t in state.items():
        problems.add(spec.mismatch(name, tuple(t.shape), t.dtype))
    problems.check()
    for name, t in state.items():
        problems.add(None if finite(t, spec.dtypes[name]) else _nonfinite(name))
    problems.check()
    return spec.complete(state)


def read_checkpoint(spec: WeightSpec, path: str | Path, where: str) -> dict[str, torch.Tensor]:
    """A ``save_pretrained`` directory's safetensors (one file, or shards with ``model.safetensors.index.json``),
    read whole and checked (`check_state_dict`'s checks, every shard present and readable), in the served
    dtypes on the CPU. Staged on the CPU rather than beside the live weights: a second copy of a 7B model
    costs host memory, not accelerator memory, and the copy in place under the pause cannot fail halfway."""
    root = Path(path)
    where = f"{where}: {_short(str(root), 500)}"
    files, weight_map = _checkpoint_files(root, where)
    holds: dict[str, Path] = {}  # every key to read -> its file
    problems = _Problems(where)
    for file in files:  # headers only: names, shapes and dtypes before a byte of data is read
        with _opened(file, where) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if weight_map is not None and weight_map.get(name) != file.name:
                    continue  # the index decides which shard holds a tensor
                if name in holds:
                    problems.add(f"{_key(name)} is in both {holds[name].name} and {file.name}")
                    continue
                holds[name] = file
                if name not in spec.shapes:
                    problems.add(lambda name=name: spec.unknown(name))
                else:
                    problems.add(_header_problem(spec, name, f.get_slice(name)))
    problems.check()
    for name, shard in (weight_map or {}).items():
        if name not in holds:
            problems.add(f"{_key(name)} is not in {shard}, where {INDEX_FILE} puts it")
    problems.check()
    problems.missing(spec.missing(set(holds)))
    staged: dict[str, torch.Tensor] = {}
    for file in files:
        with _opened(file, where) as f:
            for name in [n for n, held in holds.items() if held == file]:
                t = _read(f, name, file, where)
                problems.add(spec.mismatch(name, tuple(t.shape), t.dtype))  # the file may have changed since
                staged[name] = t.to(spec.dtypes[name])
                problems.add(None if finite(staged[name], staged[name].dtype) else _nonfinite(name))
    problems.check()
    return spec.complete(staged)


def check_announced(spec: WeightSpec, names: list, dtypes: list, shapes: list, where: str) -> None:
    """A broadcast bucket's announcement (SGLang's names, dtypes, shapes) checked before a byte is received."""
    if not len(names) == len(dtypes) == len(shapes):
        raise _refused(where, f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    problems = _Problems(where)
    for name, dtype, shape in zip(names, dtypes, shapes):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(name, str) or name not in spec.shapes:
            problems.add(lambda name=name: spec.unknown(str(name)))
        elif not isinstance(torch_dtype, torch.dtype):
            problems.add(f"{_key(name)}: {_short(dtype)} is not a torch dtype")
        elif not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            problems.add(f"{_key(name)}: its shape is not a list of integers")
        else:
            problems.add(spec.mismatch(name, tuple(shape), torch_dtype))
    problems.check()


def copy_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy checked tensors (`check_state_dict`, `read_checkpoint`) into ``model``'s own, in place (casting to
    their dtype and device); a tensor tied to one already written is skipped."""
    live = model.state_dict()
    written: set[int] = set()
    with torch.no_grad():
        for name, t in state.items():
            target = live[name]
            if target.data_ptr() not in written:
                target.copy_(t)
                written.add(target.data_ptr())


def finite(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of ``t`` is finite once cast to ``dtype`` (a float16 copy of 1e5 is not); true for
    tensors other than floating point."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t if t.dtype == dtype or not dtype.is_floating_point else t.to(dtype)).all())


# ---- checkpoint files ------------------------------------------------------------------------------


def _checkpoint_files(root: Path, where: str) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and the index's weight_map (None without an index); `EngineError` when
    a shard is missing or the index names a file outside the directory."""
    if not root.is_dir():
        raise _refused(where, "not a directory (expects a save_pretrained checkpoint directory)")
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index, where)
        files = sorted({root / shard for shard in weight_map.values()})
        gone = [f.name for f in files if not f.is_file()]
        named, missing, expected = gone[:_NAMED], len(gone), len(files)
    else:
        weight_map, files = None, sorted(root.glob("*.safetensors"))
        if not files:
            raise _refused(where, "no *.safetensors in it")
        named, missing, expected = _numbered_missing(files)
    if missing:
        more = f" and {missing - len(named)} more" if missing > len(named) else ""
        raise _refused(where, f"missing shard {', '.join(named)}{more} (of {expected})")
    return files, weight_map


def _weight_map(index: Path, where: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor -> shard file name), each shard a plain file of the directory."""
    try:
        content = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        at = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise _refused(where, f"{INDEX_FILE} is not valid JSON{at}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _refused(where, f"{INDEX_FILE} has no weight_map (a JSON object: tensor name -> shard file)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise _refused(
                where, f"{INDEX_FILE} puts {_key(name)} in something other than a .safetensors file of the directory"
            )
    return weight_map


def _numbered_missing(files: list[Path]) -> tuple[list[str], int, int]:
    """Without an index, the gaps in numbered sets (``model-00002-of-00003.safetensors``): the first few
    missing files' names, how many are missing, and how many files there should be."""
    sets: dict[tuple[str, str], set[int]] = {}
    for f in files:
        match = _SHARD.match(f.name)
        if match:
            sets.setdefault((match["stem"], match["n"]), set()).add(int(match["i"]))
    named, missing, expected = [], 0, len(files)
    for (stem, n), present in sets.items():
        gap = max(0, int(n) - len(present))
        missing, expected = missing + gap, expected + gap
        gaps = (i for i in range(1, int(n) + 1) if i not in present)  # only the first few: never the whole range
        named += [f"{stem}-{i:0{len(n)}d}-of-{n}.safetensors" for _, i in zip(range(_NAMED - len(named)), gaps)]
    return named, missing, expected


def _opened(file: Path, where: str) -> Any:
    """``safe_open`` of ``file`` (its header read and checked against the file's size)."""
    from safetensors import safe_open  # noqa: PLC0415  (only reading checkpoints needs it)

    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001  (SafetensorError, OSError: said without the library's text)
        raise _refused(where, f"{file.name} is {_unreadable(e)}") from None


def _read(f: Any, name: str, file: Path, where: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:  # noqa: BLE001
        raise _refused(where, f"{file.name}: {_key(name)} is {_unreadable(e)}") from None


def _unreadable(e: BaseException) -> str:
    """What a safetensors or OS error says, in our words (its own may quote the file)."""
    if isinstance(e, OSError):
        return f"unreadable ({e.strerror or type(e).__name__})"
    text = str(e).lower()
    return next((said for fragment, said in _UNREADABLE.items() if fragment in text), "not a readable safetensors file")


def _header_problem(spec: WeightSpec, name: str, tensor_slice: Any) -> str | None:
    """What is wrong with the header's entry of a known tensor (None: nothing)."""
    dtype = _DTYPES.get(tensor_slice.get_dtype())
    if dtype is None:
        return f"{_key(name)} is stored as {_short(tensor_slice.get_dtype())}, which this engine does not load"
    return spec.mismatch(name, tuple(tensor_slice.get_shape()), dtype)


# ---- messages --------------------------------------------------------------------------------------


class _Problems:
    """The problems found so far: the first few said (`_NAMED`), the rest counted; `check` raises them."""

    def __init__(self, where: str) -> None:
        self.where, self.said, self.count = where, [], 0

    def add(self, problem: str | Callable[[], str] | None) -> None:
        """Count a problem (None: none), said now or, as a callable, only if it is one of the first few."""
        if problem is None:
            return
        self.count += 1
        if len(self.said) < _NAMED:
            self.said.append(problem if isinstance(problem, str) else problem())

    def missing(self, names: list[str]) -> None:
        for name in names:
            self.add(f"{_key(name)} is missing")
        self.check()

    def check(self) -> None:
        """`EngineError` naming the problems found (none: nothing)."""
        if self.count:
            more = f" (and {self.count - len(self.said)} more)" if self.count > len(self.said) else ""
            raise _refused(self.where, f"{'; '.join(self.said)}{more}")


def _refused(where: str, problem: str) -> EngineError:
    """The error of a refused update: where, what was wrong, and that no weight changed."""
    return EngineError(f"{where}: {problem}; nothing was loaded")


def _nonfinite(name: str) -> str:
    return f"{_key(name)} has NaN or infinite values"


def _key(name: str) -> str:
    return _short(name)


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut at ``limit`` characters (a name from a file is named, not quoted at length)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
