"""The same work as ray_side.py without Ray: for torchrun processes and notebooks. pyarrow and numpy
in this process, a few threads (both release the GIL while decoding and computing), fragments and
pieces in the same order, so the statistics, rows and batches equal the Ray path's exactly."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from . import tasks


def _threads(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1, 8))


def fit_records(source, spec: tasks.ReadSpec, stall_s: float = 0.0) -> list[tuple]:
    frags = list(source.fragments)
    with ThreadPoolExecutor(_threads(len(frags))) as pool:
        return list(pool.map(lambda f: tasks.fit_fragment(spec, f), frags))


def read_share(plan, rank: int):
    """(training parts, validation parts, rows read here, seconds): this rank's pieces, read and
    transformed in this process (the same parts ray_side.receive returns)."""
    t0 = time.perf_counter()
    pieces = plan.pieces(rank)
    with ThreadPoolExecutor(_threads(len(pieces))) as pool:
        parts = list(pool.map(lambda p: tasks.transform_piece(plan.spec, plan.fitted, p), pieces))
    train = [part for p, part in zip(pieces, parts) if not p.val and len(part[1])]
    val = [part for p, part in zip(pieces, parts) if p.val and len(part[1])]
    return train, val, sum(len(part[1]) for part in parts), time.perf_counter() - t0
