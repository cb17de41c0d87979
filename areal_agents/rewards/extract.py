"""Find the final answer in a model completion: the last ``\\boxed{...}``, an "answer is ...", or the last number.

``<think>...</think>`` is stripped first: only text after the last ``</think>`` counts, and a completion
that opened ``<think>`` without closing it has no answer.

    extract_answer("<think>2+2</think> So the answer is $\\boxed{\\frac{1}{2}}$.")   # "\\frac{1}{2}"
"""

from __future__ import annotations

import re
from typing import Literal

AnswerMode = Literal["auto", "boxed", "answer_is", "last_number"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+?)\s*(?:\.?\s*$|\n|(?<=[^\d])\.(?:\s|$)|\.\s)", re.IGNORECASE
)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def strip_thinking(text: str) -> str:
    """The text after the last ``</think>``; '' if a ``<think>`` block never closed."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return ""
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with nested braces; ``\\boxed 5`` works too."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                ch = text[i]
                if ch == "\\":  # skip escaped characters such as \{ and \}
                    continue
                if ch == "{" and (i == 0 or text[i - 1] != "\\"):
                    depth += 1
                elif ch == "}" and text[i - 1] != "\\":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i].strip()
            continue  # unbalanced: try an earlier one
        token = re.match(r"[^\s$]+", text[start:])
        if token:
            return token.group(0)
    return None


def answer_is(text: str) -> str | None:
    """What follows the last "answer is" / "answer:", up to the end of its sentence or line."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    found = matches[-1]
    answer = found.group(1).strip().strip("$").strip()
    return answer or None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(completion: str, mode: AnswerMode = "auto") -> str | None:
    """The answer in ``completion`` by ``mode``; ``auto`` tries boxed, then "answer is", then the last number."""
    text = strip_thinking(completion)
    if mode == "boxed":
        return last_boxed(text)
    if mode == "answer_is":
        return answer_is(text)
    if mode == "last_number":
        return last_number(text)
    if mode != "auto":
        raise ValueError(f"Expects mode 'auto', 'boxed', 'answer_is' or 'last_number', got {mode!r}")
    return last_boxed(text) or answer_is(text) or last_number(text)
