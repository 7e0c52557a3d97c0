"""A rank's rows as contiguous tensors, fetched a whole batch per call.

Rows are gathered with `index_select` (one vectorised call per tensor, optionally straight into a
preallocated output), never with per-row Python. Row ids travel with the rows, so every consumer
can check that it saw each row exactly once.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch


class Batch(NamedTuple):
    x_num: torch.Tensor  # [B, F] float32
    x_cat: torch.Tensor  # [B, C] int64, 0 = unknown or null
    y: torch.Tensor  # [B] float32

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in self))


class TabularDataset:
    """Contiguous feature, category-id and label tensors (plus row ids) of one rank's rows."""

    def __init__(self, x_num: torch.Tensor, x_cat: torch.Tensor, y: torch.Tensor, row_id: torch.Tensor | None = None):
        n = x_num.shape[0]
        if not (x_cat.shape[0] == y.shape[0] == n) or x_num.dim() != 2 or x_cat.dim() != 2 or y.dim() != 1:
            raise ValueError(f"inconsistent shapes: x_num {tuple(x_num.shape)}, x_cat {tuple(x_cat.shape)}, y {tuple(y.shape)}")
        self.x_num = x_num.contiguous()
        self.x_cat = x_cat.contiguous()
        self.y = y.contiguous()
        self.row_id = (row_id if row_id is not None else torch.arange(n, dtype=torch.int64)).contiguous()

    @classmethod
    def from_numpy(cls, x_num: np.ndarray, x_cat: np.ndarray, y: np.ndarray, row_id: np.ndarray | None = None) -> "TabularDataset":
        return cls(torch.from_numpy(np.ascontiguousarray(x_num, dtype=np.float32)),
                   torch.from_numpy(np.ascontiguousarray(x_cat, dtype=np.int64)),
                   torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32)),
                   None if row_id is None else torch.from_numpy(np.ascontiguousarray(row_id, dtype=np.int64)))

    @classmethod
    def from_batches(cls, batches: Iterable[dict[str, np.ndarray]]) -> "TabularDataset":
        """Concatenate transformed blocks (row_id, x_num, x_cat, y) and put rows in row-id order, so
        the result does not depend on the order in which blocks arrived."""
        parts: dict[str, list[np.ndarray]] = {"row_id": [], "x_num": [], "x_cat": [], "y": []}
        for b in batches:
            for k in parts:
                parts[k].append(b[k])
        if not parts["row_id"]:
            return cls.from_numpy(np.empty((0, 0), np.float32), np.empty((0, 0), np.int64), np.empty(0, np.float32),
                                  np.empty(0, np.int64))
        cols = {k: np.concatenate(v) for k, v in parts.items()}
        rid = cols["row_id"]
        if rid.size > 1 and not (rid[1:] > rid[:-1]).all():
            order = np.argsort(rid, kind="stable")
            cols = {k: v[order] for k, v in cols.items()}
        return cls.from_numpy(cols["x_num"], cols["x_cat"], cols["y"], cols["row_id"])

    @classmethod
    def from_ray(cls, iterator) -> "TabularDataset":
        """Materialise a Ray Train dataset shard (a DataIterator) once; epochs then never touch Ray."""
        return cls.from_batches(iterator.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2))

    def __len__(self) -> int:
        return self.x_num.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x_num, self.x_cat, self.y, self.row_id))

    @property
    def device(self) -> torch.device:
        return self.x_num.device

    def get_batch(self, idx: torch.Tensor, out: Batch | None = None) -> Batch:
        """Rows `idx` as one Batch; with `out`, gathered straight into its (preallocated) tensors."""
        if out is None:
            return Batch(self.x_num.index_select(0, idx), self.x_cat.index_select(0, idx), self.y.index_select(0, idx))
        torch.index_select(self.x_num, 0, idx, out=out.x_num)
        torch.index_select(self.x_cat, 0, idx, out=out.x_cat)
        torch.index_select(self.y, 0, idx, out=out.y)
        return out

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        """Batched fetch used by torch's DataLoader when given a batch sampler: one gather per batch."""
        return self.get_batch(torch.as_tensor(indices, dtype=torch.int64))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row (the slow textbook path; kept for comparison and for per-row tooling)."""
        return self.x_num[i], self.x_cat[i], self.y[i]

    def subset(self, idx: torch.Tensor) -> "TabularDataset":
        return TabularDataset(self.x_num[idx], self.x_cat[idx], self.y[idx], self.row_id[idx])

    def to(self, device, non_blocking: bool = False) -> "TabularDataset":
        return TabularDataset(*(t.to(device, non_blocking=non_blocking) for t in (self.x_num, self.x_cat, self.y, self.row_id)))

    def pin_memory(self) -> "TabularDataset":
        return TabularDataset(*(t.pin_memory() for t in (self.x_num, self.x_cat, self.y, self.row_id)))

    def split_holdout(self, fraction: float, seed: int) -> tuple["TabularDataset", "TabularDataset"]:
        """(train, validation): a row is held out by a hash of its global row id, so the split is the
        same whatever the number of ranks and however the rows were sharded."""
        mask = torch.from_numpy(holdout_mask(self.row_id.numpy(), fraction, seed))
        return self.subset(~mask), self.subset(mask)


def holdout_mask(row_id: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """True for rows in the validation set: splitmix64(row_id, seed) mapped to [0, 1) < fraction."""
    with np.errstate(over="ignore"):
        z = row_id.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53) < fraction
