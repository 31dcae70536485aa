"""Half-open integer ranges [a, b): union and difference (ExtensibleTensor's granules)."""

from __future__ import annotations


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of half-open integer ranges, touching ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract_ranges(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of [lo, hi) not in the sorted, merged ranges `covered`."""
    out, cur = [], lo
    for a, b in covered:
        if b <= cur or a >= hi:
            continue
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out
