"""Deterministic, resumable, rank-aware batch order that survives a change of world size.

The training rows of an epoch have global positions 0..N-1 (the plan's order). The order is a pure
function of (seed, epoch, world size, what was consumed before in the epoch): no hidden RNG state, so
the saved state is counters: the epoch and its segments, [world size, steps] for each stretch of the
epoch run on one world size. Every rank computes the same number of steps from the sizes of all
ranks, so DDP never waits on a rank that ran out of data.

- global shuffle (every rank holds all N rows): one permutation of the N positions per epoch; global
  step k takes positions [k*G, (k+1)*G) of it (G = world size x batch size), rank r the r-th batch of
  those. Global batch k is then the same rows on any world size with the same G, and a resume on
  another world size deals out the rest of the permutation.
- local shuffle (rank r holds its contiguous block of positions): rank r walks a permutation of its
  block. A resume on another world size takes the rows the epoch has not consumed (replayed from the
  segments), in position order, cuts them into equal contiguous parts, and rank r walks a permutation
  of its part; the next epoch is the plain epoch of the new world size.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from ..errors import PipelineError


def steps_per_epoch(rank_sizes: Sequence[int], batch_size: int, drop_last: bool) -> int:
    """The same number on every rank: with drop_last, full batches of the smallest shard; without,
    enough batches for the largest shard (smaller shards wrap around their own permutation)."""
    if drop_last:
        return min(rank_sizes) // batch_size
    return -(-max(rank_sizes) // batch_size)


def _generator(seed: int, epoch: int, rank: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator()
    # Distinct, well-mixed seeds per (seed, epoch, rank[, segment]); torch's CPU randperm is reproducible given one.
    g.manual_seed((seed * 1_000_003 + epoch * 10_007 + rank * 101 + 0x5EED + salt * 0x9E3779B1) % (2**63))
    return g


def _bounds(n: int, world: int) -> list[tuple[int, int]]:
    return [(n * r // world, n * (r + 1) // world) for r in range(world)]


def _wrapped(order: torch.Tensor, length: int) -> torch.Tensor:
    """`order` repeated to at least `length`, cut there (ranks with fewer rows revisit their first ones)."""
    if length > len(order) > 0:
        order = order.repeat(-(-length // len(order)))
    return order[:length]


def _salt(history: Sequence[Sequence[int]]) -> int:
    h = 0
    for w, k in history:
        h = (h * 1_000_003 + w * 7919 + k) % (2**31)
    return h + 1


class EpochOrder:
    """The positions every rank walks in one segment of an epoch: pure functions of the arguments."""

    def __init__(self, n: int, world: int, batch_size: int, *, seed: int, epoch: int, shuffle: bool, drop_last: bool,
                 global_rows: bool, history: Sequence[Sequence[int]] = (), first_sizes: Sequence[int] | None = None):
        self.n, self.world, self.batch, self.seed, self.epoch = n, world, batch_size, seed, epoch
        self.shuffle, self.drop_last, self.whole, self.history = shuffle, drop_last, global_rows, tuple(map(tuple, history))
        # The blocks of an epoch's first segment: the plan's sizes (contiguous, in rank order); the even split
        # of n where none are given for this world size.
        self.first_sizes = list(first_sizes) if first_sizes is not None and len(first_sizes) == world \
            else [b - a for a, b in _bounds(n, world)]

    # -- global shuffle: one sequence of positions per epoch, dealt out a global batch at a time
    def _sequence(self) -> torch.Tensor:
        return torch.randperm(self.n, generator=_generator(self.seed, self.epoch, -1)) if self.shuffle \
            else torch.arange(self.n)

    def _global(self, rank: int | None) -> tuple[list[torch.Tensor], int]:
        start = sum(w * k * self.batch for w, k in self.history)
        rest = self._sequence()[start:]
        g = self.world * self.batch
        steps = len(rest) // g if self.drop_last else -(-len(rest) // g)
        grid = _wrapped(rest, steps * g).view(steps, self.world, self.batch)
        ranks = range(self.world) if rank is None else [rank]
        return [grid[:, r, :].reshape(-1) for r in ranks], steps

    # -- local shuffle: each rank a block (first segment) or a part of what the epoch has left
    def remaining(self) -> torch.Tensor:
        """Positions the epoch's earlier segments did not consume, ascending."""
        left = torch.ones(self.n, dtype=torch.bool)
        for j, (w, k) in enumerate(self.history):
            earlier = EpochOrder(self.n, w, self.batch, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle,
                                 drop_last=self.drop_last, global_rows=self.whole, history=self.history[:j],
                                 first_sizes=self.first_sizes)
            for walk in earlier.walks()[0]:
                left[walk[:k * self.batch]] = False
        return torch.nonzero(left).flatten()

    def _local(self, rank: int | None) -> tuple[list[torch.Tensor], int]:
        if not self.history:
            starts = [sum(self.first_sizes[:r]) for r in range(len(self.first_sizes))]
            parts = [(starts[r], self.first_sizes[r]) for r in range(len(self.first_sizes))]
            ranks = range(self.world) if rank is None else [rank]
            steps = steps_per_epoch(self.first_sizes, self.batch, self.drop_last)
            length = steps * self.batch if self.drop_last else max(self.first_sizes)
            walks = []
            for r in ranks:
                lo, size = parts[r]
                perm = torch.randperm(size, generator=_generator(self.seed, self.epoch, r)) if self.shuffle \
                    else torch.arange(size)
                walks.append(_wrapped(perm, length) + lo)
            return walks, steps
        rest = self.remaining()
        cuts = _bounds(len(rest), self.world)
        sizes = [b - a for a, b in cuts]
        if min(sizes) == 0:
            raise PipelineError(f"the rest of epoch {self.epoch} holds {len(rest)} rows, fewer than the {self.world} ranks "
                                f"resuming it; resume on fewer ranks, or from the next epoch's checkpoint")
        steps = steps_per_epoch(sizes, self.batch, self.drop_last)
        length = steps * self.batch if self.drop_last else max(sizes)
        ranks = range(self.world) if rank is None else [rank]
        walks = []
        for r in ranks:
            part = rest[cuts[r][0]:cuts[r][1]]
            perm = torch.randperm(len(part), generator=_generator(self.seed, self.epoch, r, _salt(self.history))) \
                if self.shuffle else torch.arange(len(part))
            walks.append(_wrapped(part[perm], length))
        return walks, steps

    def walks(self, rank: int | None = None) -> tuple[list[torch.Tensor], int]:
        """([positions rank r walks, for each rank (or only `rank`)], steps in this segment)."""
        return self._global(rank) if self.whole else self._local(rank)


class BatchSampler:
    """Yields int64 index tensors into the rank's dataset, `len(self)` of them per epoch (or per
    remaining segment of a resumed epoch).

    shuffle=True draws a new permutation every epoch. global_rows=N (shuffle mode `global`): the dataset
    holds all N rows on every rank and the order is dealt out a global batch at a time (see the module
    docstring); num_rows is then the rank's share of an epoch. rank_sizes: the rows of every rank (the
    plan's contiguous split). offset/dataset_rows: the positions the rank's dataset holds (default: its
    block, or all N in global mode; a resume on another world size may need a wider span, see
    `resume_span`).
    State: `state_dict()` taken after k batches of an epoch resumes at batch k of that epoch, on the
    same world size or any other.
    """

    def __init__(self, num_rows: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 rank: int = 0, rank_sizes: Sequence[int] | None = None, global_rows: int | None = None,
                 offset: int | None = None, dataset_rows: int | None = None):
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
        self.world, self.n = len(self.rank_sizes), sum(self.rank_sizes)
        self.offset = offset if offset is not None else (0 if global_rows is not None else sum(self.rank_sizes[:rank]))
        self._dataset_rows = dataset_rows
        if steps_per_epoch(self.rank_sizes, batch_size, drop_last) == 0:
            raise PipelineError(f"no full batch of {batch_size} rows fits the smallest rank's {min(self.rank_sizes)} rows "
                                f"(drop_last is on), so an epoch would train on nothing; lower train.batch_size, "
                                f"use fewer workers (train.num_workers) or set train.drop_last = false")
        self.epoch = 0
        self.step = 0  # batches already handed out in the current segment of self.epoch
        self.history: tuple[tuple[int, int], ...] = ()  # earlier segments of self.epoch: (world size, steps)
        self._finished: tuple = (-1, (), 0)  # (epoch, history, steps) of the last epoch spans() ran to its end
        self._cache: tuple | None = None

    def _segment(self, epoch: int, history: tuple) -> tuple[torch.Tensor, int]:
        key = (epoch, history)
        if self._cache is None or self._cache[0] != key:
            order = EpochOrder(self.n, self.world, self.batch_size, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                               drop_last=self.drop_last, global_rows=self.global_rows is not None, history=history,
                               first_sizes=self.rank_sizes)
            walks, steps = order.walks(self.rank)
            self._cache = (key, walks[0], steps)
        return self._cache[1], self._cache[2]

    @property
    def steps(self) -> int:
        """Steps of the current segment of the epoch (a whole epoch unless resumed on another world size)."""
        return self._segment(self.epoch, self.history)[1]

    def __len__(self) -> int:
        return self.steps

    @property
    def dataset_rows(self) -> int:
        """Rows the indices point into: the rank's rows, or all rows in global mode."""
        if self._dataset_rows is not None:
            return self._dataset_rows
        return self.global_rows if self.global_rows is not None else self.num_rows

    @property
    def dropped_rows(self) -> int:
        """Rows of this rank not seen in an epoch (drop_last remainder); 0 without drop_last."""
        return max(0, self.num_rows - steps_per_epoch(self.rank_sizes, self.batch_size, self.drop_last) * self.batch_size)

    @property
    def padded_rows(self) -> int:
        """Rows of this rank seen twice in an epoch so that every rank runs the same steps."""
        return 0 if self.drop_last else max(self.rank_sizes) - self.num_rows

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step, self.history = epoch, 0, ()

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's indices into its dataset for an epoch (the current segment, when it is the
        current epoch), long enough for its batches."""
        walk, _ = self._segment(epoch, self.history if epoch == self.epoch else ())
        idx = walk - self.offset
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.dataset_rows):
            raise PipelineError(f"rank {self.rank}'s rows (positions {self.offset}-{self.offset + self.dataset_rows - 1}) do "
                                f"not hold the rows this resumed epoch deals it; pass the loader state to "
                                f"pipeline.rank_data(plan, resume=state) so that the rank reads them")
        return idx

    def spans(self) -> Iterator[tuple[int, int]]:
        """(start, stop) into `order(self.epoch)` for each remaining batch of the segment; advances the state."""
        steps = self.steps
        while self.step < steps:
            start = self.step * self.batch_size
            self.step += 1
            yield start, start + self.batch_size
        # The epoch is complete: the next iteration starts the next epoch unless set_epoch says otherwise.
        self._finished = (self.epoch, self.history, steps)
        self.epoch, self.step, self.history = self.epoch + 1, 0, ()

    def __iter__(self) -> Iterator[torch.Tensor]:
        perm = self.order(self.epoch)
        for start, stop in self.spans():
            yield perm[start:stop]

    def segment_of(self, epoch: int) -> tuple[tuple, int]:
        """(history, steps) of `epoch`'s current segment: the current epoch's, the one spans() last ran to its
        end (a loader's sampler may have run ahead of what it delivered), or a plain epoch's."""
        if epoch == self.epoch:
            return self.history, self.steps
        if epoch == self._finished[0]:
            return self._finished[1], self._finished[2]
        return (), self._segment(epoch, ())[1]

    def state_at(self, epoch: int, step: int) -> dict[str, Any]:
        """The state after `step` batches of the current segment of `epoch` were delivered (the loader
        asks: its sampler may have run ahead into the next epoch)."""
        history, steps = self.segment_of(epoch)
        if step >= steps:  # the epoch is done: the next one starts afresh
            epoch, step, history = epoch + 1, 0, ()
        segments = [list(s) for s in history] + ([[self.world, step]] if step else [])
        return {"epoch": epoch, "step": step, "segments": segments,
                "position": sum(w * k for w, k in segments) * self.batch_size, "world_size": self.world,
                "seed": self.seed, "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "train_rows": self.n, "global": self.global_rows is not None}

    def state_dict(self) -> dict[str, Any]:
        # No rank in it: every rank's state is the same dict, so any rank's (rank 0's) checkpoint loads on all,
        # on any number of ranks.
        return self.state_at(self.epoch, self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = upgrade(state)
        mine = self.state_dict()
        for key in ("seed", "batch_size", "shuffle", "drop_last", "train_rows", "global"):
            if state.get(key) != mine[key]:
                raise PipelineError(
                    f"cannot resume exactly: the checkpoint's loader has {key}={state.get(key)!r} but this run has "
                    f"{mine[key]!r}; resume with the same data, train.batch_size, train.seed and train.shuffle "
                    f"(any number of workers), or start a new run")
        segments = tuple((int(w), int(k)) for w, k in state["segments"] if int(k) > 0)
        standard = [b - a for a, b in _bounds(self.n, self.world)]
        if segments and any(w != self.world for w, _ in segments) and (
                self.global_rows is None and list(self.rank_sizes) != standard):
            raise PipelineError(f"cannot resume on {self.world} ranks: this loader's rank_sizes {list(self.rank_sizes)} "
                                f"are not the plan's contiguous split, which a resume on another world size deals from; "
                                f"make the loader through pipeline.rank_data")
        self.epoch = int(state["epoch"])
        if segments and segments[-1][0] == self.world:  # the same world size goes on where it was
            self.history, self.step = segments[:-1], segments[-1][1]
        else:
            self.history, self.step = segments, 0


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A loader state saved before world-size-independent states (rank_sizes, step) in today's form."""
    if "segments" in state or "rank_sizes" not in state:
        return state
    sizes, step = state["rank_sizes"], int(state["step"])
    n = state["global_rows"] if state.get("global_rows") is not None else sum(sizes)
    if state.get("global_rows") is not None and step:
        raise PipelineError("this checkpoint was saved mid-epoch in global shuffle mode by an older version, whose order "
                            "differs; resume it from its epoch's start (a checkpoint at an epoch's end) or start a new run")
    return {**state, "segments": [[len(sizes), step]] if step else [], "train_rows": n,
            "global": state.get("global_rows") is not None}


def resume_span(state: dict[str, Any], n: int, world: int, rank: int, *, global_rows: bool) -> tuple[int, int] | None:
    """The positions [lo, hi) rank's dataset must hold to go on from `state` on `world` ranks: its block
    and, when the saved epoch goes on on another world size (local shuffle), its part of what the epoch
    has left. None when the plain block does."""
    if global_rows:
        return None  # every rank holds every row
    state = upgrade(state)
    segments = tuple((int(w), int(k)) for w, k in state.get("segments", ()) if int(k) > 0)
    history = segments[:-1] if segments and segments[-1][0] == world else segments
    if not history:
        return None  # a fresh epoch, or the epoch's first segment going on: the rank's own block
    walk = EpochOrder(n, world, int(state["batch_size"]), seed=int(state["seed"]), epoch=int(state["epoch"]),
                      shuffle=bool(state["shuffle"]), drop_last=bool(state["drop_last"]), global_rows=False,
                      history=history).walks(rank)[0][0]
    lo, hi = _bounds(n, world)[rank]
    a, b = int(walk.min()), int(walk.max()) + 1
    return None if lo <= a and b <= hi else (min(lo, a), max(hi, b))
