"""Greedy longest-processing-time assignment: the split used for ViT ranks and for array tasks."""

from __future__ import annotations


def lpt_assignment(costs: list[int], num_bins: int) -> list[list[int]]:
    """Item indices per bin: largest item first, each to the least-loaded bin (lowest bin on ties).

    Deterministic for the same costs, and every item lands in exactly one bin.
    """
    loads = [0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(index)
        loads[target] += costs[index]
    return bins
