"""Deterministic, resumable, rank-aware batch order.

The order is a pure function of (seed, epoch, rank, the sizes of all ranks' shards): no hidden RNG
state, so the saved state is two counters (epoch, step) plus the facts needed to refuse a resume that
could not continue exactly. Every rank computes the same number of steps per epoch from the sizes
of all ranks, so DDP never waits on a rank that ran out of data.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from .errors import PipelineError


def steps_per_epoch(rank_sizes: Sequence[int], batch_size: int, drop_last: bool) -> int:
    """The same number on every rank: with drop_last, full batches of the smallest shard; without,
    enough batches for the largest shard (smaller shards wrap around their own permutation)."""
    if drop_last:
        return min(rank_sizes) // batch_size
    return -(-max(rank_sizes) // batch_size)


def _generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    g = torch.Generator()
    # Distinct, well-mixed seeds per (seed, epoch, rank); torch's CPU randperm is reproducible given one.
    g.manual_seed((seed * 1_000_003 + epoch * 10_007 + rank * 101 + 0x5EED) % (2**63))
    return g


class BatchSampler:
    """Yields int64 index tensors into the rank's dataset, `len(self)` of them per epoch.

    shuffle=True draws a new permutation of the rank's rows every epoch (shuffle mode `local`).
    global_rows=N (shuffle mode `global`): the dataset holds all N rows on every rank; each epoch one
    permutation of all N (the same on every rank) is cut into contiguous, equal shares, rank r taking
    share r, so rows are re-dealt across ranks every epoch. num_rows is then the rank's share.
    State: `state_dict()` taken after k batches of an epoch resumes at batch k of that epoch.
    """

    def __init__(self, num_rows: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 rank: int = 0, rank_sizes: Sequence[int] | None = None, global_rows: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rank_sizes = tuple(int(s) for s in (rank_sizes if rank_sizes is not None else [num_rows]))
        if not 0 <= rank < len(self.rank_sizes) or self.rank_sizes[rank] != num_rows:
            raise ValueError(f"rank {rank} with {num_rows} rows does not match rank_sizes {list(self.rank_sizes)}")
        if min(self.rank_sizes) == 0:
            empty = [r for r, s in enumerate(self.rank_sizes) if s == 0]
            raise PipelineError(f"ranks {empty} received no rows (sizes {list(self.rank_sizes)}); use fewer workers "
                                f"(train.num_workers) or more data")
        self.global_rows = global_rows
        if global_rows is not None and sum(self.rank_sizes) != global_rows:
            raise ValueError(f"global shuffle: rank_sizes {list(self.rank_sizes)} do not add up to {global_rows}")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.shuffle, self.drop_last, self.rank = shuffle, drop_last, rank
        self.steps = steps_per_epoch(self.rank_sizes, batch_size, drop_last)
        if self.steps == 0:
            raise PipelineError(f"no full batch of {batch_size} rows fits the smallest rank's {min(self.rank_sizes)} rows "
                                f"(drop_last is on), so an epoch would train on nothing; lower train.batch_size, "
                                f"use fewer workers (train.num_workers) or set train.drop_last = false")
        self.epoch = 0
        self.step = 0  # batches already handed out in self.epoch

    def __len__(self) -> int:
        return self.steps

    @property
    def dataset_rows(self) -> int:
        """Rows the indices point into: the rank's rows, or all rows in global mode."""
        return self.global_rows if self.global_rows is not None else self.num_rows

    @property
    def dropped_rows(self) -> int:
        """Rows of this rank not seen in an epoch (drop_last remainder); 0 without drop_last."""
        return max(0, self.num_rows - self.steps * self.batch_size)

    @property
    def padded_rows(self) -> int:
        """Rows of this rank seen twice in an epoch so that every rank runs the same steps."""
        return 0 if self.drop_last else max(self.rank_sizes) - self.num_rows

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's row order for an epoch, long enough for `len(self)` batches."""
        if self.global_rows is not None:
            lo = sum(self.rank_sizes[: self.rank])
            everyone = torch.randperm(self.global_rows, generator=_generator(self.seed, epoch, -1)) if self.shuffle \
                else torch.arange(self.global_rows)
            perm = everyone[lo: lo + self.num_rows].clone()
        elif self.shuffle:
            perm = torch.randperm(self.num_rows, generator=_generator(self.seed, epoch, self.rank))
        else:
            perm = torch.arange(self.num_rows)
        # drop_last: the first steps*batch_size rows; otherwise every rank walks max(rank_sizes) rows,
        # smaller shards wrapping around their own permutation, so batch sizes match across ranks.
        length = self.steps * self.batch_size if self.drop_last else max(self.rank_sizes)
        if length > self.num_rows:
            perm = perm.repeat(-(-length // self.num_rows))
        return perm[:length]

    def spans(self) -> Iterator[tuple[int, int]]:
        """(start, stop) into `order(self.epoch)` for each remaining batch of the epoch; advances the state."""
        length = self.steps * self.batch_size if self.drop_last else max(self.rank_sizes)
        while self.step < self.steps:
            start = self.step * self.batch_size
            self.step += 1
            yield start, min(start + self.batch_size, length)
        # The epoch is complete: the next iteration starts the next epoch unless set_epoch says otherwise.
        self.epoch, self.step = self.epoch + 1, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        perm = self.order(self.epoch)
        for start, stop in self.spans():
            yield perm[start:stop]

    def state_dict(self) -> dict[str, Any]:
        # No rank in it: every rank's state is the same dict, so any rank's (rank 0's) checkpoint loads on all.
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "rank_sizes": list(self.rank_sizes),
                "global_rows": self.global_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "shuffle", "drop_last", "rank_sizes", "global_rows"):
            if state.get(key) != mine[key]:
                raise PipelineError(
                    f"cannot resume exactly: the checkpoint's loader has {key}={state.get(key)!r} but this run has "
                    f"{mine[key]!r}; resume with the same data, train.batch_size, train.seed and train.num_workers, "
                    f"or start a new run")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
