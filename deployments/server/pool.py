"""A deployment that hosts several models of one shape (the direct path): which model each replica serves."""

from __future__ import annotations


def pool_model_index(rank: int, replicas_per_model: list[int]) -> int:
    """Which model a replica of rank `rank` serves: ranks 0..n0-1 the first model, the next n1 the second, ..."""
    rank %= max(1, sum(replicas_per_model))
    for index, count in enumerate(replicas_per_model):
        if rank < count:
            return index
        rank -= count
    return 0
