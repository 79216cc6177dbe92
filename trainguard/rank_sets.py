"""Rank sets as people read them, in alerts, reports and stack trees."""
from __future__ import annotations

from typing import Iterable


def format_ranks(ranks: Iterable[int]) -> str:
    """Rank set as compact ranges.

    >>> format_ranks([3, 0, 1, 7, 8, 9])
    '0-1,3,7-9'
    >>> format_ranks([])
    ''
    """
    out, rs, i = [], sorted(set(int(r) for r in ranks)), 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)
