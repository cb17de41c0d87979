"""A tiny Llama causal LM with a character-level tokenizer and a ChatML chat template, and a GPU-sized
Qwen3-shaped preset over the same tokenizer.

Saved with ``save_pretrained`` and loaded back through ``AutoModelForCausalLM`` / ``AutoTokenizer``,
the same code path as a real checkpoint. Characters are single tokens, so arithmetic is learnable by a
model small enough to train on a laptop CPU. ``preset="qwen3-0.4b"`` is Qwen3-0.6B's decoder (hidden 1024,
28 layers, 16 query and 8 key/value heads of 128, tied embeddings) over this 100-token vocabulary: 0.44B
parameters, the size a single-GPU run trains with no hub download (examples/gpu/).

    save_tiny_model("runs/tiny")            # or: areal-agents tiny-model runs/tiny
    save_tiny_model("runs/q", preset="qwen3-0.4b")   # or: areal-agents tiny-model runs/q --preset qwen3-0.4b
    save_tiny_model("runs/q3", family="qwen3")       # or: areal-agents tiny-model runs/q3 --family qwen3

``family`` swaps the character-level tokenizer for a family's byte-level BPE and real chat template
(models/families.py); the model stays the tiny Llama, sized to that vocabulary.
    model = AutoModelForCausalLM.from_pretrained("runs/tiny")
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from areal_agents.errors import ArealAgentsError, did_you_mean
from areal_agents.models.families import FAMILIES, build_family_tokenizer, stop_token_ids

# Named model shapes (`build_tiny_model` keywords). qwen3-0.4b: Qwen3-0.6B's config.json less its 151,936-token
# embedding (ours has 100 tokens), so the decoder's FLOPs and memory are a real 0.6B's.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "qwen3-0.4b": {
        "arch": "qwen3",
        "hidden_size": 1024,
        "num_layers": 28,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "max_position_embeddings": 4096,
    },
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen models use. The assistant turn ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII plus ChatML special tokens."""
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab["<unk>"] = len(vocab)
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    arch: str = "llama",
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> PreTrainedModel:
    """A randomly initialised causal LM with tied embeddings: Llama (default ~0.8M parameters) or, with
    ``arch="qwen3"``, Qwen3 (per-head q/k norms; ``num_kv_heads`` < ``num_heads`` for grouped-query attention).

    Llama rather than Qwen2 for the tiny one: transformers 5 always loads a ``qwen2`` checkpoint's tokenizer
    as ``Qwen2Tokenizer`` (which drops spaces of a char-level vocab), whatever the tokenizer files say; a
    ``qwen3`` checkpoint keeps the tokenizer its files name (tests/models/test_tiny.py checks both).
    """
    if arch not in ("llama", "qwen3"):
        raise ArealAgentsError(f"arch: expects 'llama' or 'qwen3', got {arch!r}")
    shape = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads or num_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
    }
    torch.manual_seed(seed)
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


FAMILY_CHOICES = ("char", *FAMILIES)  # char: the character-level tokenizer and ChatML above


def save_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    overwrite: bool = False,
    preset: str = "tiny",
    family: str = "char",
    **model_kwargs: Any,
) -> Path:
    """Build the tokenizer and model and ``save_pretrained`` both into ``out_dir``.

    ``preset`` names a shape of `PRESETS` (``tiny``, ``qwen3-0.4b``); ``model_kwargs`` override its values.
    ``family`` is ``char`` or a name of `FAMILIES` (its tokenizer and template; the generation config's
    ``eos_token_id`` lists the family's stop tokens, an int when there is one).
    ``out_dir`` must be new or an empty directory; with ``overwrite=True`` the model's files replace
    those of the same name in it (and a file at that path is removed).

    Raises:
        ArealAgentsError: an unknown ``preset`` or ``family``, or ``out_dir`` is a file or a non-empty directory and
            ``overwrite`` is False.
    """
    if preset not in PRESETS:
        raise ArealAgentsError(
            f"preset: expects one of {', '.join(PRESETS)}, got {preset!r}.{did_you_mean(preset, PRESETS)}"
        )
    if family not in FAMILY_CHOICES:
        raise ArealAgentsError(
            f"family: expects one of {', '.join(FAMILY_CHOICES)}, got {family!r}.{did_you_mean(family, FAMILY_CHOICES)}"
        )
    out = Path(out_dir)
    is_file = out.exists() and not out.is_dir()
    if not overwrite and (is_file or out.is_dir() and any(out.iterdir())):
        what = "is a file" if is_file else "is a directory that is not empty"
        raise ArealAgentsError(
            f"tiny model path {str(out)!r} already exists and {what}: choose a new path or remove it first "
            "(tiny-model --overwrite, or save_tiny_model(..., overwrite=True), writes over it)"
        )
    if is_file:
        out.unlink()
    tokenizer = build_tiny_tokenizer() if family == "char" else build_family_tokenizer(family)
    model = build_tiny_model(
        len(tokenizer),
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **(PRESETS[preset] | model_kwargs),
    )
    stops = stop_token_ids(tokenizer)
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
