"""A rank's rows in one packed, row-major tensor, fetched a whole batch per call.

Layout: row i of `rows` (float32, shape [n, F + C + 1]) holds the F standardised features, then the C
category ids (int32 bit patterns in float32 slots), then the label. A shuffled batch is then ONE
`index_select` reading one contiguous 4*(F+C+1)-byte run per row: random gathers are bound by memory
latency, and three separate tensors cost three cache-miss streams per row instead of one (measured
1.2-2.4x slower here). `x_num`, `x_cat` and `y` are views into the packed rows, on the dataset and on
every batch; a batch crosses PCIe as one copy. Large tensors are allocated on transparent huge pages
where the OS allows (fewer TLB misses on random rows).

Row ids travel beside the rows, so every consumer can check that it saw each row exactly once.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Iterable, NamedTuple

import numpy as np
import torch

_HUGE = 2 << 20


class Batch(NamedTuple):
    x_num: torch.Tensor  # [B, F] float32
    x_cat: torch.Tensor  # [B, C] int32, 0 = unknown or null
    y: torch.Tensor  # [B] float32

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in self))

    def contiguous(self) -> "Batch":
        return Batch(*(t.contiguous() for t in self))


def unpack(rows: torch.Tensor, num_features: int, num_categorical: int) -> Batch:
    """Views of packed rows [B, F + C + 1] as (x_num, x_cat, y); no copy."""
    f, c = num_features, num_categorical
    return Batch(rows[:, :f], rows[:, f:f + c].view(torch.int32), rows[:, f + c])


def alloc_rows(n: int, width: int, *, pin: bool = False, spill_dir: str | None = None) -> torch.Tensor:
    """An uninitialised float32 [n, width] tensor, advised onto huge pages before first touch.

    spill_dir: back the tensor by a file there instead of anonymous memory (a shard larger than RAM):
    the page cache keeps what fits and the OS reads the rest from disk on demand. The file is
    unlinked as soon as it is mapped, so it takes disk space only while the tensor lives and nothing
    is left behind, even if the process is killed."""
    if spill_dir is not None:
        import tempfile

        os.makedirs(spill_dir, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="rows-", suffix=".f32", dir=spill_dir)
        try:
            try:  # reserve the blocks now: a full disk is then an error here, not a SIGBUS mid-training
                os.posix_fallocate(fd, 0, max(1, n * width * 4))
            except OSError as e:
                from .errors import PipelineError

                raise PipelineError(f"cannot reserve {n * width * 4 / 2**30:.1f} GiB in '{spill_dir}' for this rank's "
                                    f"rows ({e.strerror}); point loader.spill_dir at a local disk with room, or "
                                    f"use more workers (train.num_workers) so each share is smaller") from None
            mm = np.memmap(path, dtype=np.float32, mode="r+", shape=(n, width)) if n else np.empty((0, width), np.float32)
        finally:
            os.close(fd)
            os.unlink(path)
        return torch.from_numpy(mm)
    if pin:
        return torch.empty((n, width), dtype=torch.float32, pin_memory=True)
    t = torch.empty((n, width), dtype=torch.float32)
    nbytes = t.numel() * 4
    if sys.platform.startswith("linux") and nbytes >= 2 * _HUGE:
        start = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
        end = (t.data_ptr() + nbytes) & ~(_HUGE - 1)
        try:  # MADV_HUGEPAGE = 14; harmless where THP is off ("never") or unsupported
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(14))
        except (OSError, AttributeError):
            pass
    return t


class TabularDataset:
    """One rank's rows: packed features, category ids and label (see module doc), plus row ids."""

    def __init__(self, rows: torch.Tensor, num_features: int, num_categorical: int, row_id: torch.Tensor | None = None,
                 *, spill_dir: str | None = None):
        if rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[1] != num_features + num_categorical + 1:
            raise ValueError(f"packed rows must be float32 [n, {num_features} + {num_categorical} + 1], "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        self.rows = rows.contiguous()
        self.num_features, self.num_categorical = num_features, num_categorical
        self.spill_dir = spill_dir  # where derived datasets (subsets, splits) put their rows; None: memory
        n = rows.shape[0]
        self.row_id = (row_id if row_id is not None else torch.arange(n, dtype=torch.int64)).contiguous()
        if self.row_id.shape != (n,):
            raise ValueError(f"row_id has shape {tuple(self.row_id.shape)}, expected ({n},)")
        self.x_num, self.x_cat, self.y = unpack(self.rows, num_features, num_categorical)

    @classmethod
    def from_numpy(cls, x_num: np.ndarray, x_cat: np.ndarray, y: np.ndarray, row_id: np.ndarray | None = None) -> "TabularDataset":
        return cls.from_blocks([{"x_num": x_num, "x_cat": x_cat, "y": y,
                                 **({} if row_id is None else {"row_id": row_id})}], sort=False)

    @classmethod
    def from_blocks(cls, blocks: Iterable[dict[str, np.ndarray]], *, sort: bool = True,
                    spill_dir: str | None = None) -> "TabularDataset":
        """Pack transformed blocks (x_num, x_cat, y and optionally row_id) into one tensor. With sort,
        rows are put in row-id order, so the result does not depend on the order blocks arrived in.
        spill_dir: keep the rows in a memory-mapped file there (see alloc_rows), not in memory."""
        blocks = [b for b in blocks if len(b["y"])]
        if not blocks:
            raise ValueError("no rows: this rank received an empty shard")
        f, c = np.asarray(blocks[0]["x_num"]).shape[1], np.asarray(blocks[0]["x_cat"]).shape[1]
        ids = np.concatenate([b["row_id"] for b in blocks]) if "row_id" in blocks[0] else None
        ds = cls._pack(blocks, f, c, ids, spill_dir)
        if ids is not None and sort and ids.size > 1 and not (ids[1:] > ids[:-1]).all():
            ds = ds.sorted_by_row_id()
        return ds

    @classmethod
    def _pack(cls, blocks, f: int, c: int, ids: np.ndarray | None, spill_dir: str | None) -> "TabularDataset":
        n = sum(len(b["y"]) for b in blocks)
        rows = alloc_rows(n, f + c + 1, spill_dir=spill_dir)
        packed = rows.numpy()
        at = 0
        for b in blocks:
            k = len(b["y"])
            packed[at:at + k, :f] = b["x_num"]
            packed[at:at + k, f:f + c].view(np.int32)[:] = b["x_cat"]  # ids < 2**31 by construction
            packed[at:at + k, f + c] = b["y"]
            at += k
        return cls(rows, f, c, None if ids is None else torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
                   spill_dir=spill_dir)

    def sorted_by_row_id(self) -> "TabularDataset":
        return self.subset(torch.argsort(self.row_id, stable=True))

    @classmethod
    def from_ray(cls, iterator) -> "TabularDataset":
        """Materialise a Ray Train dataset shard (a DataIterator) once; epochs then never touch Ray."""
        return cls.from_blocks(iterator.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2))

    def __len__(self) -> int:
        return self.rows.shape[0]

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * 4 + self.row_id.numel() * 8

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def alloc_batch(self, batch_size: int, *, pin: bool = False) -> torch.Tensor:
        """A packed output buffer for `get_batch(..., out=)`."""
        return alloc_rows(batch_size, self.width, pin=pin)

    def gather(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed rows `idx`: one index_select, into `out` (at least len(idx) rows) if given."""
        if out is None:
            return self.rows.index_select(0, idx)
        return torch.index_select(self.rows, 0, idx, out=out[: idx.numel()])

    def unpack(self, rows: torch.Tensor) -> Batch:
        return unpack(rows, self.num_features, self.num_categorical)

    def get_batch(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> Batch:
        """Rows `idx` as one Batch of views into a single gathered tensor."""
        return unpack(self.gather(idx, out), self.num_features, self.num_categorical)

    def __getitems__(self, indices) -> Batch:
        """Batched fetch used by torch's DataLoader when given a batch sampler: one gather per batch."""
        return self.get_batch(torch.as_tensor(indices, dtype=torch.int64))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row (the slow textbook path; kept for comparison and for per-row tooling)."""
        return self.x_num[i], self.x_cat[i], self.y[i]

    def subset(self, idx: torch.Tensor) -> "TabularDataset":
        if idx.dtype == torch.bool:
            idx = idx.nonzero().squeeze(1)
        idx = idx.to(self.rows.device)
        if self.rows.device.type == "cpu":  # onto huge pages (or disk), like the shard it comes from
            rows = torch.index_select(self.rows, 0, idx, out=alloc_rows(idx.numel(), self.width,
                                                                        spill_dir=self.spill_dir))
        else:
            rows = self.rows.index_select(0, idx)
        return TabularDataset(rows, self.num_features, self.num_categorical, self.row_id[idx.to(self.row_id.device)],
                              spill_dir=self.spill_dir)

    def to(self, device, non_blocking: bool = False) -> "TabularDataset":
        return TabularDataset(self.rows.to(device, non_blocking=non_blocking), self.num_features, self.num_categorical,
                              self.row_id.to(device, non_blocking=non_blocking))

    def split_holdout(self, fraction: float, seed: int) -> tuple["TabularDataset", "TabularDataset"]:
        """(train, validation): a row is held out by a hash of its global row id, so the split is the
        same whatever the number of ranks and however the rows were sharded."""
        mask = torch.from_numpy(holdout_mask(self.row_id.cpu().numpy(), fraction, seed))
        return self.subset(~mask), self.subset(mask)


def holdout_mask(row_id: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """True for rows in the validation set: splitmix64(row_id, seed) mapped to [0, 1) < fraction."""
    with np.errstate(over="ignore"):
        z = row_id.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53) < fraction
