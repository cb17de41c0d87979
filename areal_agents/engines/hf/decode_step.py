"""`LlamaDecodeStep`: one decode step of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) in few torch ops.

On a small model much of a decode step is per-op and per-module overhead, not arithmetic. This step runs
the model's own weights through fewer ops, as serving engines (SGLang, vLLM) keep model code of their own
for decoding: q, k and v in one matrix product (gate and up in another), rotary embedding on q and k at
once, fused RMSNorm, no module hooks or output records. It saves a fixed cost a step, so it pays most on
small batches, less where one-token attention, bound by reading the KV cache from memory, is most of the
step (figures: `bench/engine_decode.py`, docs/benchmarks.md). Prefill and training keep
transformers' forward; tests check this step's tokens and logprobs against it. Rows served with LoRA
adapters (multi_lora.py) get their adapters' deltas on each part of the fused products (`LoraRows.add`).

The fused weights are copies (attention and MLP weights held twice), made again when any of their
sources changes: the step compares each parameter's identity and in-place version counter every call,
and `refresh` forgets them all (the engine calls it on every weight swap). They are made in the compute
dtype: over float32 weights shared with a trainer (autocast to bfloat16), cast once, not every step.

    step = LlamaDecodeStep.of(model)             # None when the model is not one this step reproduces
    logits = step(input_ids, positions, cache)   # [B] token ids and positions; cache.update -> SegmentedKV

The head's logits are float32 (`head_logits`), as the prefill's and the trainer's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

from areal_agents.engines.hf.multi_lora import LoraRows
from areal_agents.engines.hf.segmented_attention import attend_segments
from areal_agents.models.fp32_head import float32_logits

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # the same decoder layer; qwen3 adds per-head q/k norms


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
        body = self.model.model
        b, heads, d = input_ids.shape[0], self.heads, self.head_dim
        hidden = body.embed_tokens(input_ids)  # [B, hidden]
        cos, sin = body.rotary_emb(hidden, positions[:, None])  # [B, 1, D]
        cos, sin = cos[:, :, None], sin[:, :, None]  # against [B, 1, heads, D]
        for index, layer in enumerate(body.layers):
            attn, fused = layer.self_attn, self._weights(index, layer)
            x = _rms_norm(hidden, layer.input_layernorm)
            qkv = F.linear(x, fused.qkv, fused.qkv_bias)
            if lora is not None:
                lora.add_parts(qkv, x, ((attn.q_proj, 0), (attn.k_proj, self.q_size), (attn.v_proj, self.qkv_v)))
            qk = qkv[:, : self.q_size + self.kv_size].view(b, 1, heads + self.kv_heads, d)
            if self.qk_norm:
                qk = torch.cat([_rms_norm(qk[:, :, :heads], attn.q_norm), _rms_norm(qk[:, :, heads:], attn.k_norm)], 2)
            qk = (qk * cos + rotate_half(qk) * sin).transpose(1, 2)  # [B, heads + kv_heads, 1, D]
            v = qkv[:, self.q_size + self.kv_size :].view(b, self.kv_heads, 1, d)
            keys, values = cache.update(qk[:, heads:], v, index)
            out = attend_segments(qk[:, :heads], keys, values, attn.scaling)  # [B, heads, 1, D]
            out = out.reshape(b, self.q_size)
            o = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            hidden = hidden + (o if lora is None else lora.add(o, out, attn.o_proj))
            mlp = layer.mlp
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gate_up = F.linear(x, fused.gate_up, fused.gate_up_bias)
            if lora is not None:
                lora.add_parts(gate_up, x, ((mlp.gate_proj, 0), (mlp.up_proj, mlp.gate_proj.out_features)))
            gate, up = gate_up.chunk(2, -1)
            act = mlp.act_fn(gate) * up
            down = F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)
            hidden = hidden + (down if lora is None else lora.add(down, act, mlp.down_proj))
        return head_logits(self.model, _rms_norm(hidden, body.norm), lora)

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


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """transformers' RMSNorm (normalised in float32, cast back, then scaled) as one fused op."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)
