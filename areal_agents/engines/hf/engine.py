"""`HFEngine`: an in-process transformers engine with continuous batching, interruptible between steps.

Concurrent requests share one running batch: new ones are prefilled between decode steps, finished ones
leave it (the last rows move into their places). Its KV cache is in segments (rows admitted together,
each left-padded to its own width; neighbours merge when padding is cheaper than an attention call), so a
young row does not attend over the padding of the oldest row's length (`SegmentedKV`).
Requests admitted together with the same context (the episodes of a GRPO group) are prefilled once, and a
request that extends a finished one (the next turn of an episode) prefills only its new tokens
(`PrefixCache`). ``pause()`` stops at a step boundary; ``update_weights`` then swaps the weights (read and
checked whole before the pause, `models.weight_checks`: a refused update changes nothing), which invalidates the
cache, so on ``resume()`` every running sequence is re-prefilled (prompt + tokens so far) and its later
tokens carry the new version (AReaL's interruptible rollout). ``stale_kv="keep"`` keeps the old weights'
keys and values instead (PipelineRL's in-flight weight update): no re-prefill; each token's recorded
logprob is still that of the distribution it was sampled from, which is what decoupled PPO's behavior
policy needs.
Every request is checked first (`check_request`: token ids in the vocabulary, the prompt within the
model's context, ``max_new_tokens`` capped at the context left); an error in one request's prefill, decode
step or sampling fails that request alone. ``health()`` says whether the decode loop itself still runs.
``abort()`` ends requests early with stop reason ``abort`` and the tokens so far (what ``serve-model``'s
/pause_generation and /abort_request do); ``generate_once`` may return such a partial response, while
``agenerate`` resubmits prompt + tokens so far until the request completes, as the SGLang client does.
``device`` puts the model, the KV cache, masks and sampling on a GPU (bfloat16 there by default;
engine_placement.py); ``share_weights`` makes ``update_weights`` take the trainer's tensors themselves, no copy
(``engine.weight_sync=in_process`` on one GPU: a synchronous run only, which the engine enforces).
LoRA adapters (multi_lora.py) are served beside the base model, several in one batch: a request names its
adapter (``GenRequest.lora_name``); loading or replacing one is a weight update for the rows that use it.
A request with ``SamplingParams.seed`` samples from its own seed, whatever else shares the batch.

This module is the engine's API; `Scheduler` (scheduler.py) runs the queue and the decode thread,
`BatchRunner` (batch_runner.py) each step on the model, over the `RunningBatch` (running_batch.py).

    engine = HFEngine(load_model("runs/tiny"))
    resp = await engine.agenerate(GenRequest("r1", prompt_ids, SamplingParams(max_new_tokens=8)))
    await engine.update_weights(trainer_model.state_dict())      # pause, load, version += 1, resume

    engine = HFEngine(load_model("runs/tiny"), device="cuda", share_weights=True)   # one GPU, colocated
    await engine.update_weights(trainer_model.state_dict())      # the trainer's tensors: no copy

    await engine.load_lora_adapter("debater_0", "runs/x/adapter", version=3)     # PEFT's directory
    await engine.agenerate(GenRequest("r2", prompt_ids, SamplingParams(seed=7), lora_name="debater_0"))
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from areal_agents.config import EngineOptions
from areal_agents.engines.base import LoraEngine
from areal_agents.engines.hf.batch_runner import BatchRunner
from areal_agents.engines.hf.engine_placement import Placement, shareable
from areal_agents.engines.hf.multi_lora import LoraAdapter, read_adapter_dir
from areal_agents.engines.hf.request_checks import RequestLimits, check_request
from areal_agents.engines.hf.running_batch import MAX_SEGMENTS, Submission
from areal_agents.engines.hf.scheduler import Scheduler
from areal_agents.engines.hf.segmented_attention import SEGMENTED_SDPA
from areal_agents.engines.hf.stats import EngineStats
from areal_agents.engines.interruptible import ResumeGate, generate_to_end, update_pause
from areal_agents.errors import EngineError
from areal_agents.models.weight_checks import WeightSpec, check_state_dict, copy_into, read_checkpoint
from areal_agents.types import GenRequest, GenResponse

__all__ = ["MAX_SEGMENTS", "STALL_S", "EngineStats", "HFEngine", "StaleKV"]

StaleKV = Literal["recompute", "keep"]  # what new weights do to the KV cache of running and finished requests
STALL_S = 600.0  # seconds a decode step may take before `health` calls the thread stuck


class HFEngine(LoraEngine):
    """In-process `InferenceEngine` over a transformers causal LM (the CPU default and test engine).

    ``device``: ``cpu``, ``cuda`` or ``auto``; ``compute_dtype``: ``auto`` (bfloat16 for a float32 model on
    CUDA, else the model's dtype), ``float32``, ``bfloat16`` or ``float16``; ``share_weights``:
    ``update_weights`` points the model at the given tensors instead of copying them (same device, same
    dtype; see `update_weights`); ``num_threads``: the decode thread's intra-op threads (None: the cores less one
    for the event loop, `team_threads`).
    """

    stall_s: float = STALL_S  # `health`: busy this long without finishing a step is stuck

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 256,
        seed: int = 0,
        version: int = 0,
        admission_window_s: float = 0.002,
        num_threads: int | None = None,
        prefix_cache_tokens: int = 65536,
        stale_kv: StaleKV = "recompute",
        gather_steps: int = 3,
        max_segments: int = MAX_SEGMENTS,
        kv_dtype: str | torch.dtype | None = None,
        fast_decode: bool = True,
        compile_decode: bool = False,
        device: str | torch.device = "cpu",
        compute_dtype: str = "auto",
        share_weights: bool = False,
    ) -> None:
        if stale_kv not in ("recompute", "keep"):
            raise ValueError(f"stale_kv: expects 'recompute' or 'keep', got {stale_kv!r}")
        if max_segments < 1:
            raise ValueError(f"max_segments: expects at least 1, got {max_segments!r}")
        self.placement = Placement.of(model.dtype, device, compute_dtype, share_weights)
        self.share_weights = share_weights
        self.model = _prepare(self.placement.place(model))
        self.limits = RequestLimits.of(model)  # every request is checked against them (`check_request`)
        self.weight_spec = WeightSpec.of(self.model)  # new weights are checked against it before they load
        eos = eos_token_ids if eos_token_ids is not None else model.generation_config.eos_token_id
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.stale_kv = stale_kv
        self.stats = EngineStats()
        self._runner = BatchRunner(
            model,
            self.stats,
            pad_token_id=int(pad if pad is not None else 0),
            max_batch_size=max_batch_size,
            seed=seed,
            prefix_cache_tokens=prefix_cache_tokens,
            max_segments=max_segments,
            kv_dtype=kv_dtype,
            fast_decode=fast_decode,
            compile_decode=compile_decode,
            placement=self.placement,
            recompute_adapters=stale_kv == "recompute",
        )
        if share_weights:  # its own weights until the first push; they must not move either
            self._runner.new_weights(version, shared=True)
        self.kv_dtype = self._runner.kv_dtype  # of the KV cache decode steps attend to
        self._gate = ResumeGate()  # paused: requests wait here to be resubmitted
        self._scheduler = Scheduler(
            self._runner,
            max_batch_size=max_batch_size,
            admission_window_s=admission_window_s,
            gather_steps=gather_steps,
            num_threads=num_threads,
            version=version,
        )

    @classmethod
    def of(cls, model: PreTrainedModel, options: EngineOptions, **placement: Any) -> HFEngine:
        """An engine on ``model`` as ``options`` (the run's ``engine`` section, serve-model's flags) say;
        ``placement``: seed, device, compute_dtype, share_weights."""
        return cls(
            model,
            max_batch_size=options.max_running_requests,
            num_threads=options.cpu_threads or None,
            prefix_cache_tokens=options.prefix_cache_tokens,
            stale_kv=options.stale_kv,
            kv_dtype=options.kv_dtype,
            fast_decode=options.fast_decode,
            compile_decode=options.compile_decode,
            **placement,
        )

    # ---- protocol ---------------------------------------------------------------------------

    def get_version(self) -> int:
        return self._scheduler.version

    def set_version(self, version: int) -> None:
        self._scheduler.version = version

    async def generate_once(self, request: GenRequest, *, checked: bool = False) -> GenResponse:
        """One submission; ends ``abort`` with the tokens so far if `abort` hits it. ``checked``: the caller
        already passed it through `check_request` (a token loop over the prompt, not done twice)."""
        if not checked:  # nothing the model cannot take reaches the decode thread
            request = check_request(request, self.limits, adapters=self._runner.lora.adapters)
        stops = (set() if request.sampling.ignore_eos else self.eos_token_ids) | set(request.sampling.stop_token_ids)
        future = asyncio.get_running_loop().create_future()
        seq = Submission(
            request.rid, list(request.input_ids), request.sampling, stops, future, lora_name=request.lora_name
        )
        self._scheduler.submit(seq)
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            seq.abort = True  # the caller went away: free its row at the next step
            seq.future.add_done_callback(_ignore_outcome)  # nobody waits for it (e.g. "closed" at exit)
            raise

    async def agenerate(self, request: GenRequest) -> GenResponse:
        """Generate to the end (resubmitted after aborts, `generate_to_end`); `RequestError` names a field the
        model cannot take."""
        # max_new_tokens capped at the context left; the parts are checked tokens, fewer to go
        request = check_request(request, self.limits, adapters=self._runner.lora.adapters)
        return await generate_to_end(request, lambda part: self.generate_once(part, checked=True), self._gate)

    async def pause(self) -> None:
        """Stop at the next step boundary; running requests keep their place and continue on `resume`."""
        self._scheduler.set_paused(True)
        self._gate.pause()
        await asyncio.to_thread(self._scheduler.wait_for_boundary)

    async def resume(self) -> None:
        self._scheduler.set_paused(False)
        self._gate.resume()

    async def abort(self, rid: str | None = None) -> int:
        """End queued and running requests (all, or those whose rid is ``rid``) now, as ``abort``."""
        return self._scheduler.abort(rid)

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        """Load new weights at a step boundary and set the version (default: version + 1).

        All or nothing: ``state_dict`` is checked whole first (`check_state_dict`: names, shapes, dtypes,
        finite values); on `EngineError` the weights and the version are as they were.
        With ``share_weights`` the model takes ``state_dict``'s tensors themselves (the trainer's, on this
        device in this dtype, else `EngineError`): the trainer's later optimizer steps write into them, so
        the trainer must not step again until it has pushed the next version; a step the engine would decode
        with weights changed since the last push fails instead (``rollout.max_staleness=0``)."""
        checked = await asyncio.to_thread(check_state_dict, self.weight_spec, state_dict, "update_weights")
        if self.share_weights:
            shared = shareable(checked, self.placement)
            await self._swap_weights(lambda: self.model.load_state_dict(shared, assign=True), version)
        else:
            await self._swap_weights(lambda: copy_into(self.model, checked), version)

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Load the weights of a saved checkpoint (a `save_pretrained` directory: one safetensors file, or
        shards with ``model.safetensors.index.json``) in place. All or nothing: every tensor is read and
        checked before the pause (`read_checkpoint`); on `EngineError` the weights and version are as they were."""
        if self.share_weights:
            raise EngineError(
                "update_weights_from_disk: this engine shares its weights with the trainer (share_weights=True, "
                "engine.weight_sync=in_process); loading a checkpoint into them would overwrite the trainer's: "
                "push the trainer's weights with update_weights instead"
            )
        where = "update_weights_from_disk"
        staged = await asyncio.to_thread(read_checkpoint, self.weight_spec, model_path, where)
        await self._swap_weights(lambda: copy_into(self.model, staged), version)

    # ---- LoRA adapters ------------------------------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> None:
        """Serve the PEFT adapter directory ``path`` (``save_pretrained``) as ``name``, replacing one of that
        name; ``version``: the engine's version from then on (None: unchanged). See `set_lora_adapter`."""
        weights, config = await asyncio.to_thread(read_adapter_dir, path)
        await self.set_lora_adapter(name, weights, config, version)

    async def set_lora_adapter(
        self, name: str, weights: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> None:
        """Serve an adapter given in process: ``weights`` keyed as ``peft.get_peft_model_state_dict`` gives them,
        ``config`` the adapter config (``LoraConfig.to_dict()``, or adapter_config.json's content); the tensors
        are copied. Like `update_weights` for the rows that use it: at a step boundary, with ``stale_kv``
        honoured (``recompute``: running rows are re-prefilled, all of them when any uses this adapter), its
        cached prefixes forgotten. `EngineError` names the adapter and the module that does not fit the model."""
        if not isinstance(name, str) or not name:
            raise EngineError(f"set_lora_adapter: name expects a non-empty string, got {name!r}")
        table = self._runner.lora
        dtype = self.placement.dtype  # the adapters' products run in the compute dtype
        adapter = await asyncio.to_thread(
            LoraAdapter.build, name, weights, config, table.linears, self.placement.device, dtype
        )
        await self._swap_adapter(name, lambda: table.put(adapter), version)

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: its running requests fail, later ones naming it are refused."""
        table = self._runner.lora
        if name not in table:
            loaded = ", ".join(sorted(table.adapters)) or "none"
            raise EngineError(f"unload_lora_adapter: LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        await self._swap_adapter(name, lambda: table.drop(name), None)

    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters served now."""
        return sorted(self._runner.lora.adapters)

    async def aclose(self) -> None:
        self.close()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the decode thread; requests still queued or running fail with `EngineError`. With
        ``timeout_s``, a decode thread stuck in a step is left behind (a daemon) and its requests fail now."""
        self._scheduler.close(timeout_s)
        self._gate.resume()  # requests waiting for a resume go on, to the closed engine's error

    def health(self) -> str | None:
        """None while the engine can serve; else why not (closed, its decode thread failed or is gone, or
        busy for ``stall_s`` without finishing a step): serve-model's /health answers 503 with it."""
        return self._scheduler.health(self.stall_s)

    async def get_stats(self) -> EngineStats:
        """Counters since the start (as `ProcessEngine.get_stats`, which asks its process)."""
        return self.stats

    async def counters(self) -> dict[str, float]:
        """`EngineStats` as floats by name (`InferenceEngine.counters`: the RL recipe's ``engine/...`` metrics)."""
        return self.stats.counters()

    def max_context(self) -> int | None:
        """The model's ``max_position_embeddings`` (None: its config has none); every request is checked against it."""
        return self.limits.context

    def flush_cache(self) -> None:
        """Forget the finished requests' cached prefixes (at the next step; new weights do this themselves)."""
        self._scheduler.flush()

    @property
    def num_running(self) -> int:
        """Requests in the running batch whose caller is still waiting."""
        return self._scheduler.num_running

    @property
    def num_pending(self) -> int:
        """Requests queued or running that will go on (none aborted): what a pause without abort keeps."""
        return self._scheduler.num_pending

    async def _swap_weights(self, load: Callable[[], object], version: int | None) -> None:
        """``load`` checked weights at a step boundary, then the version. ``load`` cannot fail on checked
        weights; if it does anyway (a device error), the weights are part new and part old, so the engine
        closes rather than serve tokens of no version (serve-model's /health then answers 503)."""
        async with update_pause(self._gate, self.pause, self.resume):
            try:
                with torch.no_grad():
                    load()
            except Exception as e:
                self.close()
                raise EngineError(
                    f"HFEngine closed: loading checked weights failed halfway ({type(e).__name__}: {e}), "
                    "so its weights are part new, part old; restart it"
                ) from e
            version = self._scheduler.new_weights(version, recompute=self.stale_kv == "recompute")
            self._runner.new_weights(version, shared=self.share_weights)  # the decode thread waits at a boundary

    async def _swap_adapter(self, name: str, change: Callable[[], None], version: int | None) -> None:
        async with update_pause(self._gate, self.pause, self.resume):
            change()
            self._scheduler.new_adapter(name, version)  # the decode thread waits at a boundary


def _prepare(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` in eval mode without gradients, attending through `segmented_sdpa`."""
    model = model.eval()
    model.requires_grad_(False)
    attention = model.config._attn_implementation  # noqa: SLF001
    if attention == "sdpa":
        model.set_attn_implementation(SEGMENTED_SDPA)  # the same attention, over a segmented KV cache
    elif attention != SEGMENTED_SDPA:
        raise EngineError(
            f"HFEngine decodes with sdpa attention over a segmented KV cache; the model uses {attention!r}: "
            "load it with attn_implementation='sdpa'"
        )
    return model


def _ignore_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: no "exception was never retrieved" at exit
