"""Seeds that mix a run's setting (`seed_everything`, `data.seed`) into a stream's key.

torch's CPU generator keeps only the low 32 bits of the seed it is given, so a key built as `seed * 2**32 + key`
loses the seed. Every stream here is keyed by its own number (a generation, a refill) and then shifted by
`seed_offset(seed)`, which is 0 for seed 0: runs with the default seed draw what they always drew."""

from __future__ import annotations


def seed_offset(seed: int) -> int:
    """A seed's shift of a stream, in [0, 2**31): Fibonacci hashing (the seed times 2**64 / golden ratio, modulo
    2**64, its top 31 bits), which spreads consecutive seeds far apart and maps 0 to 0."""
    return ((seed % 2**64) * 0x9E3779B97F4A7C15 % 2**64) >> 33
