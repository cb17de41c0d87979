"""Evaluation metrics as papers report them: avg@n, unbiased pass@k, maj@k.

For a problem with n samples of which c are correct:
    avg@n  = c / n
    pass@k = 1 - C(n - c, k) / C(n, k)      (Chen et al. 2021, unbiased for k <= n)
    maj@k  = 1 if the most common extracted answer among the first k samples is a correct one
Each is averaged over problems.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expects 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 if the majority answer of the first ``k`` samples (ties: the earliest) is correct; samples
    without an extracted answer do not vote."""
    votes = [(a, ok) for a, ok in zip(answers[:k], correct[:k]) if a is not None and a != ""]
    if not votes:
        return 0.0
    counts = Counter(a for a, _ in votes)
    top = max(counts.values())
    winner = next(a for a, _ in votes if counts[a] == top)
    return float(any(ok for a, ok in votes if a == winner))


def report_ks(n: int) -> list[int]:
    """The k values reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    return ks if ks[-1] == n else [*ks, n]
