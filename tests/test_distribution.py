"""Sharding and order across ranks: disjoint shares whose union is every row, equal steps on every
rank whatever the file layout, order a pure function of (seed, epoch, rank, world), global shuffle."""

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_config
from helpers import numbered_dataset, rows_of
from pipeline.demo import _shard
from pipeline.feed.loader import DeviceLoader
from pipeline.feed.plan import plan_shares, rank_bounds, rank_sizes
from pipeline.feed.sampler import BatchSampler

LAYOUTS = {
    "fewer_files_than_ranks": [700],
    "one_huge_many_tiny": [2000] + [3] * 9,
    "empty_files": [0, 500, 0, 0, 321, 0],
    "even": [250] * 4,
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = {}
    for name, sizes in LAYOUTS.items():
        d = tmp_path_factory.mktemp(name)
        for i, n in enumerate(sizes):
            pq.write_table(_shard(n, 0, i) if n else _shard(1, 0, i).slice(0, 0), str(d / f"part-{i:03d}.parquet"),
                           row_group_size=200)
        out[name] = str(d)
    return out


_PLANS = {}


def collector():
    """([training parts], [validation parts]) and the sink that fills them."""
    out = ([], [])
    return out, lambda part, val: out[val].append(part) if len(part[1]) else None


def shares_through_ray(path, world, whole=False, val_fraction=0.0):
    """(training row ids, validation row ids) each rank receives from the real Ray Train split
    (DataConfig.configure) of the real data, each rank's tasks pinned to this (the only) node; checks
    every row was transformed there, and that a process reading its share without Ray gets the same."""
    import ray

    import pipeline
    from pipeline.cluster import local_side, ray_side

    key = (path, world, whole, val_fraction)
    if key not in _PLANS:
        _PLANS[key] = pipeline.prepare(config=make_config(path, **{"data.val_fraction": val_fraction,
                                                                   "train.shuffle": "global" if whole else "local"}),
                                       world_size=world)
    plan = _PLANS[key]
    node = ray.get_runtime_context().get_node_id()
    its = ray_side.data_config(plan, cpus_per_worker=0).configure({}, world, None, [node] * world)
    out = []
    for r, it in enumerate(its):
        (train, val), sink = collector()
        local, _ = ray_side.receive(it[ray_side.DATASET], sink)
        assert local == sum(len(p[1]) for p in train + val)  # transformed on the rank's node
        ids = [np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64) for parts in (train, val)]
        (l_train, l_val), sink = collector()
        local_side.read_share(plan, r, sink)
        for parts, ray_ids in zip((l_train, l_val), ids):  # the same rows, the same packed values, without Ray
            assert np.array_equal(np.concatenate([p[1] for p in parts]) if parts else np.empty(0), ray_ids)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in train]), np.concatenate([p[0] for p in l_train]))
        out.append(ids)
    return out, plan.source.num_rows


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("whole", [False, True])
def test_plan_shares_cuts_usable_rows_into_contiguous_ranges(world, whole):
    """Over fragments yielding varied numbers of usable rows (some none, after drops or quarantine),
    rank r's pieces are exactly positions [r*N/W, (r+1)*N/W) of the usable rows, in order."""
    from pipeline.read.files import Fragment

    rng = np.random.default_rng(world)
    frags, used, start = [], {}, 0
    for i in range(40):
        rows = int(rng.integers(0, 300))
        frags.append(Fragment(f"f{i}", 0, start, rows))
        used[start] = int(rng.integers(0, rows + 1)) if rng.random() > 0.2 else 0
        start += rows
    plan = plan_shares(frags, used, world, whole=whole)
    positions = []  # (fragment index, position among its usable rows) in global order
    for i, f in enumerate(frags):
        positions += [(i, k) for k in range(used[f.row_start])]
    n = len(positions)
    index = {f.row_start: i for i, f in enumerate(frags)}
    for r, pieces in enumerate(plan):
        got = [(index[p.fragment.row_start], k) for p in pieces for k in range(p.lo, p.hi)]
        lo, hi = (0, n) if whole else rank_bounds(n, world, r)
        assert got == positions[lo:hi]
        assert all(p.hi > p.lo for p in pieces)


@pytest.mark.ray
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_get_disjoint_equal_shares_covering_every_row(ray_local, layouts, layout):
    for world in (1, 2, 3, 4):
        shares, n = shares_through_ray(layouts[layout], world)
        shares = [train for train, _ in shares]
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1, (layout, world, sizes)
        assert sorted(np.concatenate(shares).tolist()) == list(range(n))  # disjoint, union = all
        assert sizes == rank_sizes(n, world)
        for r, s in enumerate(shares):  # contiguous range in global row order: a pure function of layout
            lo, hi = rank_bounds(n, world, r)
            assert s.tolist() == list(range(lo, hi))
        for drop_last in (True, False):
            batch = 16
            if drop_last and min(sizes) < batch:
                continue
            steps = {len(BatchSampler(sz, batch, rank=r, rank_sizes=sizes, drop_last=drop_last))
                     for r, sz in enumerate(sizes)}
            assert len(steps) == 1


@pytest.mark.ray
def test_global_mode_gives_every_rank_all_rows(ray_local, layouts):
    shares, n = shares_through_ray(layouts["even"], 3, whole=True, val_fraction=0.2)
    assert all(sorted(train.tolist()) == sorted(shares[0][0].tolist()) for train, _ in shares)
    vals = [val for _, val in shares]  # validation rows are still split, disjoint
    assert max(map(len, vals)) - min(map(len, vals)) <= 1
    assert sorted(np.concatenate([shares[0][0], *vals]).tolist()) == list(range(n))


@pytest.mark.ray
@pytest.mark.parametrize("world", [1, 3])
def test_validation_hold_out_is_split_evenly_and_disjoint(ray_local, layouts, world):
    shares, n = shares_through_ray(layouts["one_huge_many_tiny"], world, val_fraction=0.25)
    train = [t for t, _ in shares]
    val = [v for _, v in shares]
    for part in (train, val):
        assert max(map(len, part)) - min(map(len, part)) <= 1
    everything = np.concatenate(train + val)
    assert sorted(everything.tolist()) == list(range(n))
    assert 0.2 < sum(map(len, val)) / n < 0.3


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_global_shuffle_redeals_rows_every_epoch(world, drop_last):
    n, batch = 1003, 10
    sizes = rank_sizes(n, world)
    ds = numbered_dataset(n)

    def epoch_rows(epoch):
        per_rank = []
        for r in range(world):
            s = BatchSampler(sizes[r], batch, seed=4, rank=r, rank_sizes=sizes, global_rows=n, drop_last=drop_last)
            loader = DeviceLoader(ds, s, "cpu")
            loader.set_epoch(epoch)
            per_rank.append([x for b in loader for x in rows_of(b)])
        return per_rank

    e0, e1 = epoch_rows(0), epoch_rows(1)
    assert epoch_rows(0) == e0  # reproducible
    for rows in (e0, e1):
        flat = [x for p in rows for x in p]
        if drop_last:
            assert len(flat) == len(set(flat)) and n - len(flat) <= world * batch - 1
        else:
            assert set(flat) == set(range(n))
        assert len({len(p) for p in rows}) == 1 or not drop_last
    if world > 1:  # rows move between ranks from one epoch to the next
        assert set(e0[0]) != set(e1[0])


def test_order_is_identical_in_another_process():
    """Same (seed, epoch, rank, world) in a fresh interpreter gives the same order."""
    import subprocess
    import sys

    code = ("from pipeline.feed.sampler import BatchSampler;"
            "s=BatchSampler(1000, 10, seed=9, rank=1, rank_sizes=[1000, 1000]);"
            "s.set_epoch(3); print(s.order(3)[:50].tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    here = BatchSampler(1000, 10, seed=9, rank=1, rank_sizes=[1000, 1000]).order(3)[:50].tolist()
    assert out.strip() == str(here)
    assert here != BatchSampler(1000, 10, seed=9, rank=1, rank_sizes=[1000, 1000]).order(4)[:50].tolist()


@pytest.mark.ray
def test_users_own_datasets_are_kept_and_split_beside_the_plan(ray_local, layouts):
    import ray

    import pipeline
    from pipeline.cluster import ray_side

    own = ray.data.range(100)
    worker = pipeline.prepare(config=make_config(layouts["even"]), world_size=2)  # ranks read their own shares
    assert worker.trainer_kwargs(datasets={"extra": own}) == {"datasets": {"extra": own}}
    plan = pipeline.prepare(config=make_config(layouts["even"], **{"loader.read_share": "ray_data"}), world_size=2)
    kwargs = plan.trainer_kwargs(datasets={"extra": own})
    assert set(kwargs["datasets"]) == {"extra", ray_side.DATASET}
    node = ray.get_runtime_context().get_node_id()
    its = kwargs["dataset_config"].configure(kwargs["datasets"], 2, None, [node, node])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # split iterators are consumed together, as Ray Train's workers do
        extra = list(pool.map(lambda it: sorted(r["id"] for r in it["extra"].iter_rows()), its))
    assert sorted(extra[0] + extra[1]) == list(range(100)) and all(extra)  # split between the ranks, as Ray Train does
    # Elastic training restarted on 3 workers: the same fit re-planned for them, each its share
    three = kwargs["dataset_config"].configure(kwargs["datasets"], 3, None, [node] * 3)
    assert [three[r][ray_side.DATASET] is not None for r in range(3)] == [True] * 3
    with pytest.raises(pipeline.ConfigError, match="taken by the ingest plan"):
        plan.trainer_kwargs(datasets={ray_side.DATASET: ray.data.range(3)})
