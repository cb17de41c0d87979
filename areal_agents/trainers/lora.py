"""LoRA: a policy that trains an adapter over a frozen base model, with PEFT (the format users already know).

The trained module stays the transformers model: PEFT injects its LoRA layers into that model's own linear
layers, so packing, micro-batches, FSDP2 and the critic run unchanged on it. Every LoRA policy of a trainer
thread is one named adapter on one `LoraBase` (one `PeftModel`: the base in memory once); `Adapter` is what
a policy trains (inside `Adapter.active`), pushes to engines (`tensors`, `config`) and saves (PEFT's
directory, which ``PeftModel.from_pretrained`` reads). Only adapter parameters require gradients; the KL
reference is the same model with the adapter off (`AdapterOffLM`), no second copy. `export_lora` merges one.

    base = LoraBase("runs/arith/sft/model", "float32")
    adapter = base.add("policy", cfg.model.lora)        # or base.add("policy", cfg.model.lora, ckpt / "model")
    with adapter.active():
        ...                                             # forward and backward on adapter.peft.get_base_model()
    weights, config = adapter.tensors(), adapter.config()
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer, PreTrainedModel

from areal_agents.config import LoraConfig
from areal_agents.errors import ConfigError
from areal_agents.models.loading import load_model
from areal_agents.trainers.batching import ScoredLM
from areal_agents.trainers.checkpoint import checkpoints

ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter


def peft_config(cfg: LoraConfig) -> PeftLoraConfig:
    """PEFT's config of ``cfg`` (``[all-linear]`` stays PEFT's own shorthand: every linear layer but the head)."""
    targets: str | list[str] = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )


def attach_lora(
    model: PreTrainedModel, cfg: LoraConfig, base_path: str | Path | None = None, name: str = "default"
) -> PeftModel:
    """A fresh adapter ``name`` over ``model`` (frozen: only the adapter requires gradients); B starts at zero,
    so the adapted model starts equal to the base. ``base_path``: the base's directory, recorded (absolute) in
    the adapter's config as ``base_model_name_or_path``."""
    try:
        with warnings.catch_warnings():  # PEFT asks transformers 5 a deprecated question (is_gradient_checkpointing)
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, peft_config(cfg), adapter_name=name)
    except ValueError as e:  # PEFT names the target modules it did not find
        raise ConfigError(f"model.lora.target_modules {cfg.target_modules}: {e}") from None
    _record_base(peft_model, name, base_path)
    return peft_model


def _record_base(peft_model: PeftModel, name: str, base_path: str | Path | None) -> None:
    if base_path is not None:
        local = Path(base_path)
        where = str(local.resolve()) if local.is_dir() else str(base_path)
        peft_model.peft_config[name].base_model_name_or_path = where


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


class LoraBase:
    """One frozen base model and the adapters of every LoRA policy over it, one per policy name, in one
    `PeftModel`: the base is in memory once however many agents train. Each policy trains inside
    `Adapter.active`, which takes the base's lock and makes its adapter the one that runs and gets gradients."""

    def __init__(self, path: str, dtype: str) -> None:
        self.path, self.dtype = path, dtype
        self.peft: PeftModel | None = None
        self.lock = threading.RLock()

    def add(self, name: str, cfg: LoraConfig, adapter_dir: str | Path | None = None) -> Adapter:
        """Adapter ``name``: fresh, or the one saved in ``adapter_dir`` (a checkpoint's, on ``--resume``)."""
        with self.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if self.peft is not None and name in self.peft.peft_config:
                raise ConfigError(f"LoRA adapter {name!r} is already on this base model")
            if self.peft is None and adapter_dir is None:
                self.peft = attach_lora(load_model(self.path, self.dtype), cfg, self.path, name)
            elif self.peft is None:
                base = load_model(self.path, self.dtype)
                self.peft = PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=name, is_trainable=True)
            elif adapter_dir is None:
                self.peft.add_adapter(name, peft_config(cfg))
                _record_base(self.peft, name, self.path)
            else:
                self.peft.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=True)
        return Adapter(self, name)


@dataclass
class Adapter:
    """One policy's adapter on a `LoraBase`: what it trains, pushes to engines and saves."""

    base: LoraBase
    name: str

    @property
    def peft(self) -> PeftModel:
        return self.base.peft

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This adapter alone runs and requires gradients (other policies on the base wait)."""
        with self.base.lock:
            self.peft.set_adapter(self.name)
            yield

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's own parameters (what its optimizer holds)."""
        marker = f".{self.name}."
        return [p for n, p in self.peft.named_parameters() if "lora_" in n and marker in n]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its weights keyed as PEFT saves them (``...q_proj.lora_A.weight``), detached full copies on the CPU
        (FSDP2-sharded: gathered, so every rank must call it)."""
        with self.base.lock:
            # the frozen base's embedding and head stay out even when the adapter targets the head (lm_head):
            # PEFT's "auto" would add them, and an engine takes LoRA matrices alone
            state = get_peft_model_state_dict(self.peft, adapter_name=self.name, save_embedding_layers=False)
            return {k: _full(v).detach().to("cpu", copy=True) for k, v in state.items()}

    def config(self) -> dict[str, Any]:
        """Its ``adapter_config.json`` content (what an engine needs besides the tensors)."""
        return json.loads(json.dumps(self.peft.peft_config[self.name].to_dict(), default=sorted))

    def save_pretrained(self, path: str | Path) -> None:
        """PEFT's adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), as
        ``PeftModel.from_pretrained`` reads it, for this adapter alone."""
        write_adapter(path, self.tensors(), self.config())


def write_adapter(path: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """PEFT's adapter directory from an adapter's tensors and config (`Adapter.tensors`, `Adapter.config`),
    wherever they were gathered (a trainer rank on Ray hands them to the driver)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def trainable_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of ``params`` (e.g. an optimizer's: what it keeps state for)."""
    return sum(p.numel() * p.element_size() for p in params)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's full tensor; a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class AdapterOffLM(ScoredLM):
    """The KL reference of a LoRA policy: the trained model with its adapter switched off (the frozen base),
    scored by `token_logprobs` under no gradient. It holds no weights of its own."""

    def __init__(self, adapter: Adapter, root: ScoredLM | None = None) -> None:
        super().__init__(adapter.peft.get_base_model())
        object.__setattr__(self, "adapter", adapter)  # not a submodule: its parameters are the policy's
        object.__setattr__(self, "root", root)  # FSDP2: the policy's sharded root, whose forward gathers the shards

    def forward(self, mb: Any, temperature: float = 1.0) -> torch.Tensor:
        with self.adapter.base.lock, self.adapter.peft.disable_adapter(), torch.no_grad():
            return self.root(mb, temperature) if self.root is not None else super().forward(mb, temperature)


def export_lora(
    run_dir: str | Path,
    out: str | Path,
    *,
    merge: bool,
    policy: str | None = None,
    base: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the newest checkpoint's adapter of ``run_dir`` (a run directory, or one checkpoint) to ``out``:
    merged into its base as a transformers checkpoint (``merge``), or PEFT's adapter directory alone.
    ``policy``: which agent's adapter, for a run with separate policies; ``base``: the base model's
    directory (default: the one the adapter's config names); ``overwrite``: replace an earlier export."""
    adapter = _checkpoint_adapter(Path(run_dir), policy)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        _clear_export(out, overwrite)
    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    if not merge:
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        return out
    base_path = base or json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    if not Path(base_path).is_dir():
        raise ConfigError(
            f"export-lora: base model {base_path!r} (from {adapter / ADAPTER_CONFIG}) not found; pass --base"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        merged = PeftModel.from_pretrained(load_model(base_path), str(adapter)).merge_and_unload()
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _clear_export(out: Path, overwrite: bool) -> None:
    """Remove an earlier export at ``out`` when ``overwrite``; anything else there is never deleted."""
    if not overwrite:
        raise ConfigError(f"export-lora: {out} exists and is not empty (--overwrite replaces an earlier export)")
    if not any((out / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise ConfigError(f"export-lora: {out} holds no earlier export (no config.json); --overwrite leaves it alone")
    shutil.rmtree(out)


def _checkpoint_adapter(run_dir: Path, policy: str | None) -> Path:
    """The adapter directory of ``policy`` in ``run_dir``'s newest checkpoint (or in ``run_dir``, a checkpoint)."""
    found = checkpoints(run_dir)
    ckpt = run_dir if (run_dir / "trainer_state.pt").is_file() else (found[-1] if found else None)
    if ckpt is None:
        raise ConfigError(f"export-lora: no checkpoint under {run_dir / 'checkpoints'}")
    adapter = ckpt / ("model" if policy is None else f"policies/{policy}/model")
    if not is_adapter_dir(adapter):
        others = sorted(p.parent.name for p in ckpt.glob(f"policies/*/model/{ADAPTER_CONFIG}"))
        hint = f"; its adapters: --policy {' | '.join(others)}" if others else " (a run without model.lora?)"
        raise ConfigError(f"export-lora: {adapter} holds no LoRA adapter{hint}")
    return adapter
