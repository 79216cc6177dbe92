"""Where each machine's snapshots are replicated: over-eviction-aware buddy placement.

When trainguard (or an operator, or the scheduler) takes a faulty machine out, it may take
out more than that machine: the machines it was *evicted with* (ByteRobust, SOSP '25, evicts
the whole group a fault cannot yet be pinned down within: one switch, one pipeline group). An
*eviction domain* names such a group; a machine alone is its own domain. A snapshot and its
replica must never both sit inside one domain, or one eviction takes both copies.

:func:`buddies` maps every machine to the machine that holds its replica. With domains of at
most half the machines it is a permutation (each machine holds exactly one other machine's
copies: the memory cost is one snapshot per machine, whatever the job's size); otherwise the
largest domain's machines share the few machines outside it, least loaded first.

>>> buddies(["n1", "n2", "n3", "n4"])
{'n1': 'n2', 'n2': 'n3', 'n3': 'n4', 'n4': 'n1'}
>>> b = buddies(["a1", "a2", "b1", "b2"], domains={"a1": "A", "a2": "A", "b1": "B", "b2": "B"})
>>> b
{'a1': 'b1', 'a2': 'b2', 'b1': 'a1', 'b2': 'a2'}
>>> violations(b, {"a1": "A", "a2": "A", "b1": "B", "b2": "B"})
[]
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Optional

__all__ = ["buddies", "violations", "parse_domains", "PlacementError"]


class PlacementError(ValueError):
    """No placement keeps every replica out of its machine's eviction domain."""


def _domain_of(node: str, domains: Optional[Mapping[str, str]]) -> str:
    return (domains or {}).get(node) or f"\0{node}"   # a machine alone: a domain of its own


def buddies(nodes: Iterable[str], domains: Optional[Mapping[str, str]] = None) -> dict:
    """``{machine: buddy}`` for every machine of ``nodes``, no buddy in its machine's domain.

    Deterministic (the same input gives the same placement on every machine, so the agents
    agree without talking). Raises :class:`PlacementError` when all machines are in one domain.

    >>> buddies(["n1"])  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    PlacementError: no buddy for n1: every machine is in its eviction domain (1 machine, 1 domain)
    >>> buddies(["a1", "a2", "a3", "b1"], domains={"a1": "A", "a2": "A", "a3": "A"})
    {'a1': 'b1', 'a2': 'b1', 'a3': 'b1', 'b1': 'a1'}
    """
    ordered = sorted(set(nodes))
    groups: dict = defaultdict(list)
    for node in ordered:
        groups[_domain_of(node, domains)].append(node)
    if len(groups) < 2:
        raise PlacementError(f"no buddy for {ordered[0] if ordered else '?'}: every machine is "
                             f"in its eviction domain ({len(ordered)} machine"
                             f"{'s' if len(ordered) != 1 else ''}, {len(groups)} domain)")
    # Domains largest first, machines contiguous within their domain.
    ring = [n for _, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            for n in members]
    largest = max(len(m) for m in groups.values())
    total = len(ring)
    if 2 * largest <= total:
        # A shift by the largest domain's size leaves every domain's block (each at most
        # ``largest`` long and at most ``total - largest``): a permutation, load one each.
        return {ring[i]: ring[(i + largest) % total] for i in range(total)}
    load: dict = defaultdict(int)
    placed = {}
    for i, node in enumerate(ring):
        mine = _domain_of(node, domains)
        candidates = [(load[c], (j - i) % total, c) for j, c in enumerate(ring)
                      if _domain_of(c, domains) != mine]
        _, _, chosen = min(candidates)
        load[chosen] += 1
        placed[node] = chosen
    return {n: placed[n] for n in ordered}


def violations(placement: Mapping[str, str],
               domains: Optional[Mapping[str, str]] = None) -> list:
    """The machines whose buddy is themselves or shares their eviction domain (``[]`` when
    the placement is sound): the check the tests and the agent apply."""
    return sorted(n for n, b in placement.items()
                  if n == b or _domain_of(n, domains) == _domain_of(b, domains))


def parse_domains(text: str) -> dict:
    """``"n1=rackA,n2=rackA,n3=rackB"`` as ``{node: domain}`` (a command-line value).

    >>> parse_domains("n1=A, n2=A,n3=B")
    {'n1': 'A', 'n2': 'A', 'n3': 'B'}
    >>> parse_domains("n1")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    ValueError: eviction domain 'n1' must be NODE=DOMAIN
    """
    out = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        node, sep, domain = item.partition("=")
        if not sep or not node.strip() or not domain.strip():
            raise ValueError(f"eviction domain {item!r} must be NODE=DOMAIN")
        out[node.strip()] = domain.strip()
    return out
