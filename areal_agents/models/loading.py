"""Load any transformers checkpoint (the tiny one or a real one) with a clear error on a bad path; check a
generation budget against the model's context before a run starts."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from areal_agents.errors import ConfigError, ModelLoadError
from areal_agents.progress import note

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config names


def quiet_transformers() -> None:
    """No per-load progress bars or warnings from transformers (CLI commands and Ray actors)."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    try:  # the hub's own download and upload bars (transformers' switch covers only its own)
        from huggingface_hub.utils import disable_progress_bars  # noqa: PLC0415

        disable_progress_bars()
    except ImportError:
        pass


def _check_path(path: str | Path) -> Path:
    p = Path(path)
    if not str(path):
        raise ModelLoadError("model.path is empty: set it to a checkpoint directory")
    if p.exists() and not p.is_dir():
        raise ModelLoadError(f"model path {p} is a file, not a directory: give the checkpoint's directory")
    if not p.is_dir():
        where = "" if p.is_absolute() else f" (relative to the working directory: {p.absolute()})"
        raise ModelLoadError(f"model path does not exist: {p}{where}")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model path {p} has no config.json: is it a transformers checkpoint?")
    return p


def load_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` from a local directory, offline; transformers' progress bars
    off in this process (its "Loading weights" here, "Writing model shards" when a checkpoint is saved): a
    run shows its own bars only, in worker processes and library use as in the CLI."""
    p = _check_path(path)
    transformers.utils.logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(p, dtype=DTYPES[dtype], local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model from {p}: {e}".splitlines()[0]) from None


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (its initialisation then costs nothing);
    buffers stay real, computed as their module computes them (accelerate's ``init_empty_weights``). Only in
    the calling thread: modules another thread builds meanwhile keep their weights."""
    register = nn.Module.register_parameter
    thread = threading.get_ident()

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta and threading.get_ident() == thread:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The model `load_model` loads from ``path`` (its config, dtype and attention), parameters on the meta
    device: no checkpoint read, no weight memory. Its buffers are real (rotary frequencies)."""
    p = _check_path(path)
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot build model from {p}: {e}".splitlines()[0]) from None
    if (p / "generation_config.json").is_file():  # as from_pretrained reads it (save_pretrained writes it)
        model.generation_config = GenerationConfig.from_pretrained(p, local_files_only=True)
    return model


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained`` from a local directory; it must have a chat template."""
    p = _check_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load tokenizer from {p}: {e}".splitlines()[0]) from None
    if not tok.chat_template:
        raise ModelLoadError(f"tokenizer in {p} has no chat_template; agents need one")
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in {p} has no eos_token; generation needs one to stop")
    return tok


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id the trainer pads with: the tokenizer's pad token, else its EOS (many chat models have no pad)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def model_context(path: str | Path) -> int | None:
    """The context of the checkpoint at ``path``, in positions: ``max_position_embeddings`` of its config.json
    (or of its ``text_config``), as the engines read it; None when it states none."""
    p = _check_path(path)
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {p / 'config.json'}: {e}".splitlines()[0]) from None
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_max_new_tokens(max_new_tokens: int, path: str | Path, field: str) -> None:
    """`ConfigError` naming ``field`` when ``max_new_tokens`` is more than the context of the model at ``path``
    (no generation can be that long). Budgets up to the context pass: the engines cap each turn's at the
    context its prompt leaves."""
    context = model_context(path)
    if context is not None and max_new_tokens > context:
        raise ConfigError(
            f"{field}: {max_new_tokens} tokens is more than the model's context, {context} positions "
            f"(max_position_embeddings in {Path(path) / 'config.json'}); set {field} to at most {context}"
        )


_warned: set[tuple[str, int, int]] = set()


def warn_prompts_over_context(unfit: int, total: int, context: int | None, where: str) -> None:
    """Say once, on stderr above any bar, that ``unfit`` of ``total`` prompts are longer than the model's
    ``context``: an agent has no room to generate for them, so they produce no tokens, end by ``length``
    and count as wrong, which a truncation rate alone does not tell. Nothing when all fit."""
    if unfit <= 0 or (where, unfit, total) in _warned:
        return
    _warned.add((where, unfit, total))
    size = f"{context} positions" if context else "max_position_embeddings"
    note(
        f"warning: {where}: {unfit} of {total} prompts do not fit the model's context ({size}): they generate "
        "no tokens and count as wrong (finish_reason length); use a model with a longer context "
        "(tiny-model --context N) or shorter prompts"
    )
