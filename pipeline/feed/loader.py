"""From a rank's TabularDataset to batches on the training device, as fast as memory allows.

Three paths, one interface (`__iter__`, `__len__`, `set_epoch`, `state_dict`, `load_state_dict`):

- CPU target: one `index_select` fetches the packed rows of several consecutive batches (a chunk of
  about `chunk_bytes`, 4 MiB by default) into a fresh tensor, and the batches are views of it.
- CUDA, host placement: chunks are gathered straight into a ring of pinned host buffers, copied to
  the GPU on a side stream with non_blocking=True `prefetch` chunks ahead, and the compute stream
  waits on the copy's event before it touches the batch (plus record_stream, so the caching allocator
  does not hand the memory to another stream early). A pinned buffer is written again only after
  the event of the copy that read it has completed.
- CUDA, device placement: the shard is moved to the GPU once and each epoch's permutation lives on
  the GPU, so a batch is a device-side gather and nothing crosses PCIe per step.

State counts batches *delivered* to the caller, not batches prefetched, so a checkpoint taken
after k steps resumes at step k+1 even though the copy engine ran ahead.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Callable, Iterator

import torch

from ..config import CHUNK_MIB
from .dataset import Batch, TabularDataset
from .sampler import BatchSampler


CHUNK_BYTES = int(CHUNK_MIB * 2**20)


def resolve_placement(dataset: TabularDataset, device: torch.device, placement: str, memory_fraction: float) -> str:
    """'device' when the target is CUDA and the shard fits in `memory_fraction` of free GPU memory
    (placement='auto'), else 'host'. CPU targets are always 'host'."""
    if device.type != "cuda" or placement == "host":
        return "host"
    if placement == "device":
        return "device"
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if dataset.nbytes <= memory_fraction * free else "host"


class _Position:
    """Epoch and step *delivered* to the caller: what a checkpoint must record, whatever ran ahead."""

    sampler: BatchSampler
    _delivered: int
    _epoch_of_delivered: int
    _active = False

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
        if epoch != self._epoch_of_delivered:
            self._epoch_of_delivered, self._delivered = epoch, self.sampler.step

    @property
    def delivered(self) -> int:
        """Batches handed to the caller so far in the current epoch."""
        return self._delivered

    def __len__(self) -> int:
        """Batches of the epoch being delivered (of its segment left, when resumed on another world size),
        even once the sampler has run ahead into the next epoch (a prefetch); between epochs, the next's."""
        steps = self.sampler.segment_of(self._epoch_of_delivered)[1]
        return steps if self._delivered < steps or self._active else len(self.sampler)

    def _delivering(self, batches: Iterator) -> Iterator:
        """Marks an epoch's iteration as under way (len() counts its batches until it ends)."""
        self._epoch_of_delivered = self.sampler.epoch
        self._delivered = self.sampler.step
        self._active = True
        try:
            yield from batches
        finally:
            self._active = False

    def state_dict(self) -> dict[str, Any]:
        # The sampler may have run ahead (prefetch); what counts is what the caller received.
        return self.sampler.state_at(self._epoch_of_delivered, self._delivered)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._epoch_of_delivered = self.sampler.epoch
        self._delivered = self.sampler.step


class DeviceLoader(_Position):
    def __init__(self, dataset: TabularDataset, sampler: BatchSampler, device: torch.device | str = "cpu", *,
                 placement: str = "auto", prefetch: int = 2, device_memory_fraction: float = 0.5,
                 chunk_bytes: int = CHUNK_BYTES):
        if len(dataset) != sampler.dataset_rows:
            raise ValueError(f"sampler is for {sampler.dataset_rows} rows but the dataset has {len(dataset)}")
        self.device = torch.device(device)
        self.sampler = sampler
        self.prefetch = max(1, prefetch)
        # Rows per gather: about chunk_bytes of packed rows, whole batches, at least one batch.
        self.chunk_rows = max(1, chunk_bytes // (4 * dataset.width))
        self.placement = resolve_placement(dataset, self.device, placement, device_memory_fraction)
        self.dataset = dataset.to(self.device) if self.placement == "device" else dataset
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event | None]] | None = None  # pinned packed buffers
        self._delivered = 0  # batches handed to the caller in the epoch below
        self._epoch_of_delivered = sampler.epoch
        self._index: torch.Tensor | None = None  # the last batch's indices are _index[_index_at:][:batch_size]
        self._index_at = 0

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def last_index(self) -> torch.Tensor | None:
        """Dataset indices of the batch last delivered (sliced on request: not a cost on every batch)."""
        if self._index is None:
            return None
        return self._index[self._index_at:self._index_at + self.sampler.batch_size]

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type != "cuda":
            return self._delivering(self._iter_host())
        if self.placement == "device":
            return self._delivering(self._iter_resident())
        return self._delivering(self._iter_pinned())

    # -- rows gathered K batches at a time ----------------------------------------------------

    @property
    def _batches_per_chunk(self) -> int:
        return max(1, self.chunk_rows // self.sampler.batch_size)

    def _chunks(self) -> Iterator[torch.Tensor]:
        """The rest of the epoch as index tensors of up to `chunk_rows` rows of consecutive batches,
        one gather each. One big gather beats many small ones (the call overhead is paid once, and
        torch spreads a large gather over its threads), and batch k is still exactly rows
        order[k*B:(k+1)*B]."""
        perm = self.sampler.order(self.sampler.epoch)
        k = self._batches_per_chunk
        spans = self.sampler.spans()  # advances the sampler; the delivered count is kept apart
        while True:
            group = list(itertools.islice(spans, k))
            if not group:
                return
            yield perm[group[0][0]:group[-1][1]]

    def _views(self, rows: torch.Tensor, idx: torch.Tensor) -> Iterator[Batch]:
        """The batches of a gathered chunk as views (built by four splits, not per-batch slicing)."""
        f, c, t, w = self.dataset.layout
        b = self.sampler.batch_size
        self._index = idx
        y = rows[:, f + c] if t == 1 else rows[:, f + c:f + c + t]
        parts = zip(rows[:, :f].split(b), rows[:, f:f + c].view(torch.int32).split(b), y.split(b),
                    rows[:, f + c + t].split(b) if w else itertools.repeat(None))
        for k, (x_num, x_cat, y_k, w_k) in enumerate(parts):
            self._index_at = k * b
            self._delivered += 1
            yield Batch(x_num, x_cat, y_k, w_k)

    # -- CPU target ---------------------------------------------------------------------------

    def _iter_host(self) -> Iterator[Batch]:
        # A fresh tensor per chunk, never a reused one: a batch the caller keeps stays valid.
        rows = self.dataset.rows
        for idx in self._chunks():
            yield from self._views(torch.index_select(rows, 0, idx), idx)

    # -- CUDA, shard resident on the GPU ------------------------------------------------------

    def _iter_resident(self) -> Iterator[Batch]:
        perm = self.sampler.order(self.sampler.epoch).to(self.device, non_blocking=False)
        get = self.dataset.get_batch
        self._index = perm
        for start, stop in self.sampler.spans():
            self._delivered += 1
            self._index_at = start
            yield get(perm[start:stop])

    # -- CUDA, pinned host ring + side-stream copies -------------------------------------------

    def _iter_pinned(self) -> Iterator[Batch]:
        ds = self.dataset
        if self._ring is None:  # prefetch+1 pinned chunk buffers: one being read by the caller's batches,
            # up to `prefetch` in flight
            self._ring = [(ds.alloc_batch(self._batches_per_chunk * self.sampler.batch_size, pin=True), None)
                          for _ in range(self.prefetch + 1)]
        ring = self._ring
        copy_stream = torch.cuda.Stream(self.device)
        pending: deque[tuple[torch.Tensor, torch.cuda.Event, torch.Tensor]] = deque()
        slot = 0

        def launch(idx: torch.Tensor) -> None:
            nonlocal slot
            buf, done = ring[slot]
            if done is not None:
                done.synchronize()  # the copy that last read this pinned buffer has finished
            host = ds.gather(idx, out=buf)  # one gather straight into pinned memory
            with torch.cuda.stream(copy_stream):
                dev = host.to(self.device, non_blocking=True)  # one DMA for the whole chunk of batches
                ready = torch.cuda.Event()
                ready.record(copy_stream)
            ring[slot] = (buf, ready)
            slot = (slot + 1) % len(ring)
            pending.append((dev, ready, idx))

        chunks = self._chunks()
        for _ in range(self.prefetch):
            idx = next(chunks, None)
            if idx is None:
                break
            launch(idx)
        compute = torch.cuda.current_stream(self.device)
        while pending:
            dev, ready, idx = pending.popleft()
            compute.wait_event(ready)
            dev.record_stream(compute)  # allocated on the copy stream, used on the compute stream
            nxt = next(chunks, None)
            if nxt is not None:
                launch(nxt)  # the next copy overlaps with the caller's compute on these batches
            yield from self._views(dev, idx)


class _Fetch:
    """Picklable batch fetcher for DataLoader workers: one gather per batch, then the user's transform."""

    def __init__(self, dataset: TabularDataset, transform: Callable[[Batch], Any] | None):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, idx) -> Any:
        rows = self.dataset.gather(torch.as_tensor(idx, dtype=torch.int64))
        # Without a transform the packed rows travel (and are pinned) as one tensor, unpacked last.
        return rows if self.transform is None else self.transform(self.dataset.unpack(rows))

    def __getitem__(self, i):  # DataLoader requires it to exist; batches always go through __getitems__
        raise TypeError("rows are fetched a whole batch at a time (__getitems__)")


def _first(batch):
    return batch


class WorkerLoader(_Position):
    """A torch DataLoader path for per-batch Python transforms in worker processes.

    Fed by the same BatchSampler (so it too fetches whole batches and has the same order, equal steps
    and resume state); `transform(Batch) -> anything` runs in the workers. Use DeviceLoader when there
    is no transform: it is faster and its CUDA copies overlap with compute.
    """

    def __init__(self, dataset: TabularDataset, sampler: BatchSampler, device: torch.device | str = "cpu", *,
                 transform: Callable[[Batch], Any] | None = None, num_workers: int = 2, prefetch_factor: int = 2,
                 persistent_workers: bool = True, pin_memory: bool | None = None):
        self.device = torch.device(device)
        self.sampler, self.dataset, self.transform = sampler, dataset, transform
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self._dl = torch.utils.data.DataLoader(
            _Fetch(dataset, transform), batch_sampler=sampler, collate_fn=_first, num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=persistent_workers and num_workers > 0, pin_memory=pin)
        self._delivered = 0
        self._epoch_of_delivered = sampler.epoch

    def __iter__(self) -> Iterator[Any]:
        return self._delivering(self._iter_workers())

    def _iter_workers(self) -> Iterator[Any]:
        cuda = self.device.type == "cuda"
        for out in self._dl:
            if self.transform is None:
                out = self.dataset.unpack(out.to(self.device, non_blocking=True) if cuda else out)
            self._delivered += 1
            yield out
