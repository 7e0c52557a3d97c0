"""From a rank's TabularDataset to batches on the training device, as fast as memory allows.

Three paths, one interface (`__iter__`, `__len__`, `set_epoch`, `state_dict`, `load_state_dict`):

- CPU target: one `index_select` per tensor per batch; nothing else happens per batch.
- CUDA, host placement: rows are gathered straight into a ring of pinned host buffers, copied to
  the GPU on a side stream with non_blocking=True `prefetch` batches ahead, and the compute stream
  waits on the copy's event before it touches the batch (plus record_stream, so the caching allocator
  does not hand the memory to another stream early). A pinned buffer is written again only after
  the event of the copy that read it has completed.
- CUDA, device placement: the shard is moved to the GPU once and each epoch's permutation lives on
  the GPU, so a batch is a device-side gather and nothing crosses PCIe per step.

State counts batches *delivered* to the caller, not batches prefetched, so a checkpoint taken
after k steps resumes at step k+1 even though the copy engine ran ahead.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import torch

from .dataset import Batch, TabularDataset
from .sampler import BatchSampler


def resolve_placement(dataset: TabularDataset, device: torch.device, placement: str, memory_fraction: float) -> str:
    """'device' when the target is CUDA and the shard fits in `memory_fraction` of free GPU memory
    (placement='auto'), else 'host'. CPU targets are always 'host'."""
    if device.type != "cuda" or placement == "host":
        return "host"
    if placement == "device":
        return "device"
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if dataset.nbytes <= memory_fraction * free else "host"


class DeviceLoader:
    def __init__(self, dataset: TabularDataset, sampler: BatchSampler, device: torch.device | str = "cpu", *,
                 placement: str = "auto", prefetch: int = 2, device_memory_fraction: float = 0.5):
        if len(dataset) != sampler.num_rows:
            raise ValueError(f"sampler is for {sampler.num_rows} rows but the dataset has {len(dataset)}")
        self.device = torch.device(device)
        self.sampler = sampler
        self.prefetch = max(1, prefetch)
        self.placement = resolve_placement(dataset, self.device, placement, device_memory_fraction)
        self.dataset = dataset.to(self.device) if self.placement == "device" else dataset
        self._ring: list[tuple[Batch, torch.cuda.Event | None]] | None = None
        self._delivered = 0  # batches handed to the caller in the epoch below
        self._epoch_of_delivered = sampler.epoch

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
        if epoch != self._epoch_of_delivered:
            self._epoch_of_delivered, self._delivered = epoch, self.sampler.step

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        # The sampler may have run ahead (prefetch); what counts is what the caller received.
        if self._delivered == len(self.sampler):  # epoch finished: resume at the next one
            state["epoch"], state["step"] = self._epoch_of_delivered + 1, 0
        else:
            state["epoch"], state["step"] = self._epoch_of_delivered, self._delivered
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._epoch_of_delivered = self.sampler.epoch
        self._delivered = self.sampler.step

    def __iter__(self) -> Iterator[Batch]:
        self._epoch_of_delivered = self.sampler.epoch
        self._delivered = self.sampler.step
        if self.device.type != "cuda":
            it = self._iter_host()
        elif self.placement == "device":
            it = self._iter_resident()
        else:
            it = self._iter_pinned()
        for batch in it:
            self._delivered += 1
            yield batch

    # -- CPU target ---------------------------------------------------------------------------

    def _iter_host(self) -> Iterator[Batch]:
        get = self.dataset.get_batch
        for idx in self.sampler:
            yield get(idx)

    # -- CUDA, shard resident on the GPU ------------------------------------------------------

    def _iter_resident(self) -> Iterator[Batch]:
        perm = self.sampler.order(self.sampler.epoch).to(self.device, non_blocking=False)
        get = self.dataset.get_batch
        for start, stop in self.sampler.spans():
            yield get(perm[start:stop])

    # -- CUDA, pinned host ring + side-stream copies -------------------------------------------

    def _alloc_ring(self) -> list[tuple[Batch, torch.cuda.Event | None]]:
        ds, b = self.dataset, self.sampler.batch_size
        slots = []
        for _ in range(self.prefetch + 1):
            buf = Batch(torch.empty((b, ds.x_num.shape[1]), dtype=ds.x_num.dtype, pin_memory=True),
                        torch.empty((b, ds.x_cat.shape[1]), dtype=ds.x_cat.dtype, pin_memory=True),
                        torch.empty((b,), dtype=ds.y.dtype, pin_memory=True))
            slots.append((buf, None))
        return slots

    def _iter_pinned(self) -> Iterator[Batch]:
        if self._ring is None:
            self._ring = self._alloc_ring()
        ring = self._ring
        copy_stream = torch.cuda.Stream(self.device)
        pending: deque[tuple[Batch, torch.cuda.Event]] = deque()
        slot = 0

        def launch(idx: torch.Tensor) -> None:
            nonlocal slot
            buf, done = ring[slot]
            if done is not None:
                done.synchronize()  # the copy that last read this pinned buffer has finished
            n = idx.numel()
            host = self.dataset.get_batch(idx, out=Batch(buf.x_num[:n], buf.x_cat[:n], buf.y[:n]))
            with torch.cuda.stream(copy_stream):
                dev = host.to(self.device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(copy_stream)
            ring[slot] = (buf, ready)
            slot = (slot + 1) % len(ring)
            pending.append((dev, ready))

        indices = iter(self.sampler)
        for _ in range(self.prefetch):
            idx = next(indices, None)
            if idx is None:
                break
            launch(idx)
        compute = torch.cuda.current_stream(self.device)
        while pending:
            dev, ready = pending.popleft()
            compute.wait_event(ready)
            for t in dev:
                t.record_stream(compute)
            idx = next(indices, None)
            if idx is not None:
                launch(idx)  # the next copy overlaps with the caller's compute on this batch
            yield dev
