"""`TinkerTrainer`: Tinker's training models as adapters of the trainer's own `LoraBase`, no second stack.

Each training model is one named LoRA adapter on the shared base of its base model (``trainers/lora.py``: the
base in memory once however many clients train), with its own AdamW state. ``forward_backward`` packs the
datums into padding-free micro-batches (``trainers/batching.py``) and scores each position's *target* token
with the trainer's float32 head (``models/logprobs.py``); its gradients add up until ``optim_step``.
Samplers are `Snapshot`s of an adapter, served by an engine under a name of their own (adapter-only sync).

    trainer = TinkerTrainer()
    trainer.create_model("s:train:0", "runs/tiny", rank=8)
    out = trainer.forward_backward("s:train:0", [(tokens, {"target_tokens": t, "weights": w})], "cross_entropy")
    trainer.optim_step("s:train:0", learning_rate=1e-3)
    snapshot = trainer.sampler_snapshot("s:train:0")
    await engine.set_lora_adapter("sampler-1", snapshot.tensors, snapshot.config)
    result = await trainer.sample(engine, "sampler-1", snapshot, prompt, SampleParams(max_tokens=8))
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from transformers import AutoTokenizer

from areal_agents.config import LoraConfig
from areal_agents.engines.base import LoraEngine
from areal_agents.errors import TinkerUserError
from areal_agents.tinker.losses import Inputs, check_datum, loss_config, loss_spec
from areal_agents.tinker.sampler import SampleOutput, SampleParams, Snapshot, sample
from areal_agents.tinker.sharding import (
    TargetScorer,
    all_reduce_gradients,
    broadcast_from_rank0,
    shard_base,
    target_logprobs,
)
from areal_agents.trainers.batching import make_micro_batches
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.lora import Adapter, LoraBase
from areal_agents.trainers.optim import optimizer_step
from areal_agents.types import Trajectory

# train_attn / train_mlp / train_unembed -> PEFT target modules (Llama and Qwen names; the families we load)
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0  # Tinker's fixed alpha: the update is (32 / rank) B A, so a learning rate suits any rank
MAX_RANK = 512
MICRO_BATCH_TOKENS = 8192  # tokens per packed micro-batch of forward_backward
MODEL_FILE, OPTIMIZER_FILE = "tinker_model.json", "optimizer.pt"  # beside PEFT's adapter files in a checkpoint


@dataclass(frozen=True)
class LoraSpec:
    """A training model's LoRA as Tinker's ``lora_config`` gives it, and its base model's directory."""

    base_dir: str
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise TinkerUserError(f"lora_config.rank: expects an integer in [1, {MAX_RANK}], got {self.rank!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TinkerUserError(f"lora_config.seed: expects an integer, got {self.seed!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise TinkerUserError(
                "lora_config: train_attn, train_mlp and train_unembed are all false: nothing to train"
            )

    def lora(self) -> LoraConfig:
        chosen = (ATTN_MODULES, self.train_attn), (MLP_MODULES, self.train_mlp), (UNEMBED_MODULES, self.train_unembed)
        targets = [m for modules, on in chosen if on for m in modules]
        return LoraConfig(r=self.rank, alpha=LORA_ALPHA, target_modules=targets)


@dataclass
class TrainingModel:
    """One Tinker training model: its adapter on the shared base and its AdamW state."""

    spec: LoraSpec
    adapter: Adapter
    optimizer: torch.optim.AdamW


@dataclass
class ForwardBackwardOutput:
    """Per datum: ``logprobs`` (lp_t) and ``elementwise_loss`` [T] float32; ``metrics`` keyed ``name:reduction``."""

    logprobs: list[torch.Tensor]
    elementwise_loss: list[torch.Tensor]
    metrics: dict[str, float]


class SnapshotSampling(ABC):
    """`sample` for a trainer that scores prompts with ``prompt_logprobs(snapshot, tokens)``, wherever that
    trainer runs (this process, or its ranks: `tinker.ranks`)."""

    @abstractmethod
    def prompt_logprobs(self, snapshot: Snapshot, tokens: list[int]) -> list[float | None]:
        """log π(tokens[t] | tokens[:t]) under ``snapshot`` for t >= 1, None at t = 0."""

    async def sample(
        self,
        engine: LoraEngine,
        adapter_name: str | None,
        snapshot: Snapshot,
        prompt_tokens: list[int],
        params: SampleParams,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
    ) -> SampleOutput:
        """``num_samples`` samples from ``snapshot``, served by ``engine`` as ``adapter_name`` (None: the bare
        base); with ``prompt_logprobs`` the prompt's logprobs under the same snapshot (None at position 0)."""
        score = (lambda tokens: self.prompt_logprobs(snapshot, tokens)) if prompt_logprobs else None
        decode = _tokenizer(snapshot.base_dir).decode if any(isinstance(s, str) for s in params.stops) else None
        return await sample(engine, adapter_name, prompt_tokens, params, num_samples, decode, score)


class TinkerTrainer(SnapshotSampling):
    """Training models (adapters) over shared bases, one `LoraBase` per base directory; ``device`` for them all.
    With ``dp`` (one rank of several, on its device) each base is FSDP2-sharded and every request runs on every
    rank (`tinker.sharding`; the calls come through `tinker.ranks`)."""

    def __init__(
        self,
        dtype: str = "float32",
        device: str = "cpu",
        micro_batch_tokens: int = MICRO_BATCH_TOKENS,
        dp: DataParallel | None = None,
    ):
        self.dtype, self.micro_batch_tokens, self.dp = dtype, micro_batch_tokens, dp
        self.device = dp.device if dp is not None else torch.device(device)
        self.bases: dict[str, LoraBase] = {}
        self.roots: dict[str, TargetScorer] = {}  # with dp: each base's sharded root
        self.models: dict[str, TrainingModel] = {}
        self._adapters = itertools.count()  # adapter names are ours ("m0", "m1", ...), not the client's model ids
        self._scratch: dict[tuple, Adapter] = {}  # per (base, LoRA shape): the adapter a sampler's snapshot scores in

    # ---- models ------------------------------------------------------------------------------

    def create_model(
        self,
        model_id: str,
        base_model_dir: str,
        rank: int,
        seed: int | None = None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
    ) -> TrainingModel:
        """A fresh adapter (B = 0: the base model exactly) on ``base_model_dir``'s shared base, with its AdamW."""
        spec = LoraSpec(str(base_model_dir), rank, seed, train_attn, train_mlp, train_unembed)
        return self._add(model_id, spec, None)

    def drop_model(self, model_id: str) -> None:
        """Forget a training model and free its adapter (its session finished); the base goes with its last."""
        model = self._model(model_id)
        base, name = model.adapter.base, model.adapter.name
        with base.lock:
            del self.models[model_id]
            if list(base.peft.peft_config) == [name]:
                del self.bases[model.spec.base_dir]
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # PEFT: "was active which is now deleted"
                base.peft.delete_adapter(name)
            base.peft.set_adapter(next(iter(base.peft.peft_config)))  # PEFT leaves a deleted one "active"

    def _add(self, model_id: str, spec: LoraSpec, adapter_dir: Path | None) -> TrainingModel:
        if not isinstance(model_id, str) or not model_id:
            raise TinkerUserError(f"model_id: expects a non-empty string, got {model_id!r}")
        if model_id in self.models:
            raise TinkerUserError(f"model_id: {model_id!r} exists already")
        adapter = self._new_adapter(self._base(spec.base_dir), spec.lora(), spec.seed, adapter_dir)
        betas = (0.9, 0.95)  # Tinker's defaults; each optim_step sets its own
        optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-4, betas=betas, eps=1e-12, weight_decay=0.0)
        self.models[model_id] = TrainingModel(spec, adapter, optimizer)
        return self.models[model_id]

    def _new_adapter(self, base: LoraBase, cfg: LoraConfig, seed: int | None, adapter_dir: Path | None) -> Adapter:
        with base.lock, torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # PEFT: the head is tied to the embedding (we never merge)
            if seed is not None:
                torch.manual_seed(seed)  # PEFT's initialisation of A
            adapter = base.add(f"m{next(self._adapters)}", cfg, adapter_dir)
            if self.dp is None:
                base.peft.to(self.device)
            else:  # PEFT put it beside the sharded base's weights; rank 0's draw of A everywhere
                broadcast_from_rank0(adapter.parameters())
        return adapter

    def _base(self, base_dir: str) -> LoraBase:
        if base_dir not in self.bases:
            base = LoraBase(base_dir, self.dtype)
            if self.dp is not None:
                targets = [*ATTN_MODULES, *MLP_MODULES, *UNEMBED_MODULES]  # any LoRA a spec may ask for
                self.roots[base_dir] = shard_base(base, targets, self.device, self.dtype)
            self.bases[base_dir] = base
        return self.bases[base_dir]

    def _model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise TinkerUserError(f"model_id: unknown {model_id!r}")
        return self.models[model_id]

    # ---- forward_backward and optim_step ----------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        datums: Sequence[tuple[list[int], Mapping[str, torch.Tensor]]],
        loss_fn: str,
        config: Mapping[str, Any] | None = None,
        forward_only: bool = False,
    ) -> ForwardBackwardOutput:
        """``loss_fn``'s loss summed over ``datums`` (tokens, per-token inputs); its gradients are added to the
        model's (until `optim_step`) unless ``forward_only`` (no graph at all). All or nothing: a request that
        fails leaves the gradients as they were."""
        model = self._model(model_id)
        spec, cfg = loss_spec(loss_fn), loss_config(loss_fn, config)
        if not isinstance(datums, Sequence) or not datums:
            raise TinkerUserError("data: expects at least one datum")
        vocab = model.adapter.peft.get_base_model().config.vocab_size
        checked = [check_datum(i, d[0], d[1], loss_fn, vocab) for i, d in enumerate(_pairs(datums))]
        with model.adapter.active(), _grads_kept_on_error(model.adapter.parameters()):
            scored = self._score(model.adapter, checked, lambda lp, x: spec.elementwise(lp, x, cfg), not forward_only)
        losses = [loss for _, loss in scored]
        total = float(sum(loss.double().sum() for loss in losses))
        return ForwardBackwardOutput([lp for lp, _ in scored], losses, {"loss:sum": total})

    def _score(self, adapter: Adapter, checked: list[tuple[list[int], Inputs]], loss: Any, backward: bool):
        """Per datum (lp [T], loss(lp, inputs) [T]) as float32 CPU tensors, in packed micro-batches; with
        ``backward`` each micro-batch's summed loss is backpropagated (adding to the adapter's gradients).
        With ranks each scores its share and all get every datum's; a non-finite loss on any fails them all."""
        trajectories = [Trajectory(t, [1] * len(t), [0.0] * len(t), [-1] * len(t)) for t, _ in checked]
        micro_batches = make_micro_batches(trajectories, self._budget([len(t) for t, _ in checked]), pack=True)
        if self.dp is not None:
            micro_batches = self.dp.share(micro_batches)  # padded: every rank runs as many (FSDP2 collectives)
        out, finite = {}, True
        with torch.set_grad_enabled(backward):
            for mb in micro_batches:
                lp, elementwise = self._score_micro_batch(adapter, mb, checked, loss)
                finite = finite and bool(torch.isfinite(elementwise).all())
                if backward:
                    elementwise.sum().backward()  # even when not finite: the ranks' collectives stay in step
                for (_, a, b), i in zip(mb.slices, mb.index):
                    out[i] = (lp[a:b].detach().float().cpu(), elementwise[a:b].detach().float().cpu())
        if self.dp is not None:
            out, finite = self.dp.gather(out), self.dp.max(0.0 if finite else 1.0) == 0.0
        if not finite:  # the caller puts the gradients back
            raise TinkerUserError("loss_fn_inputs: the loss is NaN or infinite (logprobs far from lp_t?)")
        return [out[i] for i in range(len(checked))]

    def _budget(self, lengths: list[int]) -> int:
        """Tokens per micro-batch: ``micro_batch_tokens``; with ranks at most a rank's share of the request (so a
        request smaller than one micro-batch still gives every rank some), never below its longest datum."""
        if self.dp is None:
            return self.micro_batch_tokens
        share = -(-sum(lengths) // self.dp.world_size)
        return min(self.micro_batch_tokens, max(share, max(lengths)))

    def _score_micro_batch(self, adapter: Adapter, mb: Any, checked: list[tuple[list[int], Inputs]], loss: Any):
        """(lp, loss) of one packed micro-batch; a rank's padding micro-batch (no datums) scores zero loss."""
        mb = mb.to(self.device)
        if not mb.index:
            targets = torch.zeros(mb.input_ids.shape[-1], dtype=torch.long, device=self.device)
            lp = self.roots[adapter.base.path](mb, targets)
            return lp, lp * 0.0
        inputs = {k: torch.cat([checked[i][1][k] for i in mb.index]).to(self.device) for k in checked[0][1]}
        if self.dp is not None:
            lp = self.roots[adapter.base.path](mb, inputs["target_tokens"])
        else:
            lp = target_logprobs(adapter.peft.get_base_model(), mb, inputs["target_tokens"])
        return lp, loss(lp, inputs)

    def optim_step(
        self,
        model_id: str,
        learning_rate: float = 1e-4,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One AdamW step on the gradients added since the last (decoupled weight decay; the gradient clipped to
        ``grad_clip_norm`` when > 0), then zero them; ``grad_norm:mean`` is the norm before clipping."""
        model = self._model(model_id)
        given = {"learning_rate": learning_rate, "eps": eps, "weight_decay": weight_decay}
        for key, value in {**given, "grad_clip_norm": grad_clip_norm}.items():
            _check_number(key, value, low=0.0)
        for key, value in (("beta1", beta1), ("beta2", beta2)):
            _check_number(key, value, low=0.0, below=1.0)
        for group in model.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        with model.adapter.base.lock:
            if self.dp is not None:
                all_reduce_gradients(model.adapter.parameters())  # each rank's share: their sum is the whole
            clip = grad_clip_norm if grad_clip_norm > 0 else math.inf
            norm = optimizer_step(model.adapter.peft, model.optimizer, clip)
            model.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm, "learning_rate:mean": float(learning_rate)}

    def close(self) -> None:
        """Forget every training model and base (their memory goes with them)."""
        self.models.clear()
        self.bases.clear()
        self.roots.clear()
        self._scratch.clear()

    # ---- checkpoints ------------------------------------------------------------------------

    def save_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> None:
        """PEFT's adapter directory at ``path``, its Tinker LoRA config, and (``optimizer``) its AdamW state."""
        model, path = self._model(model_id), Path(path)
        if self.dp is not None and self.dp.rank != 0:
            return  # the ranks hold the same adapter and optimizer state: rank 0 writes
        model.adapter.save_pretrained(path)
        (path / MODEL_FILE).write_text(json.dumps(asdict(model.spec), indent=2))
        if optimizer:
            torch.save(model.optimizer.state_dict(), path / OPTIMIZER_FILE)

    def load_state(self, path: str | Path, model_id: str, with_optimizer: bool) -> TrainingModel:
        """Training model ``model_id`` as saved at ``path`` (replacing one of that id), with its AdamW state
        when ``with_optimizer`` (else a fresh one)."""
        path = Path(path)
        spec = checkpoint_spec(path)
        if with_optimizer and not (path / OPTIMIZER_FILE).is_file():
            raise TinkerUserError(f"path: {path.name} was saved without optimizer state (load it without)")
        if model_id in self.models:
            self.drop_model(model_id)
        model = self._add(model_id, spec, path)
        if with_optimizer:
            state = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
            model.optimizer.load_state_dict(state)
        return model

    # ---- samplers -----------------------------------------------------------------------------

    def sampler_snapshot(self, model_id: str) -> Snapshot:
        """The model's adapter now (CPU copies), for an engine to serve under a sampler's name."""
        model = self._model(model_id)
        return Snapshot(model.spec.base_dir, model.adapter.tensors(), model.adapter.config())

    def prompt_logprobs(self, snapshot: Snapshot, tokens: list[int]) -> list[float | None]:
        """log π(tokens[t] | tokens[:t]) under ``snapshot`` for t >= 1, None at t = 0: a forward pass of the
        snapshot's weights, loaded into a scratch adapter of the same shape on the shared base."""
        if len(tokens) < 2:
            return [None] * len(tokens)
        inputs = {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.zeros(len(tokens) - 1)}
        with self._snapshot_adapter(snapshot) as adapter:
            vocab = adapter.peft.get_base_model().config.vocab_size
            checked = check_datum(0, tokens[:-1], inputs, "cross_entropy", vocab)
            ((lp, _),) = self._score(adapter, [checked], lambda lp, x: torch.zeros_like(lp), backward=False)
        return [None, *lp.tolist()]

    @contextlib.contextmanager
    def _snapshot_adapter(self, snapshot: Snapshot) -> Iterator[Adapter]:
        """A scratch adapter holding ``snapshot``'s weights, active (the base's lock held); the bare base: one
        never loaded (B = 0)."""
        base = self._base(snapshot.base_dir)
        cfg = snapshot.config or {"r": 1, "lora_alpha": 1.0, "target_modules": ["q_proj"]}
        key = (
            snapshot.base_dir,
            cfg["r"],
            cfg["lora_alpha"],
            tuple(sorted(cfg["target_modules"])),
            snapshot.tensors is None,
        )
        with base.lock:
            if key not in self._scratch:
                lora = LoraConfig(r=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), target_modules=list(key[3]))
                self._scratch[key] = self._new_adapter(base, lora, 0, None)
            adapter = self._scratch[key]
            if snapshot.tensors is not None:
                loaded = set_peft_model_state_dict(adapter.peft, snapshot.tensors, adapter_name=adapter.name)
                if loaded.unexpected_keys:
                    raise TinkerUserError(f"model_path: the adapter does not fit {snapshot.base_dir}")
            with adapter.active():
                yield adapter


def checkpoint_spec(path: Path) -> LoraSpec:
    """The `LoraSpec` a checkpoint (`TinkerTrainer.save_state`) was saved with."""
    try:
        return LoraSpec(**json.loads((path / MODEL_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        raise TinkerUserError(f"path: {path.name} is not a Tinker checkpoint saved by save_state") from None


@cache
def _tokenizer(base_dir: str) -> Any:
    """The base's tokenizer (stop strings are cut on its text); any tokenizer, no chat template needed."""
    return AutoTokenizer.from_pretrained(base_dir, local_files_only=True)


@contextlib.contextmanager
def _grads_kept_on_error(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Put the gradients back as they were when the body raises (a request's gradients: all or nothing)."""
    before = [None if p.grad is None else p.grad.clone() for p in params]
    try:
        yield
    except BaseException:
        for p, g in zip(params, before):
            p.grad = g
        raise


def _pairs(datums: Sequence[Any]) -> list[tuple[Any, Any]]:
    for i, d in enumerate(datums):
        if not isinstance(d, (tuple, list)) or len(d) != 2:
            raise TinkerUserError(f"data[{i}]: expects (model_input tokens, loss_fn_inputs), got {type(d).__name__}")
    return list(datums)


def _check_number(key: str, value: Any, low: float, below: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if not ok or (below is not None and value >= below):
        bound = f"in [{low}, {below})" if below is not None else f">= {low}"
        raise TinkerUserError(f"adam_params.{key}: expects a finite number {bound}, got {value!r}")
