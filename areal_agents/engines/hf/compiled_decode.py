"""`CompiledDecode`: `LlamaDecodeStep`'s decode step as one `torch.compile` graph (``engine.compile_decode``).

A decode step on CPU is many small ops and Python between them; compiled whole, inductor fuses the norms,
rotary embedding, activation and adds, and the step runs without the interpreter (`bench/decode_compile.py`).
The graph must hold the whole step: compiled with the attention outside it, the layers in between ran no
faster than eager. So the attention is an opaque custom op (``areal_agents::decode_attention``, as vLLM's
``unified_attention``) that calls the step's own attention over the KV segments, which change every step.
Shapes are static, rows padded up to a bucket (powers of two from 8): one graph a bucket, all compiled by
`compile_buckets` before the engine's first step (seconds each; requests wait), as vLLM compiles its sizes at
start, so that no step stalls on a compile later. It runs on the decode thread: inductor's CPU kernels take
the OpenMP team size of the thread that compiles them. Steps with LoRA rows run eager.

    step = CompiledDecode(LlamaDecodeStep.of(model), max_rows=256)
    step.compile_buckets(device)                     # once, on the decode thread, under the engine's precision
    logits = step(input_ids, positions, cache)      # as LlamaDecodeStep.__call__
"""

from __future__ import annotations

import logging
import threading

import torch
import torch._dynamo  # its exceptions, caught below

from areal_agents.engines.hf.decode_step import LlamaDecodeStep
from areal_agents.engines.hf.multi_lora import LoraRows

log = logging.getLogger(__name__)

SMALLEST_BUCKET = 8
# graphs of one code object (`_logits`) dynamo keeps: a bucket's for every engine in the process (its default, 8,
# is less than two engines' buckets; past it a fullgraph compile raises)
GRAPHS_PER_PROCESS = 1024
_running = threading.local()  # the attention of the step whose graph runs on this thread, and its real rows


@torch.library.custom_op("areal_agents::decode_attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The running step's attention of layer ``layer`` for its real rows (the first ones; padding rows get
    zeros): its keys and values stored in the step's cache, opaque to the compiler."""
    attend, attention, rows = _running.step
    out = attend(layer, attention[layer], q[:rows], k[:rows], v[:rows])
    if rows == len(q):
        return out
    return torch.cat([out, out.new_zeros(len(q) - rows, out.shape[1])])


@attention_op.register_fake
def _decode_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _graph_attention(index: int, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return torch.ops.areal_agents.decode_attention(q, k, v, index)


class CompiledDecode:
    """`LlamaDecodeStep.__call__` run as a compiled graph of its decode step (prefills stay eager)."""

    def __init__(self, step: LlamaDecodeStep, max_rows: int) -> None:
        self.step = step
        self.buckets = _buckets(max_rows)
        self.attention = [layer.self_attn for layer in step.model.model.layers]
        self._graph = torch.compile(self._logits, dynamic=False, fullgraph=True)
        self._broken: BaseException | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, lora: LoraRows | None = None):  # noqa: ANN001
        if lora is not None or self._broken is not None:
            return self.step(input_ids, positions, cache, lora)
        rows = len(input_ids)
        size = next(b for b in self.buckets if b >= rows)
        ids, at = (torch.nn.functional.pad(x, (0, size - rows)) for x in (input_ids, positions))
        logits = self._run(ids, at, self.step.decode_attention(cache), rows)
        return self.step(input_ids, positions, cache) if logits is None else logits[:rows]

    def compile_buckets(self, device: torch.device) -> None:
        """Compile every bucket's graph, running it once over zero tokens with no attention."""
        size = self.step.q_size
        for bucket in self.buckets:
            # two tensors: the graph is specialised on its inputs' aliasing (the same one twice compiles another)
            ids, positions = (torch.zeros(bucket, dtype=torch.long, device=device) for _ in range(2))
            if self._run(ids, positions, lambda i, a, q, k, v: q.new_zeros(len(q), size), bucket) is None:
                return

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, attend, rows: int) -> torch.Tensor | None:  # noqa: ANN001
        """The graph's logits for padded ``ids``, ``attend`` serving its first ``rows``; None (and eager from
        now on) when it did not compile: raised while compiling, before the graph runs."""
        _running.step = (attend, self.attention, rows)
        try:
            with torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_PROCESS):
                return self._graph(ids, positions, self.step.fused_weights())
        except torch._dynamo.exc.TorchDynamoException as e:
            self._broken = e
            log.warning("engine.compile_decode: the decode step did not compile (%s); it runs eager", e)
            return None
        finally:
            _running.step = None

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, weights: list[tuple]) -> torch.Tensor:
        return self.step.logits(input_ids, positions, _graph_attention, weights=weights)


def _buckets(max_rows: int) -> list[int]:
    """Row counts a graph is compiled for: powers of two from `SMALLEST_BUCKET` up to ``max_rows``'s."""
    buckets = [SMALLEST_BUCKET]
    while buckets[-1] < max_rows:
        buckets.append(buckets[-1] * 2)
    return buckets
