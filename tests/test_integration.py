"""The Ray side on a local Ray: distributed fit, transform parity with serving, the whole job."""

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import pandas as pd

import pipeline
from conftest import make_config
from pipeline import storage
from pipeline.job import driver as train
from pipeline.feed.dataset import TabularDataset
from pipeline.feed.plan import holdout_mask
from pipeline.fit.preprocess import FittedPreprocessor

pytestmark = pytest.mark.ray


def test_distributed_fit_equals_single_process_fit(ray_local, demo_dir):
    cfg = make_config(demo_dir)
    on_ray = pipeline.prepare(config=cfg, use_ray=True, world_size=2)
    here = pipeline.prepare(config=cfg, use_ray=False, world_size=2)
    assert on_ray.source.num_rows == 24_000 and len(on_ray.source.shards) == 4
    acct = on_ray.accounting
    assert acct.balanced and acct.rows_used == 24_000 and not acct.quarantined
    assert on_ray.fitted == here.fitted  # bit-identical: the same partials, merged in the same order
    assert on_ray.train_shares == here.train_shares and on_ray.val_shares == here.val_shares
    # Against pandas over the training rows (the hold-out never leaks into the statistics).
    df = pd.concat([pq.read_table(s.path).to_pandas() for s in on_ray.source.shards], ignore_index=True)
    train = df[~holdout_mask(np.arange(len(df)), cfg.data.val_fraction, cfg.data.val_seed)]
    f = on_ray.fitted
    np.testing.assert_allclose(f.mean[:len(f.numeric)], train[list(f.numeric)].mean().to_numpy(), rtol=1e-10)
    np.testing.assert_allclose(f.std[:len(f.numeric)], train[list(f.numeric)].std(ddof=0).to_numpy(), rtol=1e-8)
    assert f.stats["rows"] == len(train)


def test_training_path_arrays_equal_serving_path(ray_local, demo_dir, tmp_path):
    from pipeline.cluster import ray_side

    plan = pipeline.prepare(config=make_config(demo_dir, **{"data.label": ["label", "segment", "spend"],
                                                            "data.passthrough": ["city"]}), world_size=1)
    plan.fitted.save(str(tmp_path / "p.json"))
    blocks = ray_side.share_dataset(plan.spec, plan.fitted, plan.pieces(0)).take_all()
    rows = {int(b["row_id"]): b["rows"] for b in blocks}
    city = {int(b["row_id"]): b["extra:city"] for b in blocks}
    assert len(rows) == plan.accounting.rows_used  # every usable row once
    shard = plan.source.shards[0]
    served = FittedPreprocessor.load(str(tmp_path / "p.json")).transform(pq.read_table(shard.path).to_pandas(),
                                                                        with_target=False)
    ids = [i for i in range(shard.num_rows) if i in rows]
    packed = torch.from_numpy(np.stack([rows[i] for i in ids]))
    batch = TabularDataset(packed, (plan.fitted.num_features, 4, 3, 0)).get_batch(torch.arange(len(ids)))
    np.testing.assert_array_equal(batch.x_num.numpy(), served.x_num[ids])
    np.testing.assert_array_equal(batch.x_cat.numpy(), served.x_cat[ids])
    assert [city[i] for i in ids] == [pq.read_table(shard.path)["city"][i].as_py() for i in ids]  # passed through


@pytest.mark.slow
@pytest.mark.parametrize("label,kind", [("label", "binary"), (["segment", "spend"], "several")])
def test_whole_job_learns_and_saves_everything(ray_local, demo_dir, tmp_path, label, kind):
    """Only data.label changes between them: the kind is detected, the head and loss follow it; with
    several targets (a multiclass and a regression one) one model learns them all and the job reports each
    beside its own baseline. A single multiclass or regression target: tests/test_model.py, in one process."""
    from pipeline.cli import summary_table

    cfg = make_config(demo_dir, **{"run.output": str(tmp_path / "runs"), "train.epochs": 3, "train.batch_size": 256,
                                   "train.num_workers": 2, "train.hidden": [64, 32], "data.label": label})
    summary = train.run(cfg)
    epochs = summary["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    last = epochs[-1]
    table = summary_table(summary)
    assert "nan" not in table, table
    if kind == "several":
        assert [(t["name"], t["kind"]) for t in summary["targets"]] == [("segment", "multiclass"), ("spend", "regression")]
        assert "segment:val_acc" in table and "spend:val_rmse" in table, table
        assert last["segment:val_acc"] > last["segment:baseline_acc"] + 0.05, last
        assert last["spend:val_rmse"] < 0.6 * last["spend:baseline_rmse"], last  # RMSE in the target's units
        assert last["metric"] == "val_acc" and last["val_acc"] == last["segment:val_acc"]  # the first target's
        # a row without a target is dropped, with its reason (the demo's spend has nulls)
        acct = summary["accounting"]
        assert acct["dropped_by_reason"] == {"null or NaN target in 'spend'": 24_000 - acct["rows_used"]}, acct
        return
    assert summary["targets"][0]["kind"] == kind
    assert last["metric"] == "val_acc" and last["val_acc"] > last["baseline_acc"] + 0.05, last
    # A CTR user reads AUC and log loss: both beside their baselines, in the table too.
    assert last["baseline_auc"] == 0.5 and last["val_auc"] > 0.75, last
    assert last["val_logloss"] < last["baseline_logloss"] - 0.1, last
    assert "val_auc" in table and "val_logloss" in table, table
    for e in epochs:
        assert 0 <= e["data_wait_pct"] <= 100 and e["rows_per_s"] > 0
    # Row accounting: every training row is used once per epoch, apart from the reported remainder.
    val_rows = epochs[0]["val_rows"]
    assert 0 < val_rows < 24_000 * 0.2
    assert 24_000 - val_rows - epochs[0]["rows"] < 2 * 256
    run = summary["run"]
    saved = FittedPreprocessor.load(storage.join(run, "preprocessor.json"))
    # the checkpoint is self-contained: its preprocessor.json and the vocabulary parts' folder beside it
    assert FittedPreprocessor.load(os.path.join(summary["checkpoint"], "preprocessor.json")) == saved
    folders = [n for n in os.listdir(summary["checkpoint"]) if n.startswith("vocab-")]
    assert len(folders) == 1 and any(n.endswith(".arrow") for n in os.listdir(os.path.join(summary["checkpoint"],
                                                                                            folders[0])))
    state = torch.load(os.path.join(summary["checkpoint"], "state.pt"), weights_only=False)
    assert {"model", "optimizer", "loader", "history"} <= state.keys()
    assert state["loader"]["epoch"] == 3 and state["loader"]["step"] == 0
    assert storage.read_json(storage.join(run, "metrics.json"))["rows_read"] == 24_000


SMALL_RUN = {"train.epochs": 1, "train.batch_size": 256, "train.num_workers": 2, "train.hidden": [32]}


@pytest.fixture(scope="module")
def baseline(ray_local, demo_dir, tmp_path_factory) -> dict:
    """One small run with the rows in memory and the workers started after the fit: what the run below,
    with rows memory-mapped from disk and workers started beside the fit, must equal, loss for loss."""
    out = tmp_path_factory.mktemp("baseline")
    return train.run(make_config(demo_dir, **{"run.output": str(out), **SMALL_RUN, "loader.spill": "never",
                                              "run.start_workers": "after_fit"}))


@pytest.mark.slow
def test_rows_memory_mapped_and_workers_started_beside_the_fit_train_exactly_as_the_baseline(ray_local, baseline,
                                                                                           demo_dir, tmp_path):
    """Two settings that must not change a run, in one run beside the baseline (rows in memory, workers
    started after the fit), loss for loss:
    - loader.spill = always: each rank's rows live in a memory-mapped (already unlinked) file on local
      disk, and nothing is left in the spill directory;
    - run.start_workers = beside_fit: Ray Train's workers start while the driver validates and fits, and
      take the plan from a PlanBox once it exists.
    A prepare that fails while the workers start raises its own one-paragraph error, and the early
    workers end by themselves."""
    import shutil
    import time

    from pipeline.errors import DataError

    spill = tmp_path / "spill"
    both = train.run(make_config(demo_dir, **{"run.output": str(tmp_path / "b"), **SMALL_RUN, "loader.spill": "always",
                                              "loader.spill_dir": str(spill), "run.start_workers": "beside_fit"}))
    for key in ("train_loss", "val_loss", "val_acc", "rows"):
        assert both["epochs"][0][key] == baseline["epochs"][0][key], key
    assert spill.is_dir() and not list(spill.iterdir())
    assert "plan and workers both ready" in both["time_to_first_step"]
    assert "plan and workers both ready" not in baseline["time_to_first_step"]

    bad = tmp_path / "bad"
    shutil.copytree(demo_dir, bad)
    (bad / "part-99999.parquet").write_bytes(b"")  # validation fails while the workers are starting
    with pytest.raises(DataError, match="part-99999.parquet"):
        train.run(make_config(str(bad), **{"run.output": str(tmp_path / "c"), **SMALL_RUN,
                                           "run.start_workers": "beside_fit"}))
    deadline = time.monotonic() + 120
    while ray_local.available_resources().get("CPU", 0) < ray_local.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "the workers started beside a failed fit still hold CPUs"
        time.sleep(0.5)


@pytest.mark.parametrize("ray_beside,workers_beside", [(False, False), (True, False), (False, True), (True, True)])
def test_time_line_stages_on_the_path_add_up_to_the_total(ray_beside, workers_beside):
    """Whatever overlapped (Ray's start with the fit, the workers' start with the fit), the stages on
    the path to the first step plus 'other' are the total, and each overlapped pair is said together."""
    from types import SimpleNamespace

    t0 = 1000.0
    ray_end = t0 + 1.0 + 3.0
    planned = t0 + 1.0 + (2.5 if ray_beside else 3.0 + 2.5)  # validate + fit after Ray, or beside it
    trainer = (ray_end + 0.1) if workers_beside else max(planned, ray_end) + 0.2
    loop = trainer + 7.0
    ready = max(loop, planned + 0.3) if workers_beside else loop
    clock = {"loop_start": loop, "plan_ready": ready, "data_ready": ready + 1.5, "first_step": ready + 2.5}
    timings = {"validate_s": 0.1, "fit_s": 2.4, "planned_at": planned, "trainer_started_at": trainer}
    if ray_beside:
        timings["ray_span"] = (t0 + 1.0, ray_end)
    line, fig = train.first_step_line(t0, 3.0, SimpleNamespace(timings=timings), [{"clock": clock}])
    assert fig["total_s"] == pytest.approx(clock["first_step"] - t0)
    assert fig["other (imports, config)"] == pytest.approx(1.0, abs=0.35), (line, fig)  # the 1 s before Ray
    assert ("beside validate" in line) == ray_beside and ("for both" in line) == (ray_beside or workers_beside), line
    assert line.startswith(f"[time] first training step {fig['total_s']:.1f}s"), line
