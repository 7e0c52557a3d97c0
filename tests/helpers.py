"""Helpers shared by the loader, sampler and dataset tests."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.feed.dataset import TabularDataset


def numbered_dataset(n: int, features: int = 3, cats: int = 2, first_id: int = 0) -> TabularDataset:
    """Row i holds i in every column (exact in float32 below 2**24), so a batch tells which rows it has."""
    ids = np.arange(first_id, first_id + n)
    return TabularDataset.from_numpy(np.repeat(ids[:, None], features, 1).astype(np.float32),
                                     np.repeat(ids[:, None], cats, 1), ids.astype(np.float32), ids)


def demo_columns() -> dict:
    """The demo dataset's feature columns as config overrides (its other targets are not features)."""
    from pipeline.config import DEMO_CATEGORICAL, DEMO_NUMERIC

    return {"data.numeric": list(DEMO_NUMERIC), "data.categorical": list(DEMO_CATEGORICAL)}


def rows_of(batch) -> list[int]:
    """The row numbers in a batch of a numbered dataset, after checking every column agrees."""
    r = batch.y.long()
    assert torch.equal(batch.x_num.long(), r[:, None].expand_as(batch.x_num))
    assert torch.equal(batch.x_cat.long(), r[:, None].expand_as(batch.x_cat))
    return r.tolist()


def contiguous_sizes(n: int, world: int) -> list[int]:
    """Row counts of the contiguous split the training job uses (sizes differ by at most one)."""
    bounds = [n * r // world for r in range(world + 1)]
    return [bounds[r + 1] - bounds[r] for r in range(world)]


def expected_batches(n: int, world: int, batch: int, epochs: int, seed: int = 0, val_fraction: float = 0.1,
                     val_seed: int = 0):
    """An uninterrupted run's batches, computed without Ray: {(rank, epoch, step): row ids}, the
    ranks' training-row counts and the steps per epoch. The demo data has no row the quality screen
    drops, so the training rows are the row ids the hold-out keeps, and rank r owns positions
    [r*N/world, (r+1)*N/world) of them."""
    from pipeline.feed.plan import holdout_mask, rank_bounds
    from pipeline.feed.sampler import BatchSampler

    ids = np.arange(n, dtype=np.int64)
    train_ids = ids[~holdout_mask(ids, val_fraction, val_seed)]
    trains = [train_ids[slice(*rank_bounds(len(train_ids), world, r))] for r in range(world)]
    sizes = [len(t) for t in trains]
    out = {}
    for r, t in enumerate(trains):
        s = BatchSampler(len(t), batch, seed=seed, shuffle=True, drop_last=True, rank=r, rank_sizes=sizes)
        for e in range(epochs):
            s.set_epoch(e)
            for k, idx in enumerate(s, 1):
                out[(r, e, k)] = t[idx.numpy()]
    return out, sizes, s.steps


def fnv1a64(text: str) -> int:
    """64-bit FNV-1a of the UTF-8 text, written out here (the reference for pipeline's vectorised one)."""
    h = 0xcbf29ce484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def vocab_order(counts) -> list[str]:
    """The documented id order of a vocabulary: most rows first, ties by FNV-1a hash, then by text.
    counts: (value, rows) pairs."""
    return [v for v, _ in sorted(counts, key=lambda t: (-t[1], fnv1a64(t[0]), t[0]))]
