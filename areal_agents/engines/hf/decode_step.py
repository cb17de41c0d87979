"""`LlamaDecodeStep`: a Llama-family model (Llama, Mistral, Qwen2, Qwen3) run by the engine in few torch ops:
its decode step and its prefill.

On a small model much of a step is per-op and per-module overhead, not arithmetic. This step runs the
model's own weights through fewer ops, as serving engines (SGLang, vLLM) keep model code of their own:
q, k and v in one matrix product (gate and up in another), rotary embedding on q and k at once without a
rotated copy, fused RMSNorm, no module hooks or output records. The prefill runs rows in chunks of about
`PREFILL_CELLS` activations, rows of like length together (chunks of few rows share a pass), so that its
products neither run the batch's padding nor spill out of the cache; a decode step may ride in its last pass
(`decode_and_prefill`: one pass over the weights fewer a step). Figures: `bench/engine_decode.py`,
`bench/engine_vs_vllm.py`, docs/benchmarks.md. Prefills of rows with LoRA adapters, and training, keep
transformers' forward; tests check this step's tokens, logprobs, keys and values against it. Decode rows
served with LoRA adapters (multi_lora.py) get their adapters' deltas on each part of the fused products
(`LoraRows.add`).

The fused weights are copies (attention and MLP weights held twice), made again when any of their
sources changes: the step compares each parameter's identity and in-place version counter every call,
and `refresh` forgets them all (the engine calls it on every weight swap). They are made in the compute
dtype: over float32 weights shared with a trainer (autocast to bfloat16), cast once, not every step.

    step = LlamaDecodeStep.of(model)             # None when the model is not one this step reproduces
    logits = step(input_ids, positions, cache)   # [B] token ids and positions; cache.update -> SegmentedKV
    logits, kv = step.prefill(input_ids, positions, attention, past)   # left-padded rows; each layer's K, V
    logits, first, kv = step.decode_and_prefill(input_ids, positions, cache, prefill)   # both in one pass

The head's logits are float32 (`head_logits`), as the trainer's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from areal_agents.engines.hf.multi_lora import LoraRows
from areal_agents.engines.hf.segmented_attention import attend_segments
from areal_agents.models.fp32_head import float32_logits

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # the same decoder layer; qwen3 adds per-head q/k norms
# A prefill's products run about this many activations (tokens x hidden) at once, and at least PREFILL_TOKENS
# tokens: operands that stay in cache (on 2 cores, 1,024-row fp32 products at hidden 512 ran ~1.3x the FLOP/s
# of 7,000-row ones), few enough chunks that a small model's per-op cost stays small
PREFILL_CELLS = 1 << 19
PREFILL_TOKENS = 1024
LIKE_LENGTH = 0.8  # a prefill chunk's rows are at least this share of its longest (its padding at most the rest)
PREFILL_TOKENS_GPU = 8192  # a chunk's tokens on a GPU (vLLM's chunked prefill runs 2,048-8,192 a step)
Attend = Callable[[int, torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaDecodeStep:
    """The decode step of one model; `of` says whether it can be built."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype | None = None) -> None:
        config = model.config
        self.model = model
        self.dtype = dtype  # of the fused weights (None: the model's)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_v = self.q_size + self.kv_size  # the first column of v in the fused q/k/v product
        self.qk_norm = config.model_type == "qwen3"
        self.refresh()

    def refresh(self) -> None:
        """Forget the fused weights: they are made again from the model's at the next call."""
        self._fused: list[tuple[tuple, _Fused | None]] = [((), None)] * len(self.model.model.layers)

    @classmethod
    def of(cls, model: PreTrainedModel, dtype: torch.dtype | None = None) -> LlamaDecodeStep | None:
        """The step for ``model`` (fused weights in ``dtype``, default the model's), or None when it is not a
        Llama-family decoder of the stock layout."""
        config = model.config
        body = getattr(model, "model", None)
        if config.model_type not in LLAMA_FAMILY or body is None or not hasattr(body, "rotary_emb"):
            return None
        if getattr(config, "pretraining_tp", 1) != 1 or not all(_stock_layer(layer) for layer in body.layers):
            return None
        return cls(model, dtype)

    def __call__(  # noqa: ANN001
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache, lora: LoraRows | None = None
    ) -> torch.Tensor:
        """Next-token logits ``[B, V]`` of one token a row; ``cache.update(k, v, layer)`` stores this
        step's keys and values ``[B, kv_heads, 1, D]`` and returns every segment's (`SegmentedKV`). ``lora``:
        the rows' LoRA adapters, whose deltas are added to each part of the fused products."""
        return self.logits(input_ids, positions, self.decode_attention(cache), lora)

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        lora: LoraRows | None = None,
        weights: list[tuple] | None = None,
    ) -> torch.Tensor:
        """Next-token logits ``[T, V]`` of tokens ``input_ids [T]`` through the layers (`layers`) and the head."""
        hidden = self.layers(input_ids, positions, attend, lora, weights)
        return head_logits(self.model, _rms_norm(hidden, self.model.model.norm), lora)

    def fused_weights(self) -> list[tuple]:
        """Every layer's fused weights as `layers` takes them (made again where a source changed)."""
        return [self._weights(i, layer).parts() for i, layer in enumerate(self.model.model.layers)]

    def decode_and_prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,  # noqa: ANN001
        prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list | None, int],
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A decode step (as `__call__`, without LoRA) run in a prefill's last pass over the weights
        (``prefill``: `prefill`'s arguments): the decode rows' logits, the prefilled rows' and their keys and
        values."""
        ids, at, attention, past, spare = prefill
        logits, kv, decoded = self._prefill(ids, at, attention, past, spare, (input_ids, positions, cache))
        return decoded, logits, kv

    def chunk_tokens(self, device: torch.device) -> int:
        """Tokens (padding included) a prefill chunk runs at once on ``device``."""
        if device.type != "cpu":  # a GPU's products want many rows; cache residency is a CPU matter
            return PREFILL_TOKENS_GPU
        return max(PREFILL_TOKENS, PREFILL_CELLS // self.model.config.hidden_size)

    def decode_attention(self, cache) -> Attend:  # noqa: ANN001
        """A decode step's attention: each row's one token stored in ``cache``, attending to its segment's."""

        def attend(index: int, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            keys, values = cache.update(k[:, :, None], v[:, :, None], index)
            return attend_segments(q[:, :, None], keys, values, attn.scaling).reshape(len(q), self.q_size)

        return attend

    def prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        spare: int = 0,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Left-padded rows ``input_ids [n, w]`` (at ``positions [n, w]``; ``attention [n, p + w]``, 1 = a real
        token, the first ``p`` columns those of ``past``: each layer's cached keys and values, ``p`` columns
        wide, or ``p + w + spare`` and then written in place) through the model: each row's next-token logits
        ``[n, V]`` and every layer's keys and values ``[n, kv_heads, p + w + spare, D]`` (the last ``spare``
        columns zeros, room for the decode steps). Rows run in chunks of about `PREFILL_CELLS` activations,
        rows of like length together, each chunk as wide as its longest row (a row longer than that alone, a
        span of its columns at a time), so the products neither run the batch's padding nor spill out of the
        cache; rows given longest first make each chunk's rows a slice of the buffers (no copies)."""
        logits, kv, _ = self._prefill(input_ids, positions, attention, past, spare)
        return logits, kv

    def _prefill(  # noqa: PLR0913
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        spare: int,
        decode: tuple | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """`prefill`, its chunks run in passes of up to `chunk_tokens` tokens (`_passes`); ``decode``: a decode
        step's tokens, positions and cache, run in the last pass. Its logits come third (None without)."""
        width, device = input_ids.shape[1], input_ids.device
        lengths = attention[:, attention.shape[1] - width :].sum(1).tolist()
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # every layer's keys and values, filled chunk by chunk
        rows, last, decoded = [], [], []
        budget = self.chunk_tokens(device)
        passes = _passes(_prefill_chunks(lengths, width, budget, device), budget)
        for p, chunks in enumerate(passes):
            parts, ids, at = [], [], []
            if decode is not None and p == len(passes) - 1:
                decode_ids, decode_positions, cache = decode
                parts.append((len(decode_ids), self.decode_attention(cache)))
                ids.append(decode_ids)
                at.append(decode_positions)
            for idx, (c0, c1) in chunks:
                first = width - max(lengths[i] for i in idx.tolist())  # the chunk's first real column
                chunk = _ChunkAttention(self, attention, (width, first, (c0, c1)), idx, kv, (past, spare))
                parts.append((len(idx) * (c1 - c0), chunk))
                ids.append(input_ids[idx, c0:c1].flatten())
                at.append(positions[idx, c0:c1].flatten())
            hidden = self.layers(torch.cat(ids), torch.cat(at), _attention_in_parts(parts)).split([s for s, _ in parts])
            if len(parts) > len(chunks):  # the decode rows' come first
                decoded, hidden = [hidden[0]], hidden[1:]
            for (idx, (c0, c1)), h in zip(chunks, hidden):
                if c1 == width:  # the rows' last tokens
                    rows.append(idx)
                    last.append(h.view(len(idx), c1 - c0, -1)[:, -1])
        final = torch.cat([*decoded, torch.cat(last)[torch.cat(rows).argsort()]])
        logits = head_logits(self.model, _rms_norm(final, self.model.model.norm))
        b = len(decoded[0]) if decoded else 0
        return logits[b:], kv, logits[:b] if decoded else None

    def layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        lora: LoraRows | None = None,
        weights: list[tuple] | None = None,
    ) -> torch.Tensor:
        """The decoder layers over tokens ``input_ids [T]`` at ``positions [T]``: the last hidden states ``[T,
        hidden]`` before the final norm. ``attend(layer, attn, q [T, heads, D], k, v [T, kv_heads, D])`` stores
        the keys and values and returns the attention's output ``[T, heads * D]``. ``weights``: `fused_weights`
        made beforehand (a compiled graph takes them as inputs), default made here."""
        body = self.model.model
        t, heads, d = input_ids.shape[0], self.heads, self.head_dim
        hidden = body.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = body.rotary_emb(hidden, positions[:, None])  # [T, 1, D], against [T, heads, D]
        for index, layer in enumerate(body.layers):
            attn = layer.self_attn
            qkv_weight, qkv_bias, gate_up_weight, gate_up_bias = (
                weights[index] if weights is not None else self._weights(index, layer).parts()
            )
            x = _rms_norm(hidden, layer.input_layernorm)
            qkv = F.linear(x, qkv_weight, qkv_bias)
            if lora is not None:
                lora.add_parts(qkv, x, ((attn.q_proj, 0), (attn.k_proj, self.q_size), (attn.v_proj, self.qkv_v)))
            qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + self.kv_heads, d)
            if self.qk_norm:
                qk = torch.cat([_rms_norm(qk[:, :heads], attn.q_norm), _rms_norm(qk[:, heads:], attn.k_norm)], 1)
            qk = _rotary(qk, cos, sin)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.kv_heads, d)
            out = attend(index, attn, qk[:, :heads], qk[:, heads:], v)
            o = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            hidden = hidden + (o if lora is None else lora.add(o, out, attn.o_proj))
            mlp = layer.mlp
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gate_up = F.linear(x, gate_up_weight, gate_up_bias)
            if lora is not None:
                lora.add_parts(gate_up, x, ((mlp.gate_proj, 0), (mlp.up_proj, mlp.gate_proj.out_features)))
            gate, up = gate_up.chunk(2, -1)
            act = mlp.act_fn(gate) * up
            down = F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)
            hidden = hidden + (down if lora is None else lora.add(down, act, mlp.down_proj))
        return hidden

    def _weights(self, index: int, layer: torch.nn.Module) -> _Fused:
        """The layer's fused weights, made again if a source parameter was replaced or changed in place."""
        attn, mlp = layer.self_attn, layer.mlp
        sources = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        params = [p for module in sources for p in (module.weight, module.bias) if p is not None]
        key = tuple((id(p), p.data_ptr(), p._version) for p in params)
        seen, fused = self._fused[index]
        if key != seen:
            fused = _Fused.of(attn, mlp, self.dtype)
            self._fused[index] = (key, fused)
        return fused


def head_logits(model: PreTrainedModel, hidden: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
    """Next-token logits ``[B, V]`` of the last hidden states ``[B, H]``, in float32 (`float32_logits`), plus
    the rows' LoRA deltas of the head when an adapter targets it (its module hook does not run here)."""
    head = model.get_output_embeddings()
    logits = float32_logits(hidden, head)
    return logits if lora is None else lora.add(logits, hidden, head)


class _ChunkAttention:
    """`LlamaDecodeStep.prefill`'s attention for one chunk: rows ``idx``, new columns ``span`` (of ``width``, the
    chunk's first real one ``first``). Its tokens write their keys and values into each layer's buffers (``kv``,
    made at the first chunk: ``past`` first, ``spare`` zero columns last) and attend through them to their row's
    real columns up to their own: the cached ones, and the new ones from ``first`` on (a long row's later spans
    read its earlier ones). A padding token attends to itself alone: sdpa kernels differ on a row with nothing
    to attend to (some give NaN), and its keys and values sit in masked columns, where a NaN would still
    poison the sum."""

    def __init__(
        self,
        step: LlamaDecodeStep,
        attention: torch.Tensor,
        columns: tuple[int, int, tuple[int, int]],
        idx: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        past: tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int],
    ) -> None:
        width, first, span = columns
        self.step, self.kv, (self.past, self.spare) = step, kv, past
        self.n, self.columns = attention.shape
        context = self.columns - width  # cached columns before the new ones
        self.start, self.end = context + span[0], context + span[1]  # the chunk's columns
        self.lo = 0 if context else first  # the keys read: [lo, end); before lo, columns no row of the chunk has
        rows = idx.tolist()
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        self.rows = slice(rows[0], rows[0] + len(rows)) if consecutive else idx  # a slice reads views, not copies
        device = idx.device
        queries = torch.arange(self.start, self.end, device=device)[:, None]
        keys = torch.arange(self.lo, self.end, device=device)
        allowed = (attention[self.rows][:, None, self.lo : self.end].bool() & (keys <= queries)) | (keys == queries)
        self.allowed = allowed[:, None]  # [rows, 1, chunk columns, key columns]

    def __call__(self, index: int, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        step, width = self.step, self.end - self.start
        rows = self.allowed.shape[0]
        if len(self.kv) <= index:
            past = self.past[index] if self.past else None
            self.kv.append(_prefill_buffers(self.n, self.columns + self.spare, (k, v), past))
        new = [x.view(rows, width, x.shape[1], step.head_dim).transpose(1, 2) for x in (k, v)]
        for buffer, x in zip(self.kv[index], new):
            buffer[self.rows, :, self.start : self.end] = x.to(buffer.dtype)
        keys, values = (buffer[self.rows, :, self.lo : self.end] for buffer in self.kv[index])
        out = F.scaled_dot_product_attention(
            q.view(rows, width, step.heads, step.head_dim).transpose(1, 2),
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=self.allowed,
            scale=attn.scaling,
            enable_gqa=step.heads != step.kv_heads,
        )
        return out.transpose(1, 2).reshape(rows * width, step.q_size)


def _prefill_chunks(
    lengths: list[int], width: int, budget: int, device: torch.device
) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """`LlamaDecodeStep.prefill`'s chunks: (rows, new columns) of at most ``budget`` tokens, padding included.
    Rows go longest first, each chunk as wide as its first row, its rows at least `LIKE_LENGTH` of that (its
    padding at most the rest); a row longer than ``budget`` runs alone, a span of ``budget`` columns at a
    time (a column's keys are written before the columns after it attend)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks, i = [], 0
    while i < len(order):
        longest = lengths[order[i]]
        if longest > budget:
            row = torch.tensor([order[i]], device=device)
            chunks += [(row, (c, min(c + budget, width))) for c in range(width - longest, width, budget)]
            i += 1
            continue
        take, rows = 1, min(len(order) - i, budget // longest)
        while take < rows and lengths[order[i + take]] >= LIKE_LENGTH * longest:
            take += 1
        chunks.append((torch.tensor(order[i : i + take], device=device), (width - longest, width)))
        i += take
    return chunks


def _passes(
    chunks: list[tuple[torch.Tensor, tuple[int, int]]], budget: int
) -> list[list[tuple[torch.Tensor, tuple[int, int]]]]:
    """Consecutive chunks grouped into runs of the layers of at most ``budget`` tokens together: like-length
    chunks of few rows share their products, as one chunk of them padded to the longest would."""
    passes: list[list] = []
    tokens = budget
    for chunk in chunks:
        size = len(chunk[0]) * (chunk[1][1] - chunk[1][0])
        if tokens + size > budget:
            passes.append([])
            tokens = 0
        passes[-1].append(chunk)
        tokens += size
    return passes


def _attention_in_parts(parts: list[tuple[int, Attend]]) -> Attend:
    """One attention over consecutive token ranges, each of ``parts`` (size, its attention): a decode step's
    rows and prefill chunks in one run of the layers."""
    if len(parts) == 1:
        return parts[0][1]

    def attend(index: int, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        outs, start = [], 0
        for size, part in parts:
            outs.append(part(index, attn, q[start : start + size], k[start : start + size], v[start : start + size]))
            start += size
        return torch.cat(outs)

    return attend


def _prefill_buffers(
    rows: int, columns: int, kv: tuple[torch.Tensor, torch.Tensor], past: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values ``[rows, kv_heads, columns, D]``, each in the dtype of the first chunk's (under
    autocast the keys come out of the rotary embedding in float32): zeros (columns no token writes must hold
    finite numbers), the cached ``past`` columns first; ``past`` itself when it is that wide already."""
    if past is not None and past[0].shape[2] == columns and all(p.dtype == x.dtype for p, x in zip(past, kv)):
        return past  # the cached columns, then zeros for the new ones (`PrefixCache.gather`'s room)
    buffers = tuple(x.new_zeros(rows, x.shape[1], columns, x.shape[2]) for x in kv)
    if past is not None:
        for buffer, cached in zip(buffers, past):
            buffer[:, :, : cached.shape[2]] = cached
    return buffers


def _stock_layer(layer: torch.nn.Module) -> bool:
    """The decoder layer has the modules this step reads (remote code under a stock model_type may not)."""
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "input_layernorm", "post_attention_layernorm")  # fmt: skip
    modules = dict(layer.named_modules())
    return all(name in modules for name in names) and hasattr(layer.self_attn, "scaling")


@dataclass(frozen=True)
class _Fused:
    """A layer's q/k/v weights stacked into one matrix, and gate/up into another (biases alike)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        return self.qkv, self.qkv_bias, self.gate_up, self.gate_up_bias

    @classmethod
    def of(cls, attn: torch.nn.Module, mlp: torch.nn.Module, dtype: torch.dtype | None = None) -> _Fused:
        with torch.no_grad():
            qkv, gate_up = _stack(attn.q_proj, attn.k_proj, attn.v_proj), _stack(mlp.gate_proj, mlp.up_proj)
            if dtype is not None:
                qkv, gate_up = ([t if t is None else t.to(dtype) for t in pair] for pair in (qkv, gate_up))
            return cls(*qkv, *gate_up)


def _stack(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return weight, None
    return weight, torch.cat(
        [bias if bias is not None else weight.new_zeros(linear.out_features) for bias, linear in zip(biases, linears)]
    )


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding, ``x * cos + rotate_half(x) * sin``, without the rotated copy (its
    negation and concatenation cost ~5x the rest on CPU)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """transformers' RMSNorm (normalised in float32, cast back, then scaled) as one fused op."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)
