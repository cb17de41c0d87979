"""`TinkerService`: what each Tinker route does, over one `TinkerTrainer` and one `HFEngine` per base model.

Training requests run as jobs of their model's FIFO (`FutureStore`), samples side by side. A sampler is an
adapter `Snapshot` served by the base's engine under the sampler's id, loaded when first sampled. Creating a
model or a sampler is idempotent by (session, seq id): the SDK posts again when a reply was lost, and the
second post gets the first one's answer (a different body with the same seq id is a 400).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_agents.errors import RequestError
from areal_agents.tinker import schemas as s
from areal_agents.tinker.futures import FutureStore
from areal_agents.tinker.ownership import BaseModels, BaseModelSpec, CheckpointPaths, NotFound, SessionBook
from areal_agents.tinker.ranks import RankedTinkerTrainer
from areal_agents.tinker.sampler import SampleParams, ServedAdapters, Snapshot
from areal_agents.tinker.training import TinkerTrainer, checkpoint_spec
from areal_agents.tinker.wire import (
    ForwardBackwardBatch,
    SampledSequence,
    encode_forward_backward_output,
    encode_sample_response,
)

DEFAULT_MAX_TOKENS = 256  # an asample that leaves max_tokens out
MAX_SERVED_SAMPLERS = 32  # adapters an engine holds at once; older samplers are loaded again when sampled


@dataclass(frozen=True)
class ModelRecord:
    """What ``get_info`` and ``training_runs`` tell about a training model."""

    base_model: str
    base_dir: str
    rank: int
    arch: str


@dataclass(frozen=True)
class SamplerRecord:
    """A sampler: its base, the adapter snapshot it samples (tensors None: the bare base), where it came from."""

    sampler_id: str
    base_model: str
    snapshot: Snapshot
    model_path: str | None = None


class TinkerService:
    """The server's state and one method per route; rest.py maps them to HTTP.

    Example:
        service = TinkerService(BaseModels({"my-model": Path("/ckpt")}), "/tmp/tinker-ckpts")
        app = build_app(service)
    """

    def __init__(
        self,
        base_models: BaseModels,
        checkpoint_root: str | Path,
        trainer: TinkerTrainer | RankedTinkerTrainer | None = None,
        engine_device: str = "cpu",
    ):
        self.base_models = base_models
        self.engine_device = engine_device
        self.paths = CheckpointPaths(checkpoint_root)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.trainer = trainer or TinkerTrainer()
        self.sessions = SessionBook()
        self.futures = FutureStore()
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        self._engines: dict[str, Any] = {}  # base dir -> HFEngine
        self._engine_lock = asyncio.Lock()
        self._adapters: dict[str, ServedAdapters] = {}  # base dir -> the sampler adapters its engine serves
        self._once: dict[tuple, tuple[str, dict[str, Any], Callable[[], dict[str, Any]]]] = {}
        self._sample_ids = itertools.count()

    # ---- base models -------------------------------------------------------------------------

    async def base_dir(self, spec: BaseModelSpec) -> str:
        """The checkpoint directory of a base model; a tiny family's is built under the root at first use."""
        if spec.path is not None:
            return str(spec.path.resolve())
        out = self.paths.root / "_bases" / spec.name
        if not (out / "config.json").is_file():
            from areal_agents.models.tiny import save_tiny_model  # noqa: PLC0415

            await asyncio.to_thread(save_tiny_model, out, family=spec.family, overwrite=True)
        return str(out)

    def base_name(self, base_dir: str) -> str:
        """The served name of a base directory (a checkpoint saved by this server names its base by directory)."""
        for name in self.base_models.names():
            spec = self.base_models.get(name)
            built = self.paths.root / "_bases" / name
            if (spec.path is not None and str(spec.path.resolve()) == base_dir) or str(built) == base_dir:
                return name
        return base_dir

    # ---- idempotent creation -------------------------------------------------------------------

    def _repeat(self, key: tuple, body: dict[str, Any]) -> dict[str, Any] | None:
        """The first answer to a creation posted again with the same body; 400 for the same seq id, another body."""
        if key not in self._once:
            return None
        first_body, reply, remake = self._once[key]
        if first_body != body:
            raise RequestError(f"{key[1]}: {key[2]} was already used by another request in this session")
        if "request_id" in reply and reply["request_id"] not in self.futures:
            reply = remake()  # the first result was fetched long ago: the same answer again
            self._once[key] = (first_body, reply, remake)
        return reply

    # ---- training models -------------------------------------------------------------------------

    async def create_model(self, req: s.CreateModelRequest) -> dict[str, Any]:
        body = req.model_dump()
        key = (req.session_id, "model_seq_id", req.model_seq_id)
        if (again := self._repeat(key, body)) is not None:
            return again
        spec = self.base_models.get(req.base_model)
        lora = req.lora_config or s.LoraConfig(rank=32)
        base_dir = await self.base_dir(spec)
        model_id = self.sessions.new_model_id(req.session_id, req.model_seq_id)
        self.models[model_id] = ModelRecord(spec.name, base_dir, lora.rank, _arch(base_dir))
        options = {k: getattr(lora, k) for k in ("seed", "train_attn", "train_mlp", "train_unembed")}
        result = {"model_id": model_id, "type": "create_model"}

        def create() -> dict[str, Any]:
            self.trainer.create_model(model_id, base_dir, lora.rank, **options)
            return result

        reply = s.future_reply(self.futures.submit(create, req.session_id, model_id), model_id)
        self._once[key] = (body, reply, lambda: self._again(req.session_id, model_id, result))
        return reply

    def _again(self, owner: str, model_id: str, result: dict[str, Any]) -> dict[str, Any]:
        """A new future with a creation's result, once the model exists (its FIFO: after the creation)."""

        def check() -> dict[str, Any]:
            if model_id not in self.trainer.models:
                raise NotFound(f"model_id: {model_id!r} could not be created (see the first request's error)")
            return result

        return s.future_reply(self.futures.submit(check, owner, model_id), model_id)

    def get_info(self, req: s.GetInfoRequest) -> dict[str, Any]:
        record = self._record(req.model_id)
        return s.get_info_reply(req.model_id, record.base_model, record.rank, record.arch, record.base_dir)

    def _record(self, model_id: str) -> ModelRecord:
        self.sessions.session_of_model(model_id)
        if model_id not in self.models:
            raise NotFound(f"model_id: no model {model_id!r} on this server")
        return self.models[model_id]

    def _submit(self, model_id: str, job: Callable[[], Any]) -> dict[str, Any]:
        """A job on ``model_id``'s FIFO, owned by its session."""
        session = self.sessions.session_of_model(model_id)
        self._record(model_id)
        return s.future_reply(self.futures.submit(job, session.session_id, model_id), model_id)

    def forward_backward(self, batch: ForwardBackwardBatch) -> dict[str, Any]:
        datums = [(d.tokens, d.loss_fn_inputs) for d in batch.datums]

        def run() -> bytes:
            out = self.trainer.forward_backward(
                batch.model_id, datums, batch.loss_fn, batch.loss_fn_config, batch.forward_only
            )
            outputs = [{"logprobs": lp, "elementwise_loss": el} for lp, el in zip(out.logprobs, out.elementwise_loss)]
            return encode_forward_backward_output(outputs, out.metrics)

        return self._submit(batch.model_id, run)

    def optim_step(self, req: s.OptimStepRequest) -> dict[str, Any]:
        p = req.adam_params
        params = {"beta1": p.beta1, "beta2": p.beta2, "eps": p.eps, "weight_decay": p.weight_decay}
        params.update(learning_rate=p.learning_rate, grad_clip_norm=p.grad_clip_norm)
        return self._submit(req.model_id, lambda: {"metrics": self.trainer.optim_step(req.model_id, **params)})

    def save_weights(self, req: s.SaveWeightsRequest) -> dict[str, Any]:
        name = req.path or f"seq-{req.seq_id or 0}"
        ref = self.paths.for_save(req.model_id, "weights", name)
        self._check_new(ref.path, req.overwrite)

        def save() -> dict[str, Any]:
            self.trainer.save_state(req.model_id, ref.path, optimizer=True)
            return {"path": ref.uri, "type": "save_weights"}

        return self._submit(req.model_id, save)

    def save_weights_for_sampler(self, req: s.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        record = self._record(req.model_id)
        if req.path is not None:
            ref = self.paths.for_save(req.model_id, "sampler_weights", req.path)
            self._check_new(ref.path, overwrite=False)

            def save() -> dict[str, Any]:
                self.trainer.save_state(req.model_id, ref.path, optimizer=False)
                return {"path": ref.uri, "type": "save_weights_for_sampler"}

            return self._submit(req.model_id, save)
        session = self.sessions.session_of_model(req.model_id).session_id
        key = (session, "sampling_session_seq_id", req.sampling_session_seq_id)
        body = req.model_dump(exclude={"seq_id"})
        if (again := self._repeat(key, body)) is not None:
            return again
        sampler_id = self.sessions.new_sampler_id(session, req.sampling_session_seq_id)
        result = {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        def snapshot() -> dict[str, Any]:
            snap = self.trainer.sampler_snapshot(req.model_id)
            self.samplers[sampler_id] = SamplerRecord(sampler_id, record.base_model, snap)
            return result

        reply = self._submit(req.model_id, snapshot)
        self._once[key] = (body, reply, lambda: self._again(session, req.model_id, result))
        return reply

    def _check_new(self, path: Path, overwrite: bool) -> None:
        if path.exists() and not overwrite:
            raise RequestError(f"path: a checkpoint named {path.name!r} exists (pass overwrite, or another name)")

    def load_weights(self, req: s.LoadWeightsRequest) -> dict[str, Any]:
        ref = self.paths.existing(req.path, ("weights",))
        spec = checkpoint_spec(ref.path)
        if req.model_id is not None:  # the legacy TrainingClient.load_state: into an existing model
            record = self._record(req.model_id)
            if spec.base_dir != record.base_dir:
                raise RequestError(f"path: {req.path!r} was trained on another base model than {req.model_id!r}")
            return self._submit(req.model_id, lambda: self._load(ref.path, req.model_id, req.optimizer, req.path))
        key = (req.session_id, "model_seq_id", req.model_seq_id)
        body = req.model_dump()
        if (again := self._repeat(key, body)) is not None:
            return again
        model_id = self.sessions.new_model_id(req.session_id, req.model_seq_id)
        self.models[model_id] = ModelRecord(
            self.base_name(spec.base_dir), spec.base_dir, spec.rank, _arch(spec.base_dir)
        )
        reply = self._submit(model_id, lambda: self._load(ref.path, model_id, req.optimizer, req.path))
        result = {"path": req.path, "model_id": model_id, "type": "load_weights"}
        self._once[key] = (body, reply, lambda: self._again(req.session_id, model_id, result))
        return reply

    def _load(self, path: Path, model_id: str, optimizer: bool, uri: str) -> dict[str, Any]:
        self.trainer.load_state(path, model_id, with_optimizer=optimizer)
        return {"path": uri, "model_id": model_id, "type": "load_weights"}

    # ---- sampling -----------------------------------------------------------------------------

    async def create_sampling_session(self, req: s.CreateSamplingSessionRequest) -> dict[str, Any]:
        key = (req.session_id, "sampling_session_seq_id", req.sampling_session_seq_id)
        body = req.model_dump()
        if (again := self._repeat(key, body)) is not None:
            return again
        self.sessions.get(req.session_id)
        if req.model_path is not None:
            ref = self.paths.existing(req.model_path, field_name="model_path")
            base_dir = checkpoint_spec(ref.path).base_dir
            snapshot = await asyncio.to_thread(Snapshot.read, ref.path, base_dir)
            base_model = self.base_name(base_dir)
            if req.base_model is not None and req.base_model != base_model:
                raise RequestError(f"base_model: {req.model_path!r} was trained on {base_model!r}, not this one")
        else:
            spec = self.base_models.get(req.base_model)
            snapshot, base_model = Snapshot(await self.base_dir(spec)), spec.name
        sampler_id = self.sessions.new_sampler_id(req.session_id, req.sampling_session_seq_id)
        self.samplers[sampler_id] = SamplerRecord(sampler_id, base_model, snapshot, req.model_path)
        reply = {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
        self._once[key] = (body, reply, lambda: reply)
        return reply

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        record = self._sampler(sampler_id)
        reply = {"sampler_id": sampler_id, "base_model": record.base_model}
        return reply | ({"model_path": record.model_path} if record.model_path else {})

    def _sampler(self, sampler_id: str) -> SamplerRecord:
        self.sessions.session_of_sampler(sampler_id)
        if sampler_id not in self.samplers:  # registered, its snapshot not taken yet (or it failed)
            raise NotFound(f"sampling_session_id: sampler {sampler_id!r} is not ready (wait for its future)")
        return self.samplers[sampler_id]

    def sample(self, req: s.SampleRequest) -> dict[str, Any]:
        record = self._sampler(req.sampling_session_id)
        p = req.sampling_params
        params = SampleParams(
            p.max_tokens or DEFAULT_MAX_TOKENS, p.temperature, p.top_p, p.top_k, p.stop, p.seed
        )  # a bad value: TinkerUserError, a 400 naming it
        tokens = req.prompt.tokens()

        async def run() -> bytes:
            engine = await self.engine(record.snapshot.base_dir)
            async with self._adapters[record.snapshot.base_dir].use(record.sampler_id, record.snapshot) as name:
                out = await self.trainer.sample(
                    engine, name, record.snapshot, tokens, params, req.num_samples, bool(req.prompt_logprobs)
                )
            seqs = [SampledSequence(q.tokens, q.logprobs, q.stop_reason) for q in out.sequences]  # type: ignore[arg-type]
            return encode_sample_response(seqs, out.prompt_logprobs)

        owner = self.sessions.session_of_sampler(record.sampler_id).session_id
        request_id = self.futures.submit(run, owner)
        first = next(self._sample_ids)
        return s.future_reply(
            request_id, sample_ids=[f"{record.sampler_id}:{first}:{i}" for i in range(req.num_samples)]
        )

    async def engine(self, base_dir: str) -> Any:
        """The engine serving ``base_dir``'s samplers, loaded at first use."""
        async with self._engine_lock:
            if base_dir not in self._engines:
                from areal_agents.engines.hf.engine import HFEngine  # noqa: PLC0415
                from areal_agents.models import load_model  # noqa: PLC0415

                model = await asyncio.to_thread(load_model, base_dir)
                self._engines[base_dir] = HFEngine(model, device=self.engine_device)
                self._adapters[base_dir] = ServedAdapters(self._engines[base_dir], MAX_SERVED_SAMPLERS)
            return self._engines[base_dir]

    # ---- sessions ------------------------------------------------------------------------------

    async def finish_session(self, session_id: str) -> None:
        """Forget the session's requests, free its models' adapters and its samplers."""
        session = self.sessions.finish(session_id)
        self.futures.drop_owner(session_id)
        for model_id in session.models.values():
            if self.models.pop(model_id, None) is not None:
                self.futures.submit(lambda m=model_id: self._drop(m), "_finished", model_id)
        for sampler_id in session.samplers.values():
            record = self.samplers.pop(sampler_id, None)
            if record is not None and record.snapshot.base_dir in self._adapters:
                await self._adapters[record.snapshot.base_dir].drop(sampler_id)
        self._once = {k: v for k, v in self._once.items() if k[0] != session_id}

    def _drop(self, model_id: str) -> None:
        if model_id in self.trainer.models:
            self.trainer.drop_model(model_id)

    def training_run(self, run_id: str) -> dict[str, Any]:
        record = self._record(run_id)
        session = self.sessions.session_of_model(run_id)
        return {
            "training_run_id": run_id,
            "base_model": record.base_model,
            "model_owner": session.session_id,
            "is_lora": True,
            "lora_rank": record.rank,
            "last_request_time": "1970-01-01T00:00:00Z",
            "corrupted": False,
            "user_metadata": {k: str(v) for k, v in session.user_metadata.items()},
        }

    async def close(self) -> None:
        await self.futures.close()
        for engine in self._engines.values():
            engine.close()
        self.trainer.close()  # ranks: their processes stop


def _arch(base_dir: str) -> str:
    """The base's ``model_type`` (get_info's ``arch``)."""
    try:
        return str(json.loads((Path(base_dir) / "config.json").read_text()).get("model_type", "unknown"))
    except (OSError, ValueError):
        return "unknown"
