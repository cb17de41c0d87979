"""Math answer verification: a fast exact path for plain numbers, math-verify for everything else.

    verify_math("... so the answer is $\\boxed{\\frac{1}{2}}$", "0.5")      # True

Plain integers, decimals and fractions (most AIME / MATH answers) are settled with `fractions.Fraction`
without sympy. Anything else goes to math-verify (LaTeX and expression extraction, sympy equivalence of
sets, intervals, matrices, equations, units in text, percentages). Parsed gold answers are cached.

Bounded on any input, from any thread: model output can be a tower of powers or a factorial of 10^10,
whose sympy evaluation runs for hours inside C code that no signal interrupts (math-verify's own
signal-based timeouts are off: they only work in the main thread). So the math-verify step runs in a
process-wide pool of worker processes (`verification_pool`, started on first use) with a hard
``timeout_s`` and an address-space limit; a call past it gets ``correct=False`` with method "timeout" and
a reason, and its worker is replaced. Inside a daemon process (a `WorkerPool` worker, such as a
`RewardService`'s, which may not start processes of its own) it runs in place, bounded by the timeout of
the pool that runs it. Before any of that, only the last `MAX_TEXT_CHARS` characters are read, and a text
with braces nested deeper than `MAX_BRACE_DEPTH` or a gold answer longer than `MAX_GOLD_CHARS` is
refused at once (method "refused"). The pool's workers never import the caller's ``__main__``, so a script
without a main guard, ``python -`` and a notebook score alike; a worker that cannot start raises
`WorkerStartError` (never a wrong score), and a call whose worker died is tried once more in a new one.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from areal_agents.rewards.extract import brace_depth, extract_answer, last_boxed, strip_thinking, tail
from areal_agents.workers import CallTimeout, RemoteError, WorkerDied, WorkerPool, may_start_processes, shared_pool


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once that its (signal-based) timeouts are off; ours are enforced by worker processes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


@dataclass(frozen=True)
class MathVerifyConfig:
    """How completions and gold answers are compared (math-verify's knobs)."""

    targets: tuple[str, ...] = ("latex", "expr")  # extractors for the answer: LaTeX and/or plain expressions
    float_rounding: int = 6  # decimal places numbers are rounded to before comparing
    strict: bool = True  # False: variables and function names may differ (f(x) ~ f(y))
    allow_set_relation_comp: bool = False  # True: "x in [a, b]" ~ "a <= x <= b"
    boxed_match_priority: int = 0  # 0: a \boxed{} answer wins over other matches
    fast_path: bool = True
    # If math-verify finds no equal answer, also try the extracted answer and the last line as LaTeX
    # ("the answer is \frac{\pi}{2}." without $ delimiters). Off = math-verify's exact semantics.
    fallback_extraction: bool = True
    timeout_s: float = 5.0  # wall-clock limit of the math-verify step (parse and compare), in a worker process

    def __post_init__(self) -> None:
        for target in self.targets:
            if target not in ("latex", "expr"):
                raise ValueError(f"Expects targets among 'latex', 'expr', got {target!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"Expects timeout_s > 0, got {self.timeout_s!r}")


DEFAULT = MathVerifyConfig()
MAX_BRACE_DEPTH = 64  # no answer nests braces deeper; sympy's recursive parsing of 500 levels takes seconds
MAX_GOLD_CHARS = 10_000
MAX_NUMBER_CHARS = 1_000  # longer digit strings skip the fast path (int() of a huge string is quadratic)
VERIFY_WORKERS = 2  # processes of the verification pool
VERIFY_MEMORY_MB = 2048  # address-space limit of each (a worker with sympy loaded uses about 200 MB)

_INT = re.compile(r"[-+]?\d+")
_DECIMAL = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+)")
_SLASH = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_TEX_FRAC = re.compile(r"([-+]?)\\[dt]?frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")


def _plain_number(text: str | None) -> tuple[Fraction, bool] | None:
    """(value, is_integer_literal) for a bare integer, decimal or fraction; None for anything else."""
    if text is None:
        return None
    if len(text) > MAX_NUMBER_CHARS:
        return None
    s = text.strip().strip("$").strip().rstrip(".").replace("\\!", "")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+", s):
        s = s.replace(",", "")
    try:
        if _INT.fullmatch(s):
            return Fraction(int(s)), True
        if _DECIMAL.fullmatch(s):
            return Fraction(s), False
        if m := _SLASH.fullmatch(s):
            return (Fraction(int(m.group(1)), int(m.group(2))), False) if int(m.group(2)) else None
        if m := _TEX_FRAC.fullmatch(s):
            value = Fraction(int(m.group(2)), int(m.group(3))) if int(m.group(3)) else None
            return (-value if m.group(1) == "-" else value, False) if value is not None else None
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _extraction_config(config: MathVerifyConfig) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    out: list[Any] = []
    for target in config.targets:  # validated by MathVerifyConfig
        if target == "latex":
            out.append(LatexExtractionConfig(boxed_match_priority=config.boxed_match_priority))
        else:
            out.append(ExprExtractionConfig())
    return out


def _gold_text(gold: str, config: MathVerifyConfig) -> str:
    """Gold answers are written bare in datasets ("\\frac{1}{2}"); parse them as LaTeX inside \\boxed{}."""
    delimited = re.search(r"(?<!\\)\$", gold) or any(d in gold for d in ("\\(", "\\[", "\\boxed"))
    if "latex" in config.targets and not delimited:  # "\$18.90" is an escaped dollar, not a delimiter
        return f"$\\boxed{{{gold}}}$"
    return gold


@functools.lru_cache(maxsize=65536)
def parse_gold(gold: str, config: MathVerifyConfig = DEFAULT) -> list[Any]:
    """math-verify's parse of a gold answer, cached: a dataset's golds are parsed once per process."""
    from math_verify import parse

    return parse(_gold_text(gold, config), _extraction_config(config), parsing_timeout=None)


@dataclass
class MathCheck:
    correct: bool
    answer: str | None  # what the fast path extracted (None when it found nothing)
    method: str  # "fast", "math_verify", "math_verify_extracted", "no_answer", "no_gold", or "refused",
    # "timeout", "error" (not compared: see reason)
    reason: str = ""  # why a completion was not compared, for the last three methods


def check_math(completion: str, gold: str, config: MathVerifyConfig = DEFAULT) -> MathCheck:
    """`verify_math` with details: the extracted answer and which path decided."""
    text = tail(strip_thinking(completion))
    answer = extract_answer(text)
    if config.fast_path:
        # Only where math-verify would read the same answer: the whole text is a number, or the last
        # \boxed{} is one and no "answer is" follows it (math-verify prefers that anchor).
        g, whole = _plain_number(gold), _plain_number(text)
        if g is not None and whole is not None:
            if g[0] == whole[0]:
                return MathCheck(True, answer, "fast")
            if g[1] and whole[1]:  # two different integers: nothing to round or reinterpret
                return MathCheck(False, answer, "fast")
        if g is not None and "latex" in config.targets and "\\boxed" in text:
            box_tail = text[text.rfind("\\boxed") :]
            boxed = _plain_number(last_boxed(box_tail))
            if boxed is not None and not re.search(r"answer", box_tail, re.IGNORECASE):
                if boxed[0] == g[0]:
                    return MathCheck(True, answer, "fast")
                # With boxed answers first (priority 0), math-verify reads this same box: two different
                # integers are unequal whatever the rounding.
                if boxed[1] and g[1] and config.boxed_match_priority == 0:
                    return MathCheck(False, answer, "fast")
    if len(gold) > MAX_GOLD_CHARS:
        return MathCheck(False, answer, "refused", f"the gold answer has {len(gold)} characters (max {MAX_GOLD_CHARS})")
    depth = max(brace_depth(text), brace_depth(gold))
    if depth > MAX_BRACE_DEPTH:
        return MathCheck(False, answer, "refused", f"braces nested {depth} deep (max {MAX_BRACE_DEPTH})")
    return _bounded(text, answer, gold, config)


def _bounded(text: str, answer: str | None, gold: str, config: MathVerifyConfig) -> MathCheck:
    """`math_verify_check` in the verification pool with ``config.timeout_s``; in place in a daemon process."""
    pool = None
    if may_start_processes():  # a daemon (a pool worker) may not; its own pool's timeout holds
        try:
            pool = verification_pool()
        except RuntimeError:  # in a child of the user's own spawn pool, still importing their unguarded script
            pass
    if pool is None:
        return math_verify_check(text, answer, gold, config)
    args = (math_verify_check, text, answer, gold, config)
    try:  # WorkerStartError and WorkerImportError are raised: no worker ran it, so there is no score
        try:
            return pool.call_sync(*args, timeout=config.timeout_s)
        except WorkerDied:  # killed from outside, or by this text: a new worker tries it once more
            return pool.call_sync(*args, timeout=config.timeout_s)
    except CallTimeout:
        return MathCheck(False, answer, "timeout", f"math-verify ran past timeout_s={config.timeout_s}s; not compared")
    except WorkerDied as e:
        return MathCheck(False, answer, "error", f"math-verify's worker died on this text twice: {e}")
    except RemoteError as e:  # e.g. the address-space limit
        return MathCheck(False, answer, "error", f"math-verify failed: {e}")


def math_verify_check(text: str, answer: str | None, gold: str, config: MathVerifyConfig = DEFAULT) -> MathCheck:
    """The math-verify step of `check_math`, unbounded: run it where a timeout can stop it."""
    from math_verify import parse, verify

    gold_parsed = parse_gold(gold, config)
    if not gold_parsed:
        return MathCheck(False, answer, "no_gold")

    def equal(pred_text: str) -> bool | None:
        pred = parse(pred_text, _extraction_config(config), parsing_timeout=None)
        if not pred:
            return None
        return bool(
            verify(
                gold_parsed,
                pred,
                float_rounding=config.float_rounding,
                strict=config.strict,
                allow_set_relation_comp=config.allow_set_relation_comp,
                timeout_seconds=None,
            )
        )

    ok = equal(text)
    if not ok and config.fallback_extraction and "latex" in config.targets:
        lines = [line.strip().rstrip(".").strip() for line in text.strip().splitlines() if line.strip()]
        for candidate in dict.fromkeys(c for c in (answer, lines[-1] if lines else None) if c):
            if len(candidate) < 1000 and equal(f"$\\boxed{{{candidate}}}$"):
                return MathCheck(True, answer, "math_verify_extracted")
    if ok is None:
        return MathCheck(False, answer, "no_answer")
    return MathCheck(ok, answer, "math_verify")


def verify_math(completion: str, gold: str, config: MathVerifyConfig = DEFAULT) -> bool:
    """True when the final answer of ``completion`` equals ``gold`` (plain or LaTeX, as datasets write it)."""
    return check_math(completion, gold, config).correct


def warm_up() -> None:
    """Import math-verify and parse once in this process, so its first real call is not the slow one."""
    math_verify_check("\\boxed{\\frac{1}{2}}", None, "x^2", MathVerifyConfig(fast_path=False))


def _start_verifier(memory_mb: int) -> None:
    """A verification worker's start-up: an address-space limit, then math-verify imported and warm."""
    import resource

    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warm_up()


def verification_pool() -> WorkerPool:
    """The process-wide pool `check_math` runs math-verify in, started on first use (again after a fork)."""
    return shared_pool("math-verify", VERIFY_WORKERS, functools.partial(_start_verifier, VERIFY_MEMORY_MB))
