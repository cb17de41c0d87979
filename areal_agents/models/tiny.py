"""A tiny Llama causal LM with a character-level tokenizer and a ChatML chat template.

Saved with ``save_pretrained`` and loaded back through ``AutoModelForCausalLM`` / ``AutoTokenizer``,
the same code path as a real checkpoint. Characters are single tokens, so arithmetic is learnable by a
model small enough to train on a laptop CPU.

    save_tiny_model("runs/tiny")            # or: areal-agents tiny-model runs/tiny
    model = AutoModelForCausalLM.from_pretrained("runs/tiny")
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from areal_agents.errors import ArealAgentsError

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
) -> LlamaForCausalLM:
    """A randomly initialised Llama causal LM (default ~0.8M parameters, tied embeddings).

    Llama rather than Qwen2: transformers 5 always loads a ``qwen2`` checkpoint's tokenizer as
    ``Qwen2Tokenizer`` (which drops spaces of a char-level vocab), whatever the tokenizer files say.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_tiny_model(out_dir: str | Path, seed: int = 0, overwrite: bool = False, **model_kwargs: int) -> Path:
    """Build the tokenizer and model and ``save_pretrained`` both into ``out_dir``.

    ``out_dir`` must be new or an empty directory; with ``overwrite=True`` the model's files replace
    those of the same name in it (and a file at that path is removed).

    Raises:
        ArealAgentsError: ``out_dir`` is a file or a non-empty directory and ``overwrite`` is False.
    """
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
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(
        len(tokenizer),
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **model_kwargs,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
