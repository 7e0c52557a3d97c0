"""A run that loses or gains ranks goes on: a loader state saved at any step of an epoch on W1 ranks
resumes on any W2 (and again on W3), and across all ranks the epoch delivers every row exactly once
(less the documented drop_last remainder, under W2 x batch rows), with equal steps on every rank; the
resumed order is a pure function of the state and W2; the next epoch is the plain W2 epoch. Global
shuffle: global batch k is the same rows on any world size with the same global batch size."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

import pipeline
from conftest import make_config
from helpers import numbered_dataset, rows_of
from pipeline.feed.loader import DeviceLoader
from pipeline.feed.plan import rank_bounds, rank_sizes
from pipeline.feed.sampler import BatchSampler, resume_span, upgrade


def loaders(n: int, world: int, batch: int, *, global_: bool, drop_last: bool, state=None, seed: int = 3):
    """The W loaders rank_data would make for `world` ranks over rows 0..n-1 (row i holds i), each
    rank's dataset the span it needs to go on from `state`."""
    sizes = rank_sizes(n, world)
    out = []
    for r in range(world):
        span = resume_span(state, n, world, r, global_rows=global_) if state else None
        lo, hi = (0, n) if global_ else span or rank_bounds(n, world, r)
        s = BatchSampler(sizes[r], batch, seed=seed, drop_last=drop_last, rank=r, rank_sizes=sizes,
                         global_rows=n if global_ else None, offset=lo, dataset_rows=hi - lo)
        loader = DeviceLoader(numbered_dataset(hi - lo, first_id=lo), s, "cpu")
        if state:
            loader.load_state_dict(state)
        out.append(loader)
    return out


def run(ls, epoch: int | None = None, steps: int | None = None) -> list[list[int]]:
    """Rows each rank's loader delivers (all of the epoch, or `steps` batches), ranks in lock step."""
    if epoch is not None:
        for loader in ls:
            loader.set_epoch(epoch)
    assert len({len(loader) for loader in ls}) == 1  # equal steps on every rank
    its = [iter(loader) for loader in ls]
    got = [[] for _ in ls]
    for _ in range(len(ls[0]) - ls[0].sampler.step if steps is None else steps):
        for r, it in enumerate(its):
            got[r] += rows_of(next(it))
    return got


def check_epoch(seen: list[int], n: int, world_last: int, batch: int, drop_last: bool, worlds) -> None:
    if drop_last:
        assert len(seen) == len(set(seen))  # each row at most once
        assert n - len(seen) < world_last * batch  # only the last segment's remainder is left out
    else:
        assert set(seen) == set(range(n))  # every row; ranks with fewer rows revisit a few (padding)
        assert len(seen) - n < sum(worlds) * batch


CASES = [(w1, w2) for w1, w2 in itertools.product([1, 2, 3, 4], repeat=2) if w1 != w2]


@pytest.mark.parametrize("global_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("w1,w2", CASES)
def test_a_state_saved_on_w1_ranks_resumes_on_w2_with_every_row_once(w1, w2, global_, drop_last):
    n, batch, epoch = 997, 8, 2
    first = loaders(n, w1, batch, global_=global_, drop_last=drop_last)
    k = random.Random(n + w1 * 10 + w2).randrange(1, len(first[0]))
    before = run(first, epoch, steps=k)
    state = first[0].state_dict()
    assert all(other.state_dict() == state for other in first)  # the same dict on every rank
    assert state["epoch"] == epoch and state["segments"] == [[w1, k]] and state["position"] == w1 * k * batch
    after = run(loaders(n, w2, batch, global_=global_, drop_last=drop_last, state=state))
    check_epoch([x for p in before + after for x in p], n, w2, batch, drop_last, (w1, w2))
    again = run(loaders(n, w2, batch, global_=global_, drop_last=drop_last, state=state))
    assert again == after  # a pure function of the state and W2
    # the next epoch is the plain W2 epoch
    resumed = loaders(n, w2, batch, global_=global_, drop_last=drop_last, state=state)
    run(resumed)
    fresh = loaders(n, w2, batch, global_=global_, drop_last=drop_last)
    assert [rows_of_epoch for rows_of_epoch in run(resumed)] == run(fresh, epoch + 1)


@pytest.mark.parametrize("global_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("worlds", [(2, 3, 1), (3, 1, 4), (4, 2, 2), (1, 4, 3, 2)])
def test_repeated_resizes_within_one_epoch_still_deliver_every_row_once(worlds, global_):
    n, batch, drop_last = 1201, 6, True
    rng = random.Random(sum(worlds))
    state, seen = None, []
    for i, w in enumerate(worlds):
        ls = loaders(n, w, batch, global_=global_, drop_last=drop_last, state=state)
        if state is None:
            for loader in ls:
                loader.set_epoch(1)
        last = i == len(worlds) - 1
        left = len(ls[0]) - ls[0].sampler.step
        got = run(ls) if last else run(ls, steps=rng.randrange(1, left))
        seen += [x for p in got for x in p]
        state = ls[0].state_dict()
    check_epoch(seen, n, worlds[-1], batch, drop_last, worlds)
    assert state["epoch"] == 2 and state["segments"] == []


@pytest.mark.parametrize("global_", [False, True], ids=["local", "global"])
def test_len_is_the_delivered_segment_even_when_the_sampler_ran_ahead(global_):
    """A resumed segment is shorter than a plain epoch. The loader gathers whole chunks ahead (here the
    whole segment at once), so its sampler is in the next epoch before the segment's last batch is
    delivered: len(loader) must still count the delivered segment, or a loop checkpointing at
    `step < len(loader)` saves a 'mid-epoch' state that is really the next epoch's start (the elastic
    run that lost an epoch's metrics)."""
    n, batch = 1000, 10
    first = loaders(n, 2, batch, global_=global_, drop_last=True)
    run(first, 1, steps=20)
    loader = loaders(n, 1, batch, global_=global_, drop_last=True, state=first[0].state_dict())[0]
    plain = len(loaders(n, 1, batch, global_=global_, drop_last=True)[0])
    segment = len(loader)
    assert segment < plain
    seen = []
    for k, _ in enumerate(loader, 1):
        assert loader.sampler.epoch == 2  # ran ahead: the whole segment is one gather
        assert len(loader) == segment and loader.delivered == k
        seen.append(loader.state_dict())
    assert k == segment
    assert [s["epoch"] for s in seen] == [1] * (segment - 1) + [2]
    assert len(loader) == plain  # between epochs: the next one's


def test_the_same_world_size_goes_on_exactly_as_an_uninterrupted_run():
    n, batch, world = 1000, 10, 3
    whole = run(loaders(n, world, batch, global_=False, drop_last=True), 4)
    first = loaders(n, world, batch, global_=False, drop_last=True)
    part = run(first, 4, steps=7)
    rest = run(loaders(n, world, batch, global_=False, drop_last=True, state=first[0].state_dict()))
    assert [a + b for a, b in zip(part, rest)] == whole


def test_global_batch_k_is_the_same_rows_on_any_world_size_with_the_same_global_batch():
    n, global_batch = 1000, 24
    batches = {}
    for world in (1, 2, 3, 4, 6):
        ls = loaders(n, world, global_batch // world, global_=True, drop_last=True)
        got = run(ls, 5)
        per_step = len(got[0]) // (global_batch // world)
        b = global_batch // world
        batches[world] = [sorted(x for r in range(world) for x in got[r][k * b:(k + 1) * b]) for k in range(per_step)]
    assert all(v == batches[1] for v in batches.values())


def test_a_rank_without_its_resume_span_is_told_what_to_do():
    n, batch = 600, 5
    first = loaders(n, 2, batch, global_=False, drop_last=True)
    run(first, 0, steps=10)
    state = first[0].state_dict()
    plain = loaders(n, 3, batch, global_=False, drop_last=True)  # their blocks only, not the spans
    for loader in plain:
        loader.load_state_dict(state)
    with pytest.raises(pipeline.PipelineError, match="resume=state"):
        for loader in plain:  # at least one rank's part reaches past its block
            next(iter(loader))


def test_a_state_saved_before_segments_loads():
    old = {"epoch": 1, "step": 4, "seed": 3, "batch_size": 8, "shuffle": True, "drop_last": True,
           "rank_sizes": [500, 500], "global_rows": None}
    new = upgrade(old)
    assert new["segments"] == [[2, 4]] and new["train_rows"] == 1000 and new["global"] is False
    two = loaders(1000, 2, 8, global_=False, drop_last=True)
    run(two, 1, steps=4)
    assert run(loaders(1000, 2, 8, global_=False, drop_last=True, state=old)) == \
        run(loaders(1000, 2, 8, global_=False, drop_last=True, state=two[0].state_dict()))


# --- through the public API: prepare once, rank_data on any world size -----------------------------

@pytest.mark.parametrize("mode", ["local", "global"])
def test_rank_data_replans_for_another_world_size_and_resumes_exactly(demo_dir, mode):
    """One fit serves every world size: rank_data under W2 re-plans the shares from the fit (no new pass)
    and, given the state saved on W1 ranks, reads what the rest of the epoch deals each rank."""
    cfg = make_config(demo_dir, **{"train.shuffle": mode, "data.val_fraction": 0.0})
    plan = pipeline.prepare(config=cfg, world_size=2, use_ray=False)
    n, batch = plan.train_rows, 64

    def ids(data, steps=None):
        out, it = [], iter(data.loader)
        for _ in range(len(data.loader) - data.loader.sampler.step if steps is None else steps):
            next(it)
            out += data.train.row_id[data.loader.last_index].tolist()
        return out

    first = [pipeline.rank_data(plan, batch_size=batch, rank=r, world_size=2, device="cpu") for r in range(2)]
    seen = [x for d in first for x in ids(d, steps=40)]
    state = first[0].loader.state_dict()
    for w2 in (3, 1):
        resumed = [pipeline.rank_data(plan, batch_size=batch, rank=r, world_size=w2, device="cpu", resume=state)
                   for r in range(w2)]
        assert len({len(d.loader) for d in resumed}) == 1
        rest = [x for d in resumed for x in ids(d)]
        both = seen + rest
        assert len(both) == len(set(both)) and n - len(both) < w2 * batch  # every row once
        assert set(both) <= set(np.concatenate([d.train.row_id.numpy() for d in first]).tolist())
