"""A rank's rows in one packed, row-major tensor, fetched a whole batch per call.

Layout: row i of `rows` (float32, shape [n, F + C + T + W]) holds the F standardised features, then
the C category ids (int32 bit patterns in float32 slots), then the T targets, then the weight (W = 1
when there is one). A shuffled batch is then ONE `index_select` reading one contiguous run per row:
random gathers are bound by memory latency, and separate tensors cost one cache-miss stream each per
row instead of one (measured 1.2-2.4x slower here). `x_num`, `x_cat`, `y` and `w` are views into the
packed rows, on the dataset and on every batch; a batch crosses PCIe as one copy. Large tensors are allocated on transparent huge pages
where the OS allows (fewer TLB misses on random rows).

Row ids travel beside the rows, so every consumer can check that it saw each row exactly once.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import NamedTuple

import numpy as np
import torch

_HUGE = 2 << 20


class Batch(NamedTuple):
    """One training batch (torch). The numpy counterpart for serving is `pipeline.Transformed`."""

    x_num: torch.Tensor  # [B, F] float32, standardised (vector features take several columns)
    x_cat: torch.Tensor  # [B, C] int32, 0 = unknown or null
    y: torch.Tensor  # float32: [B] for one target, [B, T] for several ([B, 0] for none); class ids as floats
    w: torch.Tensor | None = None  # [B] float32 per-row weight, when data.weight is set

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(*(None if t is None else t.to(device, non_blocking=non_blocking) for t in self))

    def contiguous(self) -> "Batch":
        return Batch(*(None if t is None else t.contiguous() for t in self))


class Layout(NamedTuple):
    """Slots of a packed row: features, category ids, targets, weight (0 or 1)."""

    features: int
    categorical: int
    targets: int = 1
    weight: int = 0

    @property
    def width(self) -> int:
        return sum(self)


def unpack(rows: torch.Tensor, layout: Layout) -> Batch:
    """Views of packed rows [B, width] as a Batch; no copy."""
    f, c, t, w = layout
    y = rows[:, f + c] if t == 1 else rows[:, f + c:f + c + t]
    return Batch(rows[:, :f], rows[:, f:f + c].view(torch.int32), y, rows[:, f + c + t] if w else None)


def alloc_rows(n: int, width: int, *, pin: bool = False, spill_dir: str | None = None) -> torch.Tensor:
    """An uninitialised float32 [n, width] tensor, advised onto huge pages and faulted in at once.

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
                from ..errors import PipelineError

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
            libc = ctypes.CDLL(None)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(14))
            # MADV_POPULATE_WRITE = 23 (Linux 5.14; an error before, ignored): the pages faulted in now, in
            # one call. Left to the first writes they cost 0.02 to 0.45 s per 160 MiB on a VM, the slow end
            # when each fault waits for the kernel to find (compact) a huge page; populated: 0.015 s.
            libc.madvise(ctypes.c_void_p(t.data_ptr() & ~4095),
                         ctypes.c_size_t(nbytes + (t.data_ptr() & 4095)), ctypes.c_int(23))
        except (OSError, AttributeError):
            pass
    return t


class RowWriter:
    """Packed blocks written straight into a rank's one tensor as they arrive, so a share is held once
    (plus the block in flight), never as a list of blocks and then a copy of them all. The row count
    is known up front (the plan says it); a block past it, or too few rows at the end, is an error."""

    def __init__(self, n: int, layout: "Layout | tuple", *, spill_dir: str | None = None, what: str = "rows"):
        self.layout, self.n, self.spill_dir, self.what = Layout(*layout), n, spill_dir, what
        self.rows = alloc_rows(n, self.layout.width, spill_dir=spill_dir)
        self._packed = self.rows.numpy()
        self.ids = np.empty(n, np.int64)
        self.extra: dict[str, list[np.ndarray]] = {}
        self.at = 0

    def add(self, rows: np.ndarray, ids: np.ndarray, extra: dict[str, np.ndarray] | None = None) -> None:
        k = len(ids)
        if self.at + k > self.n:
            from ..errors import DataError

            raise DataError(f"received more {self.what} than the {self.n:,} planned; was data.path modified during "
                            f"the run?")
        self._packed[self.at:self.at + k] = rows
        self.ids[self.at:self.at + k] = ids
        for c, v in (extra or {}).items():
            self.extra.setdefault(c, []).append(v)
        self.at += k

    def finish(self, *, sort: bool = True) -> "TabularDataset":
        if self.at != self.n:
            from ..errors import DataError

            raise DataError(f"received {self.at:,} {self.what} but {self.n:,} were planned; was data.path modified "
                            f"during the run?")
        ids = self.ids
        extra = {c: np.concatenate(v) for c, v in self.extra.items()}
        ds = TabularDataset(self.rows, self.layout, torch.from_numpy(ids), spill_dir=self.spill_dir, extra=extra)
        if sort and self.n > 1 and not (ids[1:] > ids[:-1]).all():
            ds = ds.sorted_by_row_id()
        return ds


class TabularDataset:
    """One rank's rows: packed features, category ids, targets and weight (see module doc), plus row ids."""

    def __init__(self, rows: torch.Tensor, layout: Layout | tuple, row_id: torch.Tensor | None = None, *,
                 spill_dir: str | None = None, extra: dict[str, np.ndarray] | None = None):
        self.layout = Layout(*layout)
        if rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[1] != self.layout.width:
            raise ValueError(f"packed rows must be float32 [n, {self.layout.width}] for {self.layout}, "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        self.rows = rows.contiguous()
        self.spill_dir = spill_dir  # where derived datasets (subsets) put their rows; None: memory
        n = rows.shape[0]
        self.row_id = (row_id if row_id is not None else torch.arange(n, dtype=torch.int64)).contiguous()
        if self.row_id.shape != (n,):
            raise ValueError(f"row_id has shape {tuple(self.row_id.shape)}, expected ({n},)")
        self.x_num, self.x_cat, self.y, self.w = unpack(self.rows, self.layout)
        # Pass-through columns (data.passthrough), row-aligned numpy arrays kept out of the packed rows
        # so that batches stay one gather: a batch's values are extra[name][loader.last_index].
        self.extra = dict(extra or {})

    @property
    def num_features(self) -> int:
        return self.layout.features

    @property
    def num_categorical(self) -> int:
        return self.layout.categorical

    @classmethod
    def from_numpy(cls, x_num: np.ndarray, x_cat: np.ndarray, y: np.ndarray | None, row_id: np.ndarray | None = None,
                   w: np.ndarray | None = None) -> "TabularDataset":
        """Pack separate arrays (y: [n] one target, [n, T] several, None none; w: [n] or None)."""
        x_num, x_cat = np.asarray(x_num), np.asarray(x_cat)
        n = len(x_num)
        y2 = np.zeros((n, 0), np.float32) if y is None else np.asarray(y, np.float32).reshape(n, -1)
        layout = Layout(x_num.shape[1], x_cat.shape[1], y2.shape[1], 0 if w is None else 1)
        rows = np.empty((n, layout.width), np.float32)
        f, c, t = layout.features, layout.categorical, layout.targets
        rows[:, :f] = x_num
        rows[:, f:f + c].view(np.int32)[:] = x_cat  # ids < 2**31 by construction
        rows[:, f + c:f + c + t] = y2
        if w is not None:
            rows[:, f + c + t] = w
        ids = np.arange(n) if row_id is None else row_id
        return cls.from_parts([(rows, np.asarray(ids, np.int64))], layout, sort=False)

    @classmethod
    def from_parts(cls, parts: list[tuple], layout: Layout | tuple, *, sort: bool = True,
                   spill_dir: str | None = None) -> "TabularDataset":
        """Concatenate packed blocks [(rows [k, width], row ids [k][, {pass-through column: values}]), ...]
        straight into one tensor (in memory, or memory-mapped from a file in spill_dir: see alloc_rows).
        With sort, rows end up in row-id order, so the result does not depend on the order blocks arrived in."""
        writer = RowWriter(sum(len(p[1]) for p in parts), layout, spill_dir=spill_dir)
        for part in parts:
            writer.add(*part)
        return writer.finish(sort=sort)

    def sorted_by_row_id(self) -> "TabularDataset":
        return self.subset(torch.argsort(self.row_id, stable=True))

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
        return unpack(rows, self.layout)

    def get_batch(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> Batch:
        """Rows `idx` as one Batch of views into a single gathered tensor."""
        return unpack(self.gather(idx, out), self.layout)

    def __getitems__(self, indices) -> Batch:
        """Batched fetch used by torch's DataLoader when given a batch sampler: one gather per batch."""
        return self.get_batch(torch.as_tensor(indices, dtype=torch.int64))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        """One row (the slow textbook path; kept for comparison and for per-row tooling)."""
        return tuple(t[i] for t in (self.x_num, self.x_cat, self.y, self.w) if t is not None)

    def subset(self, idx: torch.Tensor) -> "TabularDataset":
        if idx.dtype == torch.bool:
            idx = idx.nonzero().squeeze(1)
        idx = idx.to(self.rows.device)
        if self.rows.device.type == "cpu":  # onto huge pages (or disk), like the shard it comes from
            rows = torch.index_select(self.rows, 0, idx, out=alloc_rows(idx.numel(), self.width,
                                                                        spill_dir=self.spill_dir))
        else:
            rows = self.rows.index_select(0, idx)
        host_idx = idx.cpu().numpy()
        return TabularDataset(rows, self.layout, self.row_id[idx.to(self.row_id.device)], spill_dir=self.spill_dir,
                              extra={k: v[host_idx] for k, v in self.extra.items()})

    def to(self, device, non_blocking: bool = False) -> "TabularDataset":
        return TabularDataset(self.rows.to(device, non_blocking=non_blocking), self.layout,
                              self.row_id.to(device, non_blocking=non_blocking), extra=self.extra)
