"""Dataset, sampler and loader properties: shapes, every row once, equal steps, determinism, resume."""

import itertools

import numpy as np
import pytest
import torch

from helpers import contiguous_sizes, numbered_dataset, rows_of
from pipeline.feed.dataset import Batch, TabularDataset
from pipeline.feed.plan import holdout_mask
from pipeline.errors import PipelineError
from pipeline.feed.loader import DeviceLoader
from pipeline.feed.sampler import BatchSampler


def make_loader(n, batch, *, seed=0, shuffle=True, drop_last=False, rank=0, sizes=None, first_id=0):
    ds = numbered_dataset(n, first_id=first_id)
    s = BatchSampler(n, batch, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank, rank_sizes=sizes)
    return DeviceLoader(ds, s, "cpu")


def test_batch_shapes_and_dtypes():
    x, c, y = np.random.rand(100, 5), np.random.randint(0, 2**31 - 1, (100, 3)), np.random.rand(100)
    ds = TabularDataset.from_numpy(x, c, y)
    b = next(iter(DeviceLoader(ds, BatchSampler(100, 32, shuffle=False), "cpu")))
    assert isinstance(b, Batch)
    assert b.x_num.shape == (32, 5) and b.x_num.dtype == torch.float32
    assert b.x_cat.shape == (32, 3) and b.x_cat.dtype == torch.int32
    assert b.y.shape == (32,) and b.y.dtype == torch.float32
    # Values survive packing exactly, ids included (int32 bit patterns inside the float32 rows).
    np.testing.assert_array_equal(b.x_num.numpy(), x[:32].astype(np.float32))
    np.testing.assert_array_equal(b.x_cat.numpy(), c[:32])
    np.testing.assert_array_equal(b.y.numpy(), y[:32].astype(np.float32))
    # The three parts are views of one gathered tensor: one gather, one copy to the device.
    assert b.x_num.untyped_storage().data_ptr() == b.y.untyped_storage().data_ptr()
    assert b.w is None and all(t.is_contiguous() for t in b.contiguous()[:3])


@pytest.mark.parametrize("n,batch", [(1, 1), (10, 3), (100, 10), (1000, 64), (4097, 256)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_one_epoch_yields_every_row_exactly_once(n, batch, shuffle):
    loader = make_loader(n, batch, shuffle=shuffle)
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = [r for b in loader for r in rows_of(b)]
        assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n,batch", [(10, 4), (1000, 32), (1001, 100), (37, 8)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_run_equal_steps_and_cover_every_row(world, n, batch, drop_last):
    sizes = contiguous_sizes(n, world)
    starts = np.cumsum([0, *sizes])
    if min(sizes) == 0 or (drop_last and min(sizes) < batch):
        with pytest.raises(PipelineError, match="no rows|no full batch"):
            make_loader(sizes[0], batch, drop_last=drop_last, rank=0, sizes=sizes)
        return
    per_rank = []
    for r in range(world):
        loader = make_loader(sizes[r], batch, drop_last=drop_last, rank=r, sizes=sizes, first_id=int(starts[r]))
        per_rank.append([rows_of(b) for b in loader])
    steps = {len(p) for p in per_rank}
    assert len(steps) == 1, f"unequal steps per rank: {[len(p) for p in per_rank]}"
    seen = [r for p in per_rank for b in p for r in b]
    if drop_last:
        assert len(seen) == len(set(seen)), "a row was repeated"
        assert n - len(seen) <= world * batch - 1
        assert all(len(b) == batch for p in per_rank for b in p)
    else:
        assert set(seen) == set(range(n)), "a row was skipped"
        # Padding only repeats rows of the smaller ranks, up to the largest rank's size.
        assert len(seen) == world * max(sizes)


def test_order_is_a_pure_function_of_seed_epoch_rank():
    def order(seed, epoch, rank):
        loader = make_loader(500, 50, seed=seed, rank=rank, sizes=[500, 500])
        loader.set_epoch(epoch)
        return [r for b in loader for r in rows_of(b)]

    assert order(1, 0, 0) == order(1, 0, 0)
    assert order(1, 0, 0) != order(1, 1, 0)
    assert order(1, 0, 0) != order(2, 0, 0)
    assert order(1, 0, 0) != order(1, 0, 1)


@pytest.mark.parametrize("stop_after", [0, 1, 7, 19, 20])
def test_resume_mid_epoch_continues_exactly(stop_after):
    full = make_loader(1000, 50, seed=3)
    full.set_epoch(2)
    expected = [rows_of(b) for b in full]
    first = make_loader(1000, 50, seed=3)
    first.set_epoch(2)
    got = [rows_of(b) for b in itertools.islice(first, stop_after)]
    state = first.state_dict()
    resumed = make_loader(1000, 50, seed=3)
    resumed.load_state_dict(state)
    if stop_after == len(full):
        assert state["epoch"] == 3 and state["step"] == 0
        return
    got += [rows_of(b) for b in resumed]
    assert got == expected


def test_resume_refuses_other_data_or_settings():
    state = make_loader(1000, 50, sizes=[1000, 1000]).state_dict()
    with pytest.raises(PipelineError, match="train_rows=2000 but this run has 3000"):
        make_loader(1000, 50, sizes=[1000, 1000, 1000]).load_state_dict(state)  # other data
    with pytest.raises(PipelineError, match="batch_size"):
        make_loader(1000, 40, sizes=[1000, 1000]).load_state_dict(state)


def test_empty_rank_is_refused_clearly():
    with pytest.raises(PipelineError, match="received no rows"):
        BatchSampler(5, 2, rank=0, rank_sizes=[5, 0])


def test_gather_into_preallocated_buffers_matches_plain_gather():
    ds = numbered_dataset(300)
    out = ds.alloc_batch(64)
    idx = torch.randperm(300)[:64]
    plain = ds.get_batch(idx)
    into = ds.get_batch(idx, out=out)
    assert into.x_num.data_ptr() == out.data_ptr()
    assert rows_of(ds.get_batch(idx[:10], out=out)) == idx[:10].tolist()  # a short last batch
    for a, b in zip(plain[:3], into[:3]):
        assert torch.equal(a, b)
    assert plain.w is None and into.w is None


def test_getitems_serves_torch_dataloader_whole_batches():
    ds = numbered_dataset(103)
    sampler = BatchSampler(103, 10, drop_last=False)
    dl = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=lambda b: b)
    seen = [r for b in dl for r in rows_of(b)]
    assert sorted(seen) == list(range(103))


def test_holdout_split_is_independent_of_sharding():
    ids = np.arange(100_000)
    mask = holdout_mask(ids, 0.1, seed=0)
    assert 0.09 < mask.mean() < 0.11
    parts = np.concatenate([holdout_mask(p, 0.1, 0) for p in np.array_split(ids, 7)])
    np.testing.assert_array_equal(parts, mask)
    assert not np.array_equal(holdout_mask(ids, 0.1, 1), mask)


def packed_parts(starts, k=10):
    """Packed blocks of a numbered dataset (row i holds i in every slot), one per start."""
    full = numbered_dataset(max(starts) + k)
    return [(full.rows[s:s + k].numpy(), np.arange(s, s + k)) for s in starts], full.layout


def test_from_parts_restores_row_order():
    parts, layout = packed_parts(np.random.default_rng(0).permutation(np.arange(0, 100, 10)))
    ds = TabularDataset.from_parts(parts, layout)
    assert ds.row_id.tolist() == list(range(100))
    assert ds.x_num[:, 0].tolist() == list(range(100)) and rows_of(ds.get_batch(torch.arange(100))) == list(range(100))


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_loader_same_rows_as_device_loader_and_resumes(workers):
    n, b = 1000, 64
    ref = make_loader(n, b, seed=5)
    ref.set_epoch(1)
    expected = [rows_of(x) for x in ref]
    from pipeline.feed.loader import WorkerLoader

    wl = WorkerLoader(numbered_dataset(n), BatchSampler(n, b, seed=5, drop_last=False), num_workers=workers,
                      persistent_workers=False)
    wl.set_epoch(1)
    got = [rows_of(x) for x in itertools.islice(wl, 5)]
    state = wl.state_dict()
    assert state["step"] == 5  # delivered batches, not those the workers prefetched
    wl2 = WorkerLoader(numbered_dataset(n), BatchSampler(n, b, seed=5, drop_last=False), num_workers=workers,
                       persistent_workers=False)
    wl2.load_state_dict(state)
    got += [rows_of(x) for x in wl2]
    assert got == expected


def _double_labels(batch):
    return batch._replace(y=batch.y * 2)


def test_worker_loader_runs_the_transform_in_workers():
    from pipeline.feed.loader import WorkerLoader

    wl = WorkerLoader(numbered_dataset(100), BatchSampler(100, 10, shuffle=False), transform=_double_labels,
                      num_workers=2, persistent_workers=False)
    first = next(iter(wl))
    assert first.y.tolist() == [2.0 * i for i in range(10)]


@pytest.mark.parametrize("chunk_rows", [1, 50, 64, 130, 10_000])
@pytest.mark.parametrize("drop_last", [True, False])
def test_chunked_gathers_deliver_the_same_batches_and_resume_mid_chunk(chunk_rows, drop_last):
    """Batches gathered several at a time are exactly the batches of the order, whatever the chunk
    size (smaller than a batch, not a multiple of it, larger than the epoch); a state taken in the
    middle of a chunk resumes at the next batch; and a batch the caller keeps is never overwritten."""
    n, b = 1003, 64
    ref = BatchSampler(n, b, seed=4, drop_last=drop_last)
    ref.set_epoch(1)
    expected = [idx.tolist() for idx in ref]

    def loader():
        lo = make_loader(n, b, seed=4, drop_last=drop_last)
        lo.chunk_rows = chunk_rows
        lo.set_epoch(1)
        return lo

    first = loader()
    kept = list(itertools.islice(first, 5))
    state = first.state_dict()
    assert state["epoch"] == 1 and state["step"] == 5
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)  # every batch kept until all chunks were gathered: none may be overwritten
    assert [rows_of(x) for x in kept + rest] == expected


def test_last_index_names_the_rows_of_the_batch_just_delivered():
    loader = make_loader(1003, 64, seed=2)
    loader.chunk_rows = 200  # chunks of three batches: crosses chunk boundaries and the short last batch
    for batch in loader:
        assert loader.last_index.tolist() == rows_of(batch)


def test_spilled_dataset_is_file_backed_and_serves_the_same_batches(tmp_path):
    import gc

    from pipeline.feed.dataset import alloc_rows

    parts, layout = packed_parts(range(0, 500, 50), 50)
    mem = TabularDataset.from_parts(parts, layout)
    disk = TabularDataset.from_parts(parts, layout, spill_dir=str(tmp_path))
    mask = torch.from_numpy(holdout_mask(np.arange(500), 0.2, 0))
    train, val = disk.subset(~mask), disk.subset(mask)

    def mapped():
        with open("/proc/self/maps") as f:
            return [ln for ln in f if str(tmp_path) in ln]

    assert mapped() and all("(deleted)" in ln for ln in mapped())  # mapped files, already unlinked
    assert not list(tmp_path.iterdir())  # nothing left on disk to clean up
    assert train.spill_dir == val.spill_dir == str(tmp_path)
    for a, b in zip((mem.subset(~mask), mem.subset(mask)), (train, val)):
        la = DeviceLoader(a, BatchSampler(len(a), 32, seed=1, drop_last=False))
        lb = DeviceLoader(b, BatchSampler(len(b), 32, seed=1, drop_last=False))
        assert [rows_of(x) for x in la] == [rows_of(x) for x in lb]
    del disk, train, val, a, b, la, lb
    gc.collect()
    assert not mapped()  # the mappings go with the tensors
    with pytest.raises(PipelineError, match="cannot reserve"):
        alloc_rows(1 << 40, 8, spill_dir=str(tmp_path))  # 32 TiB: no disk has room


def test_loader_state_is_the_same_on_every_rank_and_loads_on_any():
    sizes = [300, 301, 299]
    loaders = [make_loader(sizes[r], 20, rank=r, sizes=sizes, drop_last=True) for r in range(3)]
    for lo in loaders:
        for _ in itertools.islice(iter(lo), 4):
            pass
    states = [lo.state_dict() for lo in loaders]
    assert states[0] == states[1] == states[2] and "rank" not in states[0]
    fresh = make_loader(sizes[2], 20, rank=2, sizes=sizes, drop_last=True)
    fresh.load_state_dict(states[0])  # rank 0's checkpoint resumes rank 2 where it stopped
    expected = make_loader(sizes[2], 20, rank=2, sizes=sizes, drop_last=True)
    assert [rows_of(b) for b in fresh] == [rows_of(b) for b in itertools.islice(iter(expected), 4, None)]
