"""The same work as ray_side.py without Ray: for torchrun processes and notebooks. pyarrow and numpy
in this process, a few threads (both release the GIL while decoding and computing), fragments and
pieces in the same order, so the statistics, rows and batches equal the Ray path's exactly."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from . import tasks


def _threads(n: int, sharing: int = 1) -> int:
    """Threads for n units of work, when `sharing` processes on this machine do the same at once."""
    return max(1, min(n, (os.cpu_count() or 1) // max(1, sharing), 8))


def fit_records(source, spec: tasks.ReadSpec, stall_s: float = 0.0) -> list[tuple]:
    """fit_group over every group on threads. The category counts are merged by the threads as they go
    (stats.CountTables) and handed to the first record with statistics, so merge_fit only sums numbers."""
    from ..fit.stats import CountTables

    groups = tasks.fragment_groups(source.fragments)
    counts = CountTables()

    def fit(g: list) -> list[tuple]:
        records = tasks.fit_group(spec, g)
        counts.take(r[2] for r in records if len(r) == 6)
        return records

    with ThreadPoolExecutor(_threads(len(groups))) as pool:
        records = [r for rs in pool.map(fit, groups) for r in rs]
    first = min((r for r in records if len(r) == 6 and r[2] is not None), key=lambda r: r[0], default=None)
    if first is not None:
        counts.give(first[2])
    return records


def read_share(plan, rank: int, sink: Callable[[tasks.Part, bool], None], ranks_on_node: int = 1) -> tuple[int, float]:
    """This rank's pieces, read and transformed in this process, handed to sink(part, is_validation) in
    piece order as they complete (the same parts ray_side.receive hands on); returns (rows, seconds)."""
    t0 = time.perf_counter()
    groups = tasks.piece_groups(plan.pieces(rank), mix=True)
    rows = 0
    with ThreadPoolExecutor(_threads(len(groups), ranks_on_node)) as pool:
        for group, parts in zip(groups, pool.map(lambda g: tasks.transform_group(plan.spec, plan.fitted, g), groups)):
            for p, part in zip(group, parts):
                rows += len(part[1])
                sink(part, p.val)
    return rows, time.perf_counter() - t0
