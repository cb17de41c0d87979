"""Find the final answer in a model completion: the last ``\\boxed{...}``, an "answer is ...", or the last number.

``<think>...</think>`` is stripped first: only text after the last ``</think>`` counts, and a completion
that opened ``<think>`` without closing it has no answer.

    extract_answer("<think>2+2</think> So the answer is $\\boxed{\\frac{1}{2}}$.")   # "\\frac{1}{2}"

Every function here takes time linear in its input and reads only the last `MAX_TEXT_CHARS` characters
of a text (the final answer is at its end), so megabytes of model output or thousands of unbalanced
braces cost milliseconds.
"""

from __future__ import annotations

import re
from typing import Literal

AnswerMode = Literal["auto", "boxed", "answer_is", "last_number"]

MAX_TEXT_CHARS = 100_000  # what extraction (and math verification) reads: the end of a completion

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_BRACE = re.compile(r"(?<!\\)[{}]")  # a brace that is not escaped (\{ and \} are literal braces)
_TOKEN = re.compile(r"[^\s$]+")
_ANSWER_ANCHOR = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)(\s*:?\s*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|\Z)")  # a period followed by whitespace or the end
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def tail(text: str) -> str:
    """The last `MAX_TEXT_CHARS` characters of ``text``: all that answer extraction reads."""
    return text if len(text) <= MAX_TEXT_CHARS else text[-MAX_TEXT_CHARS:]


def strip_thinking(text: str) -> str:
    """The text after the last ``</think>``; '' if a ``<think>`` block never closed."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return ""
    return text


def brace_pairs(text: str, begin: int = 0) -> dict[int, int]:
    """Index of each unescaped ``{`` in ``text[begin:]`` -> index of its closing ``}`` (unclosed: absent).

    One pass with a stack, so it is linear however many braces are left open."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE.finditer(text, begin):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            pairs[stack.pop()] = m.start()
    return pairs


def brace_depth(text: str) -> int:
    """The deepest nesting of unescaped braces in ``text`` (unbalanced closing braces are ignored)."""
    depth = deepest = 0
    for m in _BRACE.finditer(text):
        depth = depth + 1 if m.group() == "{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with nested braces; ``\\boxed 5`` works too.

    A box whose braces never close is skipped for an earlier one."""
    text = tail(text)
    matches = list(_BOXED.finditer(text))
    opens = [m.end() for m in matches if text.startswith("{", m.end())]
    pairs = brace_pairs(text, opens[0]) if opens else {}
    for match in reversed(matches):
        start = match.end()
        if text.startswith("{", start):
            if start in pairs:
                return text[start + 1 : pairs[start]].strip()
            continue  # unbalanced: try an earlier one
        token = _TOKEN.match(text, start)
        if token:
            return token.group(0)
    return None


def answer_is(text: str) -> str | None:
    """What follows the last "answer is" / "answer:", up to the end of its sentence or line.

    A sentence ends at a newline or a period followed by whitespace or the end of the text; an "answer
    is" inside the answer of an earlier one on the same sentence belongs to that answer."""
    text = tail(text)
    found, pos = None, 0
    while m := _ANSWER_ANCHOR.search(text, pos):
        start = m.end()
        if start == len(text):  # nothing follows: as the regex it replaces, take back its last ':' or space
            found = m.group(1).rstrip("\n")[-1:] or found
            break
        newline = text.find("\n", start + 1)
        end = len(text) if newline < 0 else newline
        period = _SENTENCE_END.search(text, start + 1, end)
        if period:
            end = period.start()
        found, pos = text[start:end], end + 1
    if found is None:
        return None
    answer = found.strip().strip("$").strip()
    return answer or None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(tail(text))
    return found[-1].replace(",", "") if found else None


def extract_answer(completion: str, mode: AnswerMode = "auto") -> str | None:
    """The answer in ``completion`` by ``mode``; ``auto`` tries boxed, then "answer is", then the last number."""
    text = tail(strip_thinking(completion))
    if mode == "boxed":
        return last_boxed(text)
    if mode == "answer_is":
        return answer_is(text)
    if mode == "last_number":
        return last_number(text)
    if mode != "auto":
        raise ValueError(f"Expects mode 'auto', 'boxed', 'answer_is' or 'last_number', got {mode!r}")
    return last_boxed(text) or answer_is(text) or last_number(text)
