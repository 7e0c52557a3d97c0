"""prepare(since=...): each increment plans exactly the rows its source gained (each format against its own
reader of the same range), the fit keeps every id it gave, and bad input is one paragraph. No Ray."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake

import pipeline
from pipeline.errors import DataError, PipelineError
from pipeline.read.increments import Range

SETTINGS = dict(label="y", numeric=["x"], categorical=["cat"], passthrough=["id", "x"], vocab_min_count=2,
                vocab_max_size=1_000_000, val_fraction=0.1)


def batch(lo: int, hi: int, seed: int = 0) -> pa.Table:
    """Rows with ids lo..hi-1; 'cat' is Zipf-like per block, so values appear in one block and again later."""
    ids = np.arange(lo, hi)
    rng = np.random.default_rng(seed + lo)
    cats = (rng.zipf(1.3, len(ids)) % 5000).astype(np.int64)
    return pa.table({"id": ids, "x": (ids % 97).astype(np.float64), "cat": pa.array([f"c{c}" for c in cats]),
                     "y": (ids % 3 == 0).astype(np.int64)})


def planned(plan, world: int = 2) -> list[int]:
    """Every row id the plan hands its ranks (training and validation), checking equal steps per rank."""
    if plan.empty:
        return []
    out, steps = [], set()
    for r in range(world):
        data = pipeline.rank_data(plan, batch_size=8, device="cpu", rank=r, world_size=world)
        steps.add(len(data.loader))
        for ds in (data.train, data.val):
            out += ds.extra["id"].tolist()
    assert len(steps) == 1, steps
    return sorted(out)


def ids_of(table: pa.Table) -> list[int]:
    return sorted(table["id"].to_pylist())


def kept(fitted) -> dict[str, int]:
    """The first categorical column's vocabulary: value -> id."""
    return {v: i + 1 for i, v in enumerate(fitted.vocab[0])}


def assert_extends(before, after) -> None:
    """Every value `before` kept keeps its id in `after`; new values take the next ids."""
    old, new = kept(before), kept(after)
    assert {v: new.get(v) for v in old} == old
    assert sorted(new.values()) == list(range(1, len(new) + 1))
    assert after.growth(before)["cat"] == (len(old) + 1, len(new) + 1)


# ---------------------------------------------------------------------------------------------
# A folder of Parquet files: a chain of increments


def write_shard(folder: Path, i: int, n: int = 2000) -> None:
    pq.write_table(batch(i * n, (i + 1) * n), folder / f"part-{i:03d}.parquet", row_group_size=700)


def test_a_chain_of_folder_increments_plans_every_row_once_and_keeps_every_id(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(2):
        write_shard(folder, i)
    plans = [pipeline.prepare(str(folder), world_size=2, **SETTINGS)]
    assert plans[0].fitted.history is not None
    seen = planned(plans[0])
    for k in range(2, 6):
        write_shard(folder, k)
        since = plans[-1]
        if k == 3:  # through a saved plan, and its vocabulary and count files beside it
            since = str(tmp_path / "plan.pkl")
            plans[-1].save(since)
        plan = pipeline.prepare(str(folder), since=since)
        assert plan.increment.after == str(k - 2) and plan.increment.upto == str(k - 1)
        assert f"rows added after version {k - 2} up to version {k - 1}" in plan.describe()[0]
        got = planned(plan)
        assert got == list(range(k * 2000, (k + 1) * 2000))
        seen += got
        assert_extends(plans[-1].fitted, plan.fitted)
        assert plan.fitted.mean == plans[0].fitted.mean  # numeric statistics kept by default
        plans.append(plan)
    assert seen == list(range(6 * 2000)) and len(set(seen)) == len(seen)
    # The kept set equals one fit's over every row; the lineage names each range.
    whole = pipeline.prepare(str(folder), world_size=2, **SETTINGS)
    assert set(kept(whole.fitted)) == set(kept(plans[-1].fitted))
    assert whole.fitted.stats["categorical"]["cat"]["distinct"] == plans[-1].fitted.stats["categorical"]["cat"]["distinct"]
    assert [(e["after"], e["upto"]) for e in plans[-1].fitted.lineage] == [(str(i), str(i + 1)) for i in range(4)]
    # Cross-increment counting mattered: some value kept now had one row in each of two increments.
    assert any(v not in kept(plans[i].fitted) for i in range(4) for v in kept(plans[i + 1].fitted))
    # Nothing new: an empty plan the caller tests; rank_data refuses it in one paragraph.
    empty = pipeline.prepare(str(folder), since=plans[-1])
    assert empty.empty and empty.train_rows == 0 and "nothing new after version 4" in empty.describe()[0]
    with pytest.raises(PipelineError, match="plan is empty"):
        pipeline.rank_data(empty, device="cpu")
    # The saved fitted state keeps its counts: an increment from a loaded preprocessor extends them.
    plans[-1].fitted.save(str(tmp_path / "fit" / "pre.json"))
    loaded = pipeline.FittedPreprocessor.load(str(tmp_path / "fit" / "pre.json"))
    assert loaded.history.values == plans[-1].fitted.history.values and loaded.lineage == plans[-1].fitted.lineage


def test_numeric_statistics_are_merged_only_when_asked(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder, 0)
    first = pipeline.prepare(str(folder), **SETTINGS)
    pq.write_table(batch(2000, 4000).set_column(1, "x", pa.array(np.full(2000, 500.0))), folder / "part-001.parquet")
    kept_scale = pipeline.prepare(str(folder), since=first)
    assert kept_scale.fitted.mean == first.fitted.mean and kept_scale.fitted.std == first.fitted.std
    merged = pipeline.prepare(str(folder), since=first, refit_numeric=True)
    whole = pipeline.prepare(str(folder), **SETTINGS)
    assert merged.fitted.mean == pytest.approx(whole.fitted.mean) and merged.fitted.std == pytest.approx(whole.fitted.std)


def test_a_folder_file_changed_or_gone_and_other_settings_are_refused(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder, 0)
    write_shard(folder, 1)
    first = pipeline.prepare(str(folder), **SETTINGS)
    with pytest.raises(PipelineError, match=r"preprocess.vocab_min_count = 2 then, 3 now"):
        pipeline.prepare(str(folder), since=first, vocab_min_count=3)
    with pytest.raises(PipelineError, match="parquet source"):
        pipeline.prepare(str(tmp_path), since=first)
    pq.write_table(batch(0, 1500), folder / "part-000.parquet")
    with pytest.raises(DataError, match=r"part-000.parquet' was planned with .* bytes and now has"):
        pipeline.prepare(str(folder), since=first)
    os.remove(folder / "part-000.parquet")
    with pytest.raises(DataError, match="part-000.parquet' was planned by the previous plan and is gone"):
        pipeline.prepare(str(folder), since=first)


# ---------------------------------------------------------------------------------------------
# Delta Lake


def delta_ids(path: str, version: int) -> set[int]:
    """The ids deltalake's own reader (DataFusion) returns for the version."""
    dt = DeltaTable(path, version=version)
    return set(pa.table(QueryBuilder().register("t", dt).execute("select id from t").read_all())["id"].to_pylist())


def test_delta_without_the_feed_reads_appended_files_and_skips_compaction_and_deletes(tmp_path):
    path = str(tmp_path / "delta")
    write_deltalake(path, batch(0, 1000))
    first = pipeline.prepare(path, **SETTINGS)
    write_deltalake(path, batch(1000, 1600), mode="append")  # v1
    DeltaTable(path).delete("id < 100")  # v2: old rows only (v0's file rewritten)
    DeltaTable(path).optimize.compact()  # v3: v0's and v1's files into one (dataChange false): v1's read as written
    write_deltalake(path, batch(1600, 2000), mode="append")  # v4
    plan = pipeline.prepare(path, since=first)
    assert (plan.increment.after, plan.increment.upto) == ("0", "4")
    want = sorted(delta_ids(path, 4) - delta_ids(path, 0))  # append-only here: the reader's gained rows
    assert planned(plan) == want == list(range(1000, 2000))
    assert any("OPTIMIZE" in n for n in plan.increment.notes) and any("DELETE" in n for n in plan.increment.notes)
    assert_extends(first.fitted, plan.fitted)
    # A compaction alone, or a delete alone, adds nothing.
    DeltaTable(path).optimize.compact()
    DeltaTable(path).delete("id < 200")
    nothing = pipeline.prepare(path, since=plan)
    assert nothing.empty and nothing.increment.after == "4"
    # A delete of rows the range added cannot be told apart without the feed.
    write_deltalake(path, batch(2000, 2300), mode="append")
    DeltaTable(path).delete("id >= 2200")
    with pytest.raises(DataError, match="delta.enableChangeDataFeed"):
        pipeline.prepare(path, since=nothing)


def test_delta_update_without_the_feed_and_a_cleaned_log_are_refused(tmp_path):
    path = str(tmp_path / "delta")
    write_deltalake(path, batch(0, 500))
    first = pipeline.prepare(path, **SETTINGS)
    DeltaTable(path).update({"x": "x + 1"}, predicate="id < 10")
    with pytest.raises(DataError, match=r"UPDATE .*delta.enableChangeDataFeed = true.* without since=") as e:
        pipeline.prepare(path, since=first)
    assert "\n" not in str(e.value)
    # A file the range added, compacted away and then vacuumed: its rows cannot be read.
    vac = str(tmp_path / "vacuumed")
    write_deltalake(vac, batch(0, 300))
    before = pipeline.prepare(vac, **SETTINGS)
    write_deltalake(vac, batch(300, 400), mode="append")
    DeltaTable(vac).optimize.compact()
    DeltaTable(vac).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(DataError, match="no longer has the data file .* that version 1 added"):
        pipeline.prepare(vac, since=before)
    write_deltalake(path, batch(500, 600), mode="append")
    DeltaTable(path).create_checkpoint()  # then the log before it cleaned up, as a metadata cleanup does
    for v in (0, 1):
        os.remove(Path(path) / "_delta_log" / f"{v:020d}.json")
    with pytest.raises(DataError, match="no longer has the commit of version 1"):
        pipeline.prepare(path, since=first)


def test_delta_with_the_change_data_feed_reads_inserts_and_update_postimages(tmp_path):
    path = str(tmp_path / "delta")
    write_deltalake(path, batch(0, 800), configuration={"delta.enableChangeDataFeed": "true"})
    first = pipeline.prepare(path, **SETTINGS)
    write_deltalake(path, batch(800, 1200), mode="append")
    DeltaTable(path).update({"x": "x + 1000"}, predicate="id < 50")
    DeltaTable(path).delete("id >= 1150")
    plan = pipeline.prepare(path, since=first)
    feed = pa.table(DeltaTable(path).load_cdf(starting_version=1, ending_version=3))
    feed = feed.select(["id", "x"]).filter(pa.compute.is_in(feed["_change_type"].cast(pa.string()),
                                                             pa.array(["insert", "update_postimage"])))
    want = sorted(zip(feed["id"].to_pylist(), feed["x"].to_pylist()))
    data = pipeline.rank_data(plan, batch_size=8, device="cpu", rank=0, world_size=1)
    got = sorted((i, x) for ds in (data.train, data.val) for i, x in zip(ds.extra["id"].tolist(), ds.extra["x"].tolist()))
    assert got == want and len(got) == 400 + 50
    assert "change data feed" in plan.increment.how and (plan.increment.after, plan.increment.upto) == ("0", "3")
    assert_extends(first.fitted, plan.fitted)


# ---------------------------------------------------------------------------------------------
# Iceberg


@pytest.fixture()
def iceberg(tmp_path):
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    cat.create_namespace("ns")
    table = cat.create_table("ns.events", schema=batch(0, 1).schema)
    table.append(batch(0, 1000))
    return cat, "ns.events"


def test_iceberg_increments_read_append_snapshots_with_deletes_applied(iceberg):
    cat, name = iceberg
    table = cat.load_table(name)
    root = table.location().removeprefix("file://")
    first = pipeline.prepare(root, **SETTINGS)
    a = table.current_snapshot().snapshot_id
    table.append(batch(1000, 1500))
    table.delete("id < 100 or id >= 1450")  # a delete snapshot: old rows and rows of the range
    table.append(batch(1500, 1800))
    table.overwrite(batch(5000, 5100))
    table = cat.load_table(name)
    plan = pipeline.prepare(root, since=first)
    own = table.incremental_append_scan(from_snapshot_id_exclusive=a).to_arrow()
    assert planned(plan) == ids_of(own) and len(own) > 0
    assert any("adds no row" in n for n in plan.increment.notes)
    assert plan.increment.upto == str(table.current_snapshot().snapshot_id)
    assert_extends(first.fitted, plan.fitted)
    # A snapshot the table no longer has.
    gone = replace(plan, increment=Range("iceberg", plan.increment.name, "12345", "12345"))
    with pytest.raises(DataError, match="no longer has snapshot 12345"):
        pipeline.prepare(root, since=gone)


def test_iceberg_dropped_and_added_columns(iceberg):
    from pyiceberg.types import StringType

    cat, name = iceberg
    table = cat.load_table(name)
    root = table.location().removeprefix("file://")
    first = pipeline.prepare(root, **SETTINGS)
    with table.update_schema() as s:
        s.add_column("extra", StringType())
    table = cat.load_table(name)
    table.append(batch(1000, 1200).append_column("extra", pa.array(["e"] * 200)))
    plan = pipeline.prepare(root, since=first)
    assert planned(plan) == list(range(1000, 1200))
    assert any("extra were added to the table since the previous fit" in n for n in plan.increment.notes)
    assert any("not features until a full refit" in line for line in plan.describe())
    with table.update_schema() as s:
        s.delete_column("cat")
    table = cat.load_table(name)
    table.append(batch(1200, 1300).drop_columns(["cat"]).append_column("extra", pa.array(["e"] * 100)))
    with pytest.raises(DataError, match="column 'cat' of the previous fit is no longer in the iceberg table"):
        pipeline.prepare(root, since=plan)


# ---------------------------------------------------------------------------------------------
# On Ray: the fit tasks of an increment on the cluster; a previous fit made by the count shuffle kept
# no counts, so the first increment recounts its rows once, and the kept set is the same


def test_an_increment_fitted_on_ray_after_a_shuffled_fit_keeps_ids_and_the_kept_set(tmp_path, ray_local):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(2):
        write_shard(folder, i)
    first = pipeline.prepare(str(folder), use_ray=True, **SETTINGS)
    assert first.fitted.history is None
    write_shard(folder, 2)
    plan = pipeline.prepare(str(folder), since=first, use_ray=True)
    assert "recounted once" in plan.timings["fit_on"]
    assert planned(plan) == list(range(4000, 6000))
    assert_extends(first.fitted, plan.fitted)
    whole = pipeline.prepare(str(folder), use_ray=False, **SETTINGS)
    assert set(kept(whole.fitted)) == set(kept(plan.fitted))


def test_a_full_vocabulary_gives_no_new_id_and_says_how_many_rows_are_unknown(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder, 0)
    capped = {**SETTINGS, "vocab_max_size": 40, "vocab_min_count": 1}
    first = pipeline.prepare(str(folder), **capped)
    assert len(first.fitted.vocab[0]) == 40
    write_shard(folder, 1)
    plan = pipeline.prepare(str(folder), since=first)
    assert kept(plan.fitted) == kept(first.fitted) and plan.fitted.growth(first.fitted)["cat"] == (41, 41)
    share = plan.fitted.stats["categorical"]["cat"]["unknown_share"]
    whole = pipeline.prepare(str(folder), **capped)
    assert 0 < share and share >= whole.fitted.stats["categorical"]["cat"]["unknown_share"]
    assert any("40 of " in line and "unknown" in line for line in plan.describe())


def test_vocab_plus_hash_sends_what_a_full_vocabulary_leaves_out_to_its_buckets(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder, 0)
    hashed = {**SETTINGS, "vocab_max_size": 40, "vocab_min_count": 1,
              "settings": {"preprocess.columns": {"cat": {"encode": "vocab+hash", "buckets": 64}}}}
    first = pipeline.prepare(str(folder), **hashed)
    write_shard(folder, 1)
    plan = pipeline.prepare(str(folder), since=first)
    whole = pipeline.prepare(str(folder), **hashed)
    got, want = plan.fitted.stats["categorical"]["cat"], whole.fitted.stats["categorical"]["cat"]
    assert got["unknown_share"] == 0.0 and got["hashed_into"] == 64 and got["distinct"] == want["distinct"]
    assert got["hashed_share"] >= want["hashed_share"] > 0  # the kept 40 are the first block's, not the whole's
    assert any("hashed into 64 buckets" in line for line in plan.describe())
    t = pa.table({"cat": pa.array(["c1", "never-seen"]), "x": [1.0, 2.0]})
    ids = plan.fitted.transform(t, with_target=False).x_cat[:, 0]
    assert ids[0] == kept(first.fitted)["c1"] and ids[1] > 40  # a bucket id after the vocabulary


def test_a_delta_chain_plans_every_appended_row_once_on_any_world_size(tmp_path):
    path = str(tmp_path / "delta")
    write_deltalake(path, batch(0, 600))
    plans, seen = [pipeline.prepare(path, **SETTINGS)], list(range(600))
    steps = [lambda: write_deltalake(path, batch(600, 900), mode="append"),
             lambda: (DeltaTable(path).optimize.compact(), write_deltalake(path, batch(900, 1000), mode="append")),
             lambda: (DeltaTable(path).delete("id < 50"), write_deltalake(path, batch(1000, 1400), mode="append"))]
    for world, change in zip((2, 3, 1), steps):
        a = DeltaTable(path).version()
        change()
        plan = pipeline.prepare(path, since=plans[-1], world_size=world)
        got = planned(plan, world)
        assert got == sorted(delta_ids(path, DeltaTable(path).version()) - delta_ids(path, a))
        assert plan.increment.after == str(a)
        assert_extends(plans[-1].fitted, plan.fitted)
        seen += got
        plans.append(plan)
    assert seen == list(range(1400))


def test_an_increment_resumes_mid_epoch_on_another_world_size(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder, 0)
    first = pipeline.prepare(str(folder), **SETTINGS)
    write_shard(folder, 1)
    plan = pipeline.prepare(str(folder), since=first, world_size=2)
    kw = dict(batch_size=50, device="cpu", shuffle=True, drop_last=False)
    loaders = [pipeline.rank_data(plan, rank=r, world_size=2, **kw).loader for r in range(2)]
    for loader in loaders:
        loader.set_epoch(0)
        it = iter(loader)
        for _ in range(5):
            next(it)
    state = loaders[0].state_dict()
    assert state == loaders[1].state_dict()
    rest = pipeline.rank_data(plan, rank=0, world_size=1, resume=state, **kw)
    assert sum(len(b.y) for b in rest.loader) == plan.train_rows - 2 * 5 * 50  # the rest of the epoch, on one rank


def test_counts_in_memory_are_not_pickled_with_the_plan(tmp_path):
    import pickle

    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder, 0)
    plan = pipeline.prepare(str(folder), **SETTINGS)
    assert plan.fitted.history.partitions and plan.fitted.history.values > 0
    sent = pickle.loads(pickle.dumps(plan))  # as to Ray tasks and training workers: small, without counts
    assert sent.fitted.history.partitions == 0 and len(pickle.dumps(plan)) < len(pickle.dumps(plan.fitted.vocab)) + 20_000
    plan.save(str(tmp_path / "plan.pkl"))  # saved: the counts as files beside it
    assert pipeline.IngestPlan.load(str(tmp_path / "plan.pkl")).fitted.history.values == plan.fitted.history.values
    write_shard(folder, 1)
    again = pipeline.prepare(str(folder), since=sent)  # a full plan without its counts: recounted once
    assert "recounted once" in again.timings["fit_on"] and planned(again) == list(range(2000, 4000))
    write_shard(folder, 2)
    with pytest.raises(PipelineError, match="keeps no category counts"):
        pipeline.prepare(str(folder), since=pickle.loads(pickle.dumps(again)))
    sent.fitted.save(str(tmp_path / "worker" / "pre.json"))  # a training worker saves what it got: no counts
    assert pipeline.FittedPreprocessor.load(str(tmp_path / "worker" / "pre.json")).history is None
