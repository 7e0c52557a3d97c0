"""The CUDA paths of DeviceLoader against the CPU path: same rows in every batch, on the device, with
pinned-ring and GPU-resident placement, across chunk boundaries and a mid-epoch resume. Skipped
without a GPU (these CI machines have none); run `pytest tests/test_cuda.py` on a GPU node."""

import itertools

import pytest
import torch

from helpers import numbered_dataset, rows_of
from pipeline.feed.loader import DeviceLoader
from pipeline.feed.sampler import BatchSampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _loader(device, placement, n=5003, b=128, chunk_rows=1000, prefetch=2):
    lo = DeviceLoader(numbered_dataset(n), BatchSampler(n, b, seed=7, drop_last=False), device, placement=placement,
                      prefetch=prefetch)
    lo.chunk_rows = chunk_rows
    lo.set_epoch(3)
    return lo


@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_cuda_batches_equal_cpu_batches_and_resume(placement, prefetch):
    expected = [rows_of(x) for x in _loader("cpu", "host")]
    lo = _loader("cuda", placement, prefetch=prefetch)
    assert lo.placement == placement
    got = []
    for x in itertools.islice(lo, 11):
        assert x.x_num.is_cuda and x.x_cat.dtype == torch.int32
        # Work on the compute stream while later copies run, as a training step would.
        got.append(rows_of(x))
    resumed = _loader("cuda", placement, prefetch=prefetch)
    resumed.load_state_dict(lo.state_dict())
    kept = list(resumed)  # all kept at once: no batch's memory may be reused under it
    torch.cuda.synchronize()
    got += [rows_of(x) for x in kept]
    assert got == expected


def test_pinned_ring_buffers_are_pinned_and_reused():
    lo = _loader("cuda", "host")
    list(lo)
    assert lo._ring is not None and len(lo._ring) == lo.prefetch + 1
    assert all(buf.is_pinned() for buf, _ in lo._ring)
