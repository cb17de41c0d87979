"""Model families: real chat templates (vendored, see templates/SOURCES.md) over byte-level BPE tokenizers
trained here, with each family's own special tokens, so tests meet the templates and tokens real models use.

    tok = build_family_tokenizer("qwen3")
    tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    family_of(tok).stop_tokens        # ('<|im_end|>', '<|endoftext|>')
    stop_token_ids(tok)               # their ids: what ends a sampled assistant turn

The BPE is trained once per process on the bundled GSM8K text plus the templates and tool-call JSON
(Qwen2's pre-tokenizer regex, then byte-level, 256-byte alphabet: any string encodes and decodes back).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from areal_agents.errors import ArealAgentsError, did_you_mean

TEMPLATES_DIR = Path(__file__).parent / "templates"
GSM8K_TRAIN = Path(__file__).parent.parent / "data" / "builtin" / "gsm8k_train.jsonl"
# Qwen2/Qwen3's pre-tokenizer split (GPT-4-style): contractions, letters, single digits, punctuation runs.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_VOCAB_SIZE = 4096  # 256 bytes + 3,840 merges: a few thousand, as the issue asks; trains in about a second


@dataclass(frozen=True)
class Family:
    """One model family's chat surface: its template and its tokens, as the real tokenizer has them.

    ``special_tokens`` are added with ``special=True`` (``skip_special_tokens`` drops them);
    ``added_tokens`` are single tokens that are not special (kept when decoding, e.g. Qwen's ``<think>``).
    ``stop_tokens`` end a sampled assistant turn (the real generation_config's ``eos_token_id`` list).
    ``add_bos``: the real tokenizer prepends ``bos_token`` when encoding with ``add_special_tokens=True``.
    """

    name: str
    template_file: str
    bos_token: str | None
    eos_token: str
    pad_token: str
    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]
    add_bos: bool = False

    @property
    def chat_template(self) -> str:
        """The vendored template text, unchanged from upstream."""
        return _read_template(self.template_file)


@functools.cache
def _read_template(file: str) -> str:
    return (TEMPLATES_DIR / file).read_text(encoding="utf-8")


_QWEN_SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_QWEN_ADDED = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_DEEPSEEK_TOOL = tuple(
    f"<｜{name}｜>"
    for name in (
        "tool▁calls▁begin",
        "tool▁calls▁end",
        "tool▁call▁begin",
        "tool▁call▁end",
        "tool▁outputs▁begin",
        "tool▁outputs▁end",
        "tool▁output▁begin",
        "tool▁output▁end",
        "tool▁sep",
    )
)
_MISTRAL_CONTROL = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "<pad>",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
)
_HARMONY = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
_GRANITE = (
    "<|end_of_text|>",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
    "<filename>",
    "<reponame>",
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<|tool_call|>",
    "<|start_of_cite|>",
    "<|end_of_cite|>",
    "<|start_of_plugin|>",
    "<|end_of_plugin|>",
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3", "qwen3.jinja", None, "<|im_end|>", "<|endoftext|>", _QWEN_SPECIAL, _QWEN_ADDED,
               ("<|im_end|>", "<|endoftext|>")),
        Family("qwq", "qwq.jinja", None, "<|im_end|>", "<|endoftext|>", _QWEN_SPECIAL, _QWEN_ADDED,
               ("<|im_end|>", "<|endoftext|>")),
        Family("deepseek-r1", "deepseek-r1.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
               "<｜end▁of▁sentence｜>", ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|EOT|>"),
               ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", *_DEEPSEEK_TOOL),
               ("<｜end▁of▁sentence｜>",), add_bos=True),
        Family("mistral", "mistral.jinja", "<s>", "</s>", "<pad>", _MISTRAL_CONTROL, (), ("</s>",), add_bos=True),
        Family("gpt-oss", "gpt-oss.jinja", "<|startoftext|>", "<|return|>", "<|endoftext|>", _HARMONY, (),
               ("<|return|>", "<|call|>", "<|endoftext|>")),
        Family("granite", "granite.jinja", "<|end_of_text|>", "<|end_of_text|>", "<|end_of_text|>", _GRANITE, (),
               ("<|end_of_text|>",)),
    )
}  # fmt: skip


def _tool_call_text() -> list[str]:
    """JSON of OpenAI tool schemas and calls, in each family's shapes, so calls tokenize into few pieces."""
    tools = [
        ("calculator", "expression", "12*(3+4)"),
        ("search", "query", "capital of France"),
        ("python", "code", "print(sum(range(10)))"),
        ("get_weather", "city", "Paris"),
    ]
    out = []
    for name, arg, value in tools:
        params = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
        schema = {"type": "function", "function": {"name": name, "description": f"Run {name}.", "parameters": params}}
        args = json.dumps({arg: value})
        out += [
            json.dumps(schema),
            json.dumps(schema, indent=4),
            f'{{"name": "{name}", "arguments": {args}}}',
            json.dumps([{"name": name, "arguments": {arg: value}, "id": "a1b2c3d4e"}]),
            f"functions.{name} json{args}",
            '{"content": "42", "call_id": "a1b2c3d4e"}',
        ]
    return out * 20


@functools.lru_cache(maxsize=1)
def _bpe_json() -> str:
    """Train the shared byte-level BPE once per process; its JSON, so each caller gets a fresh copy."""
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [r["question"] for r in rows] + [r["solution"] for r in rows]
    texts += [f.chat_template for f in FAMILIES.values()]
    texts += _tool_call_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def build_family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A new byte-level BPE tokenizer with family ``name``'s special tokens, template and bos/eos/pad.

    Raises:
        ArealAgentsError: ``name`` is not one of `FAMILIES`.
    """
    family = get_family(name)
    tok = Tokenizer.from_str(_bpe_json())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added_tokens])
    if family.add_bos and family.bos_token is not None:
        bos = (family.bos_token, tok.token_to_id(family.bos_token))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos_token,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        unk_token="<unk>" if "<unk>" in family.special_tokens else None,
        chat_template=family.chat_template,
        clean_up_tokenization_spaces=False,
    )


def get_family(name: str) -> Family:
    """The `Family` called ``name``; an unknown name raises ArealAgentsError with the choices."""
    if name not in FAMILIES:
        raise ArealAgentsError(
            f"family: expects one of {', '.join(FAMILIES)}, got {name!r}.{did_you_mean(name, FAMILIES)}"
        )
    return FAMILIES[name]


def family_of(tokenizer: PreTrainedTokenizerBase) -> Family | None:
    """The family whose template the tokenizer carries (a real checkpoint's too), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str):
        return None
    for family in FAMILIES.values():
        if family.chat_template.strip() == template.strip():
            return family
    return None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a sampled assistant turn: the family's stop tokens, else ``[eos_token_id]`` (or [])."""
    family = family_of(tokenizer)
    if family is not None:
        ids = [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
        known = [i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id]
        if known:
            return known
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else []
