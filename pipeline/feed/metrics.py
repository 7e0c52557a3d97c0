"""Step timing: how long the trainer waited for data versus how long it computed.

Time blocked in the loader's `next()` is data wait; time between getting a batch and asking for the
next one is compute. On CUDA no synchronisation is added: when the GPU is the bottleneck the host
blocks inside CUDA calls (counted as compute), and when the loader is the bottleneck the host blocks
in `next()` (counted as wait), so the starvation share stays honest without slowing the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


@dataclass
class StepStats:
    steps: int = 0
    rows: int = 0
    data_wait_s: float = 0.0
    compute_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.data_wait_s + self.compute_s

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.total_s if self.total_s > 0 else 0.0

    @property
    def data_wait_pct(self) -> float:
        """Share of step time spent waiting for data (GPU/trainer starvation)."""
        return 100.0 * self.data_wait_s / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}steps": self.steps, f"{prefix}rows": self.rows,
                f"{prefix}data_wait_s": round(self.data_wait_s, 4), f"{prefix}compute_s": round(self.compute_s, 4),
                f"{prefix}rows_per_s": round(self.rows_per_s, 1), f"{prefix}data_wait_pct": round(self.data_wait_pct, 2)}


def timed(batches: Iterable[T], stats: StepStats, rows_of=lambda b: b.y.shape[0]) -> Iterator[T]:
    """Yield from `batches`, adding wait and compute times and row counts to `stats`."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        t1 = time.perf_counter()
        stats.data_wait_s += t1 - t0
        yield batch
        stats.compute_s += time.perf_counter() - t1
        stats.steps += 1
        stats.rows += rows_of(batch)
