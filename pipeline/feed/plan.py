"""Which rows each rank owns: pure functions of the fit pass's counts and the world size.

After the fit pass the driver knows, for every fragment (one row group), how many rows survive the
quality screen and how many of those are held out for validation (a hash of the global row id). Rank r
of W then owns positions [r*N/W, (r+1)*N/W) of the N training rows in global row order, and likewise
of the validation rows: sizes differ by at most one, nothing is dropped, and every rank's size is
known before any worker starts (so the sampler needs no collective to agree on steps per epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of a fragment's kept training rows (val=False) or kept validation rows (val=True),
    in row order."""

    fragment: Any  # read/files.py's Fragment
    lo: int
    hi: int
    val: bool = False

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def rank_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank r's contiguous share [lo, hi) of n rows: sizes differ by at most one, none is skipped."""
    return n * rank // world, n * (rank + 1) // world


def rank_sizes(n: int, world: int) -> list[int]:
    return [hi - lo for lo, hi in (rank_bounds(n, world, r) for r in range(world))]


def plan_shares(fragments: Sequence, counts: dict[int, int], world: int, *, whole: bool = False,
                val: bool = False, bounds: Sequence[tuple[int, int]] | None = None) -> list[list[Piece]]:
    """Each rank's pieces: rank r gets positions [r*N/W, (r+1)*N/W) of the N rows that `counts`
    (fragment row_start -> rows it yields) says the fragments yield, in fragment order (whole=True:
    every rank gets all N; bounds: these [lo, hi) of positions instead). A fragment that straddles two
    ranks is read by both, each keeping its slice."""
    used = [(f, counts.get(f.row_start, 0)) for f in fragments]
    used = [(f, u) for f, u in used if u > 0]
    n = sum(u for _, u in used)
    if bounds is None:
        bounds = [(0, n)] * world if whole else [rank_bounds(n, world, r) for r in range(world)]
    shares: list[list[Piece]] = []
    for lo, hi in bounds:
        pieces, at = [], 0
        for f, u in used:
            a, b = max(lo, at), min(hi, at + u)
            if a < b:
                pieces.append(Piece(f, a - at, b - at, val))
            at += u
        shares.append(pieces)
    return shares


def holdout_mask(row_id, fraction: float, seed: int):
    """True for rows in the validation set: splitmix64(row_id, seed) mapped to [0, 1) < fraction. A
    function of the global row id alone, so the split is the same whatever the number of ranks."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = np.asarray(row_id).astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53) < fraction
