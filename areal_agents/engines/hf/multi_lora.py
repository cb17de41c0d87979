"""LoRA adapters served beside `HFEngine`'s base model, several in one batch (S-LoRA / Punica's grouping).

Each row of a forward carries its adapter (``GenRequest.lora_name``; None: the base model). The adapters'
low-rank deltas are added to the base model's linear outputs, grouped by adapter: for each adapter present
in the batch, its rows' ``x @ A.T @ B.T * scaling`` is computed on those rows alone and added back with
``index_add``, so a row's output is the one its adapter alone gives. A forward hook on every targeted
``nn.Linear`` adds them in transformers' forward (prefill; decode with ``fast_decode`` off); the fused
decode step (`LlamaDecodeStep`) calls `LoraRows.add_parts` on its stacked q/k/v and gate/up outputs itself
(modules of one input share one ``x @ A.T``). Scaling is PEFT's: ``lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with ``use_rslora``; a module's r is its A's rows, so ``rank_pattern`` holds). DoRA, LoRA biases,
``alpha_pattern``, ``modules_to_save`` and non-linear targets (embeddings) are refused, naming the option.

    table = LoraTable(model)
    weights, config = read_adapter_dir("runs/x/adapter")          # PEFT's save_pretrained directory
    table.put(LoraAdapter.build("a1", weights, config, table.linears))
    with table.serving(table.rows_of(["a1", None], device)):      # row 0 with a1, row 1 the base model
        logits = model(input_ids).logits
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_agents.errors import EngineError

# PEFT's state-dict key of a LoRA matrix: ``base_model.model.<module>.lora_A.weight`` (``.lora_A.<adapter>.weight``
# in a PeftModel's own state_dict)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
# adapter_config.json options whose adapter this engine would compute wrongly: refused when set
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "alpha_pattern": {},
    "modules_to_save": None,
    "lora_bias": False,
    "layer_replication": None,
}


@dataclass(frozen=True)
class LoraModule:
    """One targeted linear's adapter matrices: ``A [r, in]``, ``B [out, r]``, and its scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class LoraStack:
    """An adapter's A matrices of modules that share an input (q/k/v; gate/up) stacked into one ``[sum r, in]``,
    so that their ``x @ A.T`` is one product; ``parts``: (which module, its B, scaling, its columns of it)."""

    a: torch.Tensor
    parts: tuple[tuple[int, torch.Tensor, float, int, int], ...]


@dataclass(frozen=True)
class LoraAdapter:
    """A named adapter: its matrices by the model's module name (``model.layers.0.self_attn.q_proj``)."""

    name: str
    modules: dict[str, LoraModule]
    _stacks: dict[tuple, LoraStack | None] = field(default_factory=dict, repr=False, compare=False)

    def stack(self, names: tuple[str | None, ...]) -> LoraStack | None:
        """The `LoraStack` of the modules ``names`` (made once); None when the adapter targets none of them."""
        if names not in self._stacks:
            held = [(i, self.modules[n]) for i, n in enumerate(names) if n in self.modules]
            parts, start = [], 0
            for i, lora in held:
                parts.append((i, lora.b, lora.scaling, start, start + lora.a.shape[0]))
                start += lora.a.shape[0]
            a = torch.cat([lora.a for _, lora in held]) if held else None
            self._stacks[names] = LoraStack(a, tuple(parts)) if held else None
        return self._stacks[names]

    @classmethod
    def build(
        cls,
        name: str,
        weights: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        linears: Mapping[str, nn.Linear],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> LoraAdapter:
        """The adapter from PEFT's state dict (``get_peft_model_state_dict`` keys) and adapter config; its
        tensors are copies on ``device`` in ``dtype`` (default: the weights'), each checked (floating point,
        finite in ``dtype``) before the adapter exists, so a refused one replaces nothing. `EngineError` names
        the adapter and the key or module that does not fit the model (``linears``: its linears by name)."""
        where = f"LoRA adapter {name!r}"
        lora_alpha, use_rslora = _check_config(where, config)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            match = _KEY.match(key)
            if match is None or not isinstance(tensor, torch.Tensor):
                raise EngineError(
                    f"{where}: {_short(key)} is not a LoRA matrix (expected keys such as "
                    "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'; only lora_A/lora_B of "
                    "linear layers are served)"
                )
            pairs.setdefault(match["module"], {})[match["part"]] = tensor
        if not pairs:
            raise EngineError(f"{where}: no lora_A/lora_B weights")
        modules = {}
        for module, parts in sorted(pairs.items()):
            a, b = _check_module(where, module, parts, linears)
            r = a.shape[0]
            scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
            a, b = (t.detach().to(device=device, dtype=dtype or t.dtype, copy=True) for t in (a, b))
            for part, t in (("lora_A", a), ("lora_B", b)):
                if not torch.isfinite(t).all():
                    raise EngineError(f"{where}: {module!r} {part} has NaN or infinite values")
            modules[module] = LoraModule(a, b, scaling)
        return cls(name, modules)


def read_adapter_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT's adapter directory (``save_pretrained``): its weights and its ``adapter_config.json``."""
    from safetensors.torch import load_file  # noqa: PLC0415  (only loading an adapter needs it)

    where = Path(path)
    config_file, weights_file = where / "adapter_config.json", where / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise EngineError(
                f"LoRA adapter directory {str(where)!r}: no {file.name} (expects PEFT's save_pretrained output: "
                "adapter_config.json and adapter_model.safetensors)"
            )
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # said without the file's text
        at = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise EngineError(f"{config_file}: not valid JSON{at}") from None
    if not isinstance(config, dict):
        raise EngineError(f"{config_file}: expects a JSON object, got {type(config).__name__}")
    try:
        return load_file(str(weights_file)), config
    except Exception:  # noqa: BLE001  (safetensors' own message may quote the file's header)
        raise EngineError(f"{weights_file}: not a readable safetensors file (truncated or corrupt)") from None


def _check_config(where: str, config: Mapping[str, Any]) -> tuple[float, bool]:
    """``(lora_alpha, use_rslora)`` of an adapter config; `EngineError` on options it cannot serve."""
    if not isinstance(config, Mapping):
        raise EngineError(f"{where}: the adapter config must be a dict (adapter_config.json), got {_short(config)}")
    peft_type = str(config.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.")
    if peft_type != "LORA":
        raise EngineError(f"{where}: peft_type {_short(config.get('peft_type'))} is not LoRA")
    for key, neutral in _UNSUPPORTED.items():
        value = config.get(key, neutral)
        if value not in (neutral, None) and value != {} and value != []:
            raise EngineError(f"{where}: adapter_config {key}={_short(value)} is not supported by HFEngine")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise EngineError(f"{where}: adapter_config lora_alpha expects a number, got {_short(alpha)}")
    return float(alpha), bool(config.get("use_rslora", False))


def _check_module(
    where: str, module: str, parts: dict[str, torch.Tensor], linears: Mapping[str, nn.Linear]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of one targeted module, checked against the model's linear of that name."""
    linear = linears.get(module)
    if linear is None:
        raise EngineError(
            f"{where}: targets {_short(module)}, which is not a linear layer of the served model "
            "(an adapter trained on another model?)"
        )
    if set(parts) != {"A", "B"}:
        missing = "lora_B" if "A" in parts else "lora_A"
        raise EngineError(f"{where}: {module!r} has no {missing} weight")
    a, b = parts["A"], parts["B"]
    if not (a.is_floating_point() and b.is_floating_point()):
        raise EngineError(f"{where}: {module!r} lora_A is {a.dtype} and lora_B {b.dtype}: expects floating point")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise EngineError(
            f"{where}: {module!r} lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and [out, r]"
        )
    if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
        raise EngineError(
            f"{where}: {module!r} maps {a.shape[1]} -> {b.shape[0]} features, the served model's "
            f"{linear.in_features} -> {linear.out_features} (an adapter trained on another model?)"
        )
    return a, b


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut at ``limit`` characters: a value from a client's file is named, not quoted at length."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class LoraRows:
    """Which rows of one forward use which adapter: ``groups`` of (adapter, row indices on the device, or
    None when the adapter's rows are all the rows)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]
    names: Mapping[nn.Module, str]  # the table's module -> name

    def add(self, out: torch.Tensor, x: torch.Tensor, module: nn.Module, offset: int = 0) -> torch.Tensor:
        """``out`` (rows first: ``[B, ..., N]``) plus each row's adapter delta of ``module`` on input ``x``,
        in place; ``offset``: the module's outputs start at this column of ``out``."""
        return self.add_parts(out, x, ((module, offset),))

    def add_parts(self, out: torch.Tensor, x: torch.Tensor, parts: tuple[tuple[nn.Module, int], ...]) -> torch.Tensor:
        """`add` for modules of one input whose outputs sit side by side in ``out`` (a fused q/k/v product):
        ``parts`` gives each module and its first column. Per adapter: one ``x @ A.T`` for them all."""
        names = tuple(self.names.get(module) for module, _ in parts)
        for adapter, rows in self.groups:
            stack = adapter.stack(names)
            if stack is None:
                continue
            xa = (x if rows is None else x.index_select(0, rows)).to(stack.a.dtype) @ stack.a.T
            for i, b, scaling, lo, hi in stack.parts:
                delta = (xa[..., lo:hi] @ b.T * scaling).to(out.dtype)
                offset, width = parts[i][1], delta.shape[-1]
                target = out if offset == 0 and width == out.shape[-1] else out.narrow(-1, offset, width)
                if rows is None:
                    target.add_(delta)
                else:
                    target.index_add_(0, rows, delta)
        return out


class LoraTable:
    """The adapters an engine holds, and the rows of the forward in progress (decode thread only while it runs;
    changed at a step boundary). Hooks sit on the linears some adapter targets, none when it holds none."""

    def __init__(self, model: nn.Module) -> None:
        self.linears: dict[str, nn.Linear] = {
            name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)
        }
        self.names: dict[nn.Module, str] = {module: name for name, module in self.linears.items()}
        self.adapters: dict[str, LoraAdapter] = {}
        self.rows: LoraRows | None = None  # set by `serving` for the forward in progress
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def put(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (replacing one of its name)."""
        self.adapters[adapter.name] = adapter
        self._rehook()

    def drop(self, name: str) -> None:
        self.adapters.pop(name, None)
        self._rehook()

    def rows_of(self, adapters: list[str | None], device: torch.device) -> LoraRows | None:
        """The grouping of one forward's rows (row i uses ``adapters[i]``); None when no row uses one. A name
        the table does not hold computes as the base model (rows already handed back: their outputs go nowhere)."""
        if not self.adapters:
            return None
        by_name: dict[str, list[int]] = {}
        for i, name in enumerate(adapters):
            if name is not None and name in self.adapters:
                by_name.setdefault(name, []).append(i)
        if not by_name:
            return None
        groups = tuple(
            (self.adapters[name], None if len(rows) == len(adapters) else torch.tensor(rows, device=device))
            for name, rows in by_name.items()
        )
        return LoraRows(groups, self.names)

    @contextlib.contextmanager
    def serving(self, rows: LoraRows | None) -> Iterator[None]:
        """The hooks add ``rows``' deltas to the forwards run inside."""
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        rows = self.rows
        return None if rows is None else rows.add(output, args[0], module)

    def _rehook(self) -> None:
        """Hooks on exactly the linears some adapter targets."""
        targets = {module for adapter in self.adapters.values() for module in adapter.modules}
        for name in set(self._hooks) - targets:
            self._hooks.pop(name).remove()
        for name in targets - set(self._hooks):
            self._hooks[name] = self.linears[name].register_forward_hook(self._hook)
