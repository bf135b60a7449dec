"""Routing keys chosen so that a test can tell Summit's affinity tables from the routers' tie-break."""

from __future__ import annotations

from deployments.routing.policies import least_loaded


def same_hash_home(keys: list[str], replicas: list[str], n: int) -> list[int]:
    """Indexes of `n` of `keys` that the routers' tie-break (a hash of the key, `least_loaded` among idle replicas)
    sends to one and the same replica: spread over several replicas, they were spread by an affinity table's counts
    of keys per replica, not by the hash."""
    home = {i: least_loaded(dict.fromkeys(replicas, 0), key=k) for i, k in enumerate(keys)}
    for replica in replicas:
        chosen = [i for i, r in home.items() if r == replica][:n]
        if len(chosen) == n:
            return chosen
    raise AssertionError("no replica is the hash home of enough keys")
