"""Delta Lake and Iceberg tables, written by the formats' own Python writers (deltalake, pyiceberg with
a SQL catalog on sqlite), read from their root folders: the rows the project trains on must be exactly
the rows the format's own reader returns for the same version, after overwrites, appends, deletes,
compaction and vacuum; never the folder's files.

No Ray here: prepare and rank_data read in this process (the Ray path reads the same fragments)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake

import pipeline
from pipeline.read import delta
from pipeline.errors import DataError, NoUsableRows, PipelineError


def batch(lo: int, hi: int) -> pa.Table:
    """Rows with ids lo..hi-1; 'cat' and 'y' are functions of the id, so a row is known by its id."""
    ids = np.arange(lo, hi)
    return pa.table({"id": ids, "x": (ids % 97).astype(np.float64), "cat": pa.array([f"c{i % 7}" for i in ids]),
                     "y": (ids % 3 == 0).astype(np.int64)})


def project_rows(path: str, **keys) -> list[tuple]:
    """(id, cat, y) of every row the project hands a single rank, training and validation together."""
    plan = pipeline.prepare(path, label="y", world_size=1, numeric=["x"], categorical=["cat"],
                            passthrough=["id", "cat", "y"], **keys)
    data = pipeline.rank_data(plan, batch_size=16, device="cpu")
    out = []
    for ds in (data.train, data.val):
        out += list(zip(ds.extra["id"].tolist(), ds.extra["cat"].tolist(), ds.extra["y"].tolist()))
    return sorted(out)


def own_rows(table: pa.Table) -> list[tuple]:
    return sorted(zip(table["id"].to_pylist(), [str(c) for c in table["cat"].to_pylist()], table["y"].to_pylist()))


def delta_rows(path: str, version: int | None = None) -> list[tuple]:
    """The rows deltalake's own reader (DataFusion) returns for the version."""
    dt = DeltaTable(path, version=version)
    return own_rows(pa.table(QueryBuilder().register("t", dt).execute("select id, cat, y from t").read_all()))


def parquet_rows_on_disk(path: str) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in Path(path).rglob("*.parquet"))


@pytest.fixture()
def delta_table(tmp_path) -> str:
    """Written, overwritten, appended to, then deleted from: the folder holds every version's files."""
    path = str(tmp_path / "delta")
    write_deltalake(path, batch(0, 1000))
    write_deltalake(path, batch(1000, 3000), mode="overwrite")
    write_deltalake(path, batch(3000, 3500), mode="append")
    DeltaTable(path).delete("id < 1100")
    return path


def test_a_delta_table_trains_on_exactly_its_current_rows(delta_table):
    assert parquet_rows_on_disk(delta_table) > 4000  # the old versions' rows are still on disk
    want = delta_rows(delta_table)
    got = project_rows(delta_table)
    assert len(want) == 2400 and got == want


def test_a_pinned_delta_version_reads_that_versions_rows(delta_table):
    for v in (0, 1, 2):
        assert project_rows(delta_table, version=str(v)) == delta_rows(delta_table, v)
    when = DeltaTable(delta_table).history()  # newest first; the timestamp of version 1's commit
    ts = next(h["timestamp"] for h in when if h["version"] == 1)
    import datetime as dt

    iso = dt.datetime.fromtimestamp(ts / 1000, dt.timezone.utc).isoformat()
    assert project_rows(delta_table, version=iso) == delta_rows(delta_table, 1)
    with pytest.raises(DataError, match="data.version = '99'"):
        project_rows(delta_table, version="99")


def test_compaction_and_vacuum_keep_the_rows_and_an_old_pinned_version_is_missing_files(delta_table):
    dt = DeltaTable(delta_table)
    dt.optimize.compact()
    dt = DeltaTable(delta_table)
    assert project_rows(delta_table) == delta_rows(delta_table)
    dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    assert project_rows(delta_table) == delta_rows(delta_table)
    # Version 1's files are gone: each is a bad file, named, and quarantine accounts for its rows.
    with pytest.raises(DataError, match="listed by the table's version but missing"):
        project_rows(delta_table, version="1")


def test_a_partitioned_delta_table_takes_partition_values_from_its_log(tmp_path):
    path = str(tmp_path / "part")
    t = batch(0, 600)
    t = t.append_column("region", pa.array([["north", "south", "east"][i % 3] for i in range(600)]))
    write_deltalake(path, t, partition_by=["region"])
    plan = pipeline.prepare(path, label="y", world_size=1, numeric=["x"], categorical=["cat", "region"],
                            passthrough=["id", "region"], val_fraction=0.0)
    data = pipeline.rank_data(plan, batch_size=16, device="cpu")
    got = dict(zip(data.train.extra["id"].tolist(), data.train.extra["region"].tolist()))
    assert got == dict(zip(t["id"].to_pylist(), t["region"].to_pylist()))


def test_a_commit_during_the_run_does_not_change_what_ranks_read(delta_table):
    """The plan carries the version's files: a writer committing after prepare (as during training)
    changes nothing any rank reads, and a saved fit refuses the table's new version by name."""
    plan = pipeline.prepare(delta_table, label="y", world_size=2, numeric=["x"], categorical=["cat"],
                            passthrough=["id"])
    version = plan.source.table.version
    write_deltalake(delta_table, batch(5000, 5500), mode="append")
    DeltaTable(delta_table).delete("id >= 3000 and id < 3100")
    ids = sorted(i for r in range(2) for part in (pipeline.rank_data(plan, batch_size=16, device="cpu", rank=r,
                                                                       world_size=2),)
                 for ds in (part.train, part.val) for i in ds.extra["id"].tolist())
    assert ids == [row[0] for row in delta_rows(delta_table, int(version))]
    fit = str(Path(delta_table).parent / "fit.json")
    plan.save_fit(fit)
    with pytest.raises(PipelineError, match=rf"at version {version}, but this run reads the delta table .* at version "
                                            rf"{int(version) + 2}"):
        pipeline.prepare(delta_table, label="y", world_size=2, numeric=["x"], categorical=["cat"],
                         passthrough=["id"], fit_from=fit)
    pipeline.prepare(delta_table, label="y", world_size=2, numeric=["x"], categorical=["cat"], passthrough=["id"],
                     fit_from=fit, version=version)  # the version it was made from: accepted


def test_string_view_columns_are_categorical(delta_table):
    """deltalake 1.x writes strings as string_view (the files rewritten by the delete hold them)."""
    types = {str(pq.read_schema(f).field("cat").type) for f in DeltaTable(delta_table).file_uris()}
    assert "string_view" in types
    plan = pipeline.prepare(delta_table, label="y", world_size=1, val_fraction=0.0)  # features inferred
    assert "cat" in plan.fitted.categorical
    assert sorted(plan.fitted.vocab[plan.fitted.categorical.index("cat")]) == [f"c{i}" for i in range(7)]


def test_column_mapping_is_applied_and_unknown_delta_features_are_refused_by_name(tmp_path):
    path = str(tmp_path / "mapped")
    write_deltalake(path, batch(0, 40), configuration={"delta.columnMapping.mode": "name"})
    assert project_rows(path) == delta_rows(path)

    class Protocol:
        reader_features = ["deletionVectors", "someFutureFeature"]

    class Marked:
        def protocol(self):
            return Protocol()

    assert "someFutureFeature" in delta.unsupported(Marked())
    Protocol.reader_features = ["deletionVectors", "columnMapping"]
    assert delta.unsupported(Marked()) is None


@pytest.fixture()
def iceberg(tmp_path):
    """(catalog, table identifier): appended twice, overwritten, then deleted from (pyiceberg deletes
    copy-on-write: the old files stay in data/)."""
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    cat.create_namespace("ns")
    table = cat.create_table("ns.events", schema=batch(0, 1).schema)
    table.append(batch(0, 1000))
    table.append(batch(1000, 1600))
    table.overwrite(batch(2000, 2700))
    table.delete("id < 2100")
    return cat, "ns.events"


def test_an_iceberg_table_trains_on_exactly_its_current_rows(iceberg, tmp_path):
    cat, name = iceberg
    table = cat.load_table(name)
    root = table.location().removeprefix("file://")
    assert parquet_rows_on_disk(root) > 2000
    want = own_rows(table.scan().to_arrow())
    assert len(want) == 600 and project_rows(root) == want
    # The same table through its catalog, configured as pyiceberg reads it (here: the environment of a
    # new process, as a user sets it; pyiceberg reads it once, at import).
    env = {**os.environ, "PYICEBERG_CATALOG__TEST__TYPE": "sql", "PYICEBERG_CATALOG__TEST__URI": f"sqlite:///{tmp_path}/catalog.db",
           "PYICEBERG_CATALOG__TEST__WAREHOUSE": f"file://{tmp_path}/warehouse",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])}
    code = f"import test_tables; print(test_tables.project_rows({name!r}, catalog='test'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == str(want), out.stderr[-3000:]
    # Every snapshot pinned: its own rows.
    for snap in table.snapshots():
        want = own_rows(table.scan(snapshot_id=snap.snapshot_id).to_arrow())
        if want:
            assert project_rows(root, version=str(snap.snapshot_id)) == want
        else:
            with pytest.raises(NoUsableRows):
                project_rows(root, version=str(snap.snapshot_id))


def test_a_path_inside_a_table_or_a_hudi_table_is_refused(delta_table, iceberg, tmp_path):
    cat, name = iceberg
    root = cat.load_table(name).location().removeprefix("file://")
    with pytest.raises(DataError, match=f"inside the iceberg table at '{root}'"):
        project_rows(f"{root}/data")
    part = tmp_path / "p"
    write_deltalake(str(part), batch(0, 30).append_column("k", pa.array(["a", "b", "c"] * 10)), partition_by=["k"])
    with pytest.raises(DataError, match=f"inside the delta table at '{part}'"):
        project_rows(str(part / "k=a"))
    hudi = tmp_path / "hudi"
    (hudi / ".hoodie").mkdir(parents=True)
    pq.write_table(batch(0, 10), hudi / "f.parquet")
    with pytest.raises(DataError, match="Apache Hudi"):
        project_rows(str(hudi))
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(batch(0, 10), plain / "f.parquet")
    with pytest.raises(DataError, match="not a Delta or Iceberg table"):
        project_rows(str(plain), version="3")


def test_without_the_extra_the_error_says_what_to_install(delta_table, iceberg, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "deltalake", None)
    with pytest.raises(DataError, match=r"pip install 'parquet-ray-pipeline\[delta\]'"):
        project_rows(delta_table)
    monkeypatch.setitem(__import__("sys").modules, "pyiceberg.manifest", None)
    cat, name = iceberg
    with pytest.raises(DataError, match=r"pip install 'parquet-ray-pipeline\[iceberg\]'"):
        project_rows(cat.load_table(name).location().removeprefix("file://"))


def test_features_are_inferred_from_every_file_and_a_partial_column_is_named(tmp_path):
    pq.write_table(batch(0, 100).append_column("extra", pa.array(np.ones(100))), tmp_path / "a.parquet")
    pq.write_table(batch(100, 200), tmp_path / "b.parquet")
    pq.write_table(batch(200, 300), tmp_path / "c.parquet")
    plan = pipeline.prepare(str(tmp_path), label="y", world_size=1, exclude=["id"])
    assert list(plan.source.columns.numeric) == ["x"] and list(plan.source.columns.categorical) == ["cat"]
    assert "extra (in 1 of 3 files)" in plan.source.describe_columns()
    assert plan.accounting.rows_used == 300 and not plan.source.bad_files


def test_arrow_types_writers_produce_give_the_same_arrays(tmp_path):
    """string_view, large_string, UTF-8 binary, dictionaries of them (categoricals); large_list,
    list_view and fixed_size_list of numbers (vectors): each transforms exactly as its plain twin."""
    n = 300
    cats = [f"v{i % 11}" if i % 13 else None for i in range(n)]
    vecs = [[float(i), float(i % 5)] if i % 17 else None for i in range(n)]
    plain = pa.table({"c": pa.array(cats), "v": pa.array(vecs, pa.list_(pa.float64())),
                      "y": pa.array(np.arange(n) % 2)})
    (tmp_path / "plain").mkdir()
    pq.write_table(plain, tmp_path / "plain" / "f.parquet")
    keys = dict(label="y", world_size=1, numeric=["v"], categorical=["c"], val_fraction=0.0)
    ref = pipeline.prepare(str(tmp_path / "plain"), **keys).fitted.transform(plain)
    variants = {
        "string_view": dict(c=pa.array(cats, pa.string_view())),
        "large_string": dict(c=pa.array(cats, pa.large_string())),
        "binary": dict(c=pa.array([None if c is None else c.encode() for c in cats], pa.binary())),
        "dictionary": dict(c=pa.array(cats).dictionary_encode()),
        "large_list": dict(v=pa.array(vecs, pa.large_list(pa.float64()))),
        "list_view": dict(v=pa.array(vecs, pa.list_view(pa.float64()))),
        "fixed_size_list": dict(v=pa.array(vecs, pa.list_(pa.float64(), 2))),
    }
    for name, cols in variants.items():
        t = plain
        for c, arr in cols.items():
            t = t.set_column(t.column_names.index(c), c, arr)
        d = tmp_path / name
        d.mkdir()
        pq.write_table(t, d / "f.parquet", store_schema=True)
        fitted = pipeline.prepare(str(d), **keys).fitted
        out = fitted.transform(t)
        assert np.array_equal(out.x_num, ref.x_num) and np.array_equal(out.x_cat, ref.x_cat), name
    (tmp_path / "bytes").mkdir()
    pq.write_table(plain.set_column(0, "c", pa.array([b"\xff\xfe"] * n)), tmp_path / "bytes" / "f.parquet")
    with pytest.raises(DataError, match="not UTF-8 text"):
        pipeline.prepare(str(tmp_path / "bytes"), **keys)
    shutil.rmtree(tmp_path / "bytes")


@pytest.mark.slow
def test_the_train_job_reads_one_version_while_a_writer_commits(tmp_path):
    """`python -m pipeline train` on a Delta table's root: once the plan is made, a writer appends and
    deletes; every rank still reads the version the job printed, and fit.json records it."""
    import json
    import re

    path = str(tmp_path / "delta")
    write_deltalake(path, batch(0, 3000))
    write_deltalake(path, batch(3000, 4000), mode="append")
    DeltaTable(path).delete("id < 500")
    want = len(delta_rows(path))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--data.path", path, "--data.label", "y",
                             "--data.numeric", '["x"]', "--data.categorical", '["cat"]', "--run.output",
                             str(tmp_path / "runs"), "--train.epochs", "1", "--train.hidden", "[8]",
                             "--train.batch_size", "128", "--train.num_workers", "2"],
                            cwd=Path(__file__).parents[1], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:  # the job's own lines, as they come
        lines.append(line)
        if line.startswith("[plan]"):
            write_deltalake(path, batch(5000, 6000), mode="append")
            DeltaTable(path).delete("id >= 3000 and id < 3500")
    assert proc.wait(timeout=60) == 0, "".join(lines[-40:])
    out = "".join(lines)
    assert "delta table" in out and "at version 2," in out, out[-3000:]
    assert f"[rows] rows read {want:,} = used {want:,}" in out, out[-3000:]
    ranks = [int(n.replace(",", "")) + int(m.replace(",", ""))
             for n, m in re.findall(r"\[data\] rank \d/2 \(ray\): ([\d,]+) training \+ ([\d,]+) validation", out)]
    assert len(ranks) == 2 and sum(ranks) == want, out[-3000:]
    fit = json.loads(next((tmp_path / "runs").rglob("fit.json")).read_text())
    assert fit["table"] == ["delta", path, "2"]
    assert DeltaTable(path).version() == 4  # the writer did commit during the run


def _prepare_under_torch_distributed(rank: int, path: str, port: int, out: str) -> None:
    """One of two gloo processes: rank 0 commits to the table right after it read the version, and
    rank 1 reads only after that commit (a file flag), so the two see different latest versions."""
    import json
    import time

    import torch.distributed as dist

    from pipeline.ingest import driver as ingest  # where prepare looks inspect up

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flag = Path(out) / "committed"
    real = ingest.inspect

    def inspect(cfg, *a):
        if rank == 1 and not cfg.data.version:
            deadline = time.monotonic() + 60
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        src = real(cfg, *a)
        if rank == 0:
            write_deltalake(path, batch(9000, 9100), mode="append")
            flag.touch()
        return src

    ingest.inspect = inspect
    plan = pipeline.prepare(path, label="y", numeric=["x"], categorical=["cat"])
    (Path(out) / f"rank{rank}.json").write_text(json.dumps([plan.source.table.version, plan.source.num_rows]))
    dist.destroy_process_group()


def test_under_torch_distributed_every_process_reads_rank_0s_version(delta_table, tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = DeltaTable(delta_table).version()
    mp.spawn(_prepare_under_torch_distributed, args=(delta_table, port, str(tmp_path)), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert DeltaTable(delta_table).version() == before + 1  # rank 1 did see a newer latest version
    assert seen[0] == seen[1] == [str(before), 2400]


def test_an_iceberg_column_renamed_after_files_were_written_is_read_by_field_id(iceberg):
    """Iceberg knows columns by field id: files written before a rename hold the old name. Their rows
    are read under the new name (never a missing column, never two half-empty columns)."""
    cat, name = iceberg
    table = cat.load_table(name)
    with table.update_schema() as update:
        update.rename_column("cat", "kind")
    table = cat.load_table(name)
    table.append(batch(3000, 3200).rename_columns(["id", "x", "kind", "y"]))
    table = cat.load_table(name)
    root = table.location().removeprefix("file://")
    plan = pipeline.prepare(root, label="y", world_size=1, numeric=["x"], categorical=["kind"],
                            passthrough=["id", "kind"], val_fraction=0.0)
    data = pipeline.rank_data(plan, batch_size=16, device="cpu")
    got = sorted(zip(data.train.extra["id"].tolist(), data.train.extra["kind"].tolist()))
    own = table.scan().to_arrow()
    assert len(got) == 800 and got == sorted(zip(own["id"].to_pylist(), own["kind"].to_pylist()))
    assert sorted(plan.fitted.vocab[0]) == [f"c{i}" for i in range(7)]


def test_a_uuid_column_is_a_categorical_of_its_canonical_text(tmp_path):
    """Parquet's UUID (pyarrow's arrow.uuid, Iceberg's uuid): as a categorical its values are their canonical
    text, the same on the training path and at serving (where a request sends the text), nulls unknown."""
    import uuid

    import pyarrow.parquet as pq

    ids = [uuid.UUID(int=i * 7919 + 1) for i in range(6)]
    col = pa.array([ids[i % 6].bytes if i % 10 else None for i in range(300)], pa.uuid())
    pq.write_table(pa.table({"u": col, "x": np.arange(300, dtype=np.float64)}), tmp_path / "p.parquet")
    plan = pipeline.prepare(str(tmp_path), world_size=1, label="", categorical=["u"], numeric=["x"], use_ray=False,
                            val_fraction=0.0, settings={"train.drop_last": False})
    assert sorted(plan.fitted.vocab[0]) == sorted(str(u) for u in ids)
    data = pipeline.rank_data(plan, batch_size=300, device="cpu")
    served = plan.fitted.transform(pa.table({"u": pa.array([str(ids[i % 6]) if i % 10 else None for i in range(300)]),
                                             "x": np.arange(300, dtype=np.float64)}))
    order = np.argsort(data.train.row_id.numpy())
    np.testing.assert_array_equal(data.train.x_cat.numpy()[order], served.x_cat)
    assert (served.x_cat[::10] == 0).all() and (served.x_cat[1::10] > 0).all()
