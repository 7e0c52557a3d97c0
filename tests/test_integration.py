"""The Ray side on a local Ray: distributed fit, transform parity with serving, the whole job."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import make_config
from pipeline import preprocess, source, storage, train
from pipeline.preprocess import FittedPreprocessor, PartialStats, partial_stats

pytestmark = pytest.mark.ray


def local_fit(cfg, paths):
    total = PartialStats()
    for p in paths:
        total = total.merge(partial_stats(pq.read_table(p), list(cfg.data.numeric), list(cfg.data.categorical), "label"))
    pp = cfg.preprocess
    return FittedPreprocessor.from_stats(total, cfg.data.numeric, cfg.data.categorical, "label",
                                         max_size=pp.vocab_max_size, min_count=pp.vocab_min_count,
                                         missing_indicator=pp.missing_indicator)


def test_distributed_fit_equals_single_process_fit(ray_local, demo_dir):
    cfg = make_config(demo_dir)
    src = source.inspect(cfg)
    assert src.num_rows == 24_000 and len(src.shards) == 4
    dist, acct = preprocess.fit(src, cfg)
    assert acct.balanced and acct.rows_used == 24_000 and not acct.quarantined
    ref = local_fit(cfg, [s.path for s in src.shards])
    np.testing.assert_allclose(dist.mean, ref.mean, rtol=1e-12)
    np.testing.assert_allclose(dist.std, ref.std, rtol=1e-10)
    assert dist.vocab == ref.vocab and dist.indicators == ref.indicators
    assert dist.stats["rows"] == 24_000


def test_training_path_arrays_equal_serving_path(ray_local, demo_dir, tmp_path):
    cfg = make_config(demo_dir)
    src = source.inspect(cfg)
    fitted, acct = preprocess.fit(src, cfg)
    fitted.save(str(tmp_path / "p.json"))
    rows = preprocess.transform_dataset(src, fitted, cfg, acct).take_all()
    assert sorted(r["row_id"] for r in rows) == list(range(src.num_rows))  # every row once
    rows.sort(key=lambda r: r["row_id"])
    served = FittedPreprocessor.load(str(tmp_path / "p.json")).transform(
        pq.read_table([s.path for s in src.shards][0]).to_pandas())
    n0 = src.shards[0].num_rows
    np.testing.assert_array_equal(np.stack([r["x_num"] for r in rows[:n0]]), served.x_num)
    np.testing.assert_array_equal(np.stack([r["x_cat"] for r in rows[:n0]]), served.x_cat)


@pytest.mark.slow
def test_whole_job_learns_and_saves_everything(ray_local, demo_dir, tmp_path):
    cfg = make_config(demo_dir, **{"run.output": str(tmp_path / "runs"), "train.epochs": 3, "train.batch_size": 256,
                                   "train.num_workers": 2, "train.hidden": [64, 32]})
    summary = train.run(cfg)
    epochs = summary["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert epochs[-1]["val_acc"] > epochs[-1]["baseline_acc"] + 0.05, epochs[-1]
    for e in epochs:
        assert 0 <= e["data_wait_pct"] <= 100 and e["rows_per_s"] > 0
    # Row accounting: every training row is used once per epoch, apart from the reported remainder.
    val_rows = epochs[0]["val_rows"]
    assert 0 < val_rows < 24_000 * 0.2
    assert 24_000 - val_rows - epochs[0]["rows"] < 2 * 256
    run = summary["run"]
    saved = FittedPreprocessor.load(storage.join(run, "preprocessor.json"))
    with open(os.path.join(summary["checkpoint"], "preprocessor.json")) as f:
        assert FittedPreprocessor.from_dict(json.load(f)) == saved
    state = torch.load(os.path.join(summary["checkpoint"], "state.pt"), weights_only=False)
    assert {"model", "optimizer", "loader", "history"} <= state.keys()
    assert state["loader"]["epoch"] == 3 and state["loader"]["step"] == 0
    assert storage.read_json(storage.join(run, "metrics.json"))["rows_read"] == 24_000


@pytest.mark.slow
def test_rows_memory_mapped_from_disk_train_exactly_as_in_memory(ray_local, demo_dir, tmp_path):
    """loader.spill = always: each rank's rows live in a memory-mapped (already unlinked) file on local
    disk; the run is the same, loss for loss, and nothing is left in the spill directory."""
    spill = tmp_path / "spill"
    common = {"train.epochs": 1, "train.batch_size": 256, "train.num_workers": 2, "train.hidden": [32]}
    mem = train.run(make_config(demo_dir, **{"run.output": str(tmp_path / "a"), **common, "loader.spill": "never"}))
    disk = train.run(make_config(demo_dir, **{"run.output": str(tmp_path / "b"), **common, "loader.spill": "always",
                                              "loader.spill_dir": str(spill)}))
    for key in ("train_loss", "val_loss", "val_acc", "rows"):
        assert disk["epochs"][0][key] == mem["epochs"][0][key], key
    assert spill.is_dir() and not list(spill.iterdir())
