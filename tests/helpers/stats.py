"""Paired comparisons of two versions' held-out answers (the same problems: right or wrong,
or scored)."""

from __future__ import annotations

import math


def mcnemar_p(before: list[bool], after: list[bool]) -> tuple[float, int, int]:
    """One-sided exact McNemar p-value that `after` is no better than `before` (paired, the
    same tasks), with b (wrong -> right) and c (right -> wrong).

    Under "no difference" each discordant problem flips either way with probability 1/2, so
    b is Binomial(b + c, 1/2) and p = P(X >= b)."""
    b = sum(a and not w for w, a in zip(before, after, strict=True))
    c = sum(w and not a for w, a in zip(before, after, strict=True))
    return _upper_tail(b, c), b, c


def sign_test_p(before: list[float], after: list[float]) -> tuple[float, int, int]:
    """One-sided exact sign test p-value that `after` scores no higher than `before` (paired,
    the same tasks), with b (tasks scored higher after) and c (lower after); ties are left
    out. Under "no difference" a task that changed is as likely to go up as down."""
    b = sum(a > w for w, a in zip(before, after, strict=True))
    c = sum(a < w for w, a in zip(before, after, strict=True))
    return _upper_tail(b, c), b, c


def _upper_tail(b: int, c: int) -> float:
    """P(X >= b) for X ~ Binomial(b + c, 1/2)."""
    n = b + c
    return sum(math.comb(n, i) for i in range(b, n + 1)) / 2 ** n
