"""Tables as Spark, Databricks, Trino and Flink leave them, read through the public API and compared, row by
row after the fitted transform, with the format's own reader (deltalake's DataFusion reader, pyiceberg's
scan): deletion vectors, Iceberg position deletes, column mapping, columns added or renamed after files
were written, files without field ids, typed partition values. Each table reads equal, or is refused in
one paragraph naming what the format's own library cannot read either.

The fixtures are other writers' tables (tests/data/README.md) and tables built here with pyiceberg's
lower-level API where no writer on PyPI makes them (position delete files, deletion vectors)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline
from iceberg_deletes import write_delete_snapshot
from pipeline.fit.columns import family
from pipeline.errors import DataError, NoUsableRows, PipelineError

DATA = Path(__file__).parent / "data"
DELTA_RS = DATA / "delta-rs"
DUCKDB_ICEBERG = DATA / "duckdb-iceberg"


def packed_rows(x_num, x_cat) -> list[tuple]:
    """Rows as tuples of exact bit patterns, sorted: the same multiset means the same rows, same values."""
    x = np.concatenate([np.asarray(x_num, np.float32).view(np.int32), np.asarray(x_cat, np.int32)], axis=1)
    return sorted(map(tuple, x.tolist()))


def project_vs_reader(path: str, theirs: pa.Table, **keys) -> tuple[list, list, pipeline.IngestPlan]:
    """(the project's rows, the reader's rows through the fitted transform, the plan): every row of the
    table on one rank, no hold-out, batches of one."""
    plan = pipeline.prepare(path, world_size=1, label="", use_ray=False, val_fraction=0.0,
                            settings={"train.drop_last": False}, **keys)
    data = pipeline.rank_data(plan, batch_size=1, device="cpu")
    served = data.fitted.transform(theirs)
    return packed_rows(data.train.x_num.numpy(), data.train.x_cat.numpy()), packed_rows(served.x_num, served.x_cat), plan


def deltalake_rows(path: str) -> pa.Table | None:
    """What deltalake's DataFusion reader returns for the table's latest version (None: it cannot read it)."""
    from deltalake import DeltaTable, QueryBuilder

    try:
        return pa.table(QueryBuilder().register("t", DeltaTable(path)).execute("select * from t").read_all())
    except Exception:  # noqa: BLE001 - deltalake's own refusal: a feature it cannot read, files absent
        return None


def delta_tables() -> list[Path]:
    corpus = os.environ.get("PIPELINE_DELTA_CORPUS")
    roots = [DELTA_RS] + ([Path(corpus)] if corpus else [])
    return sorted(p for r in roots for p in r.iterdir() if (p / "_delta_log").is_dir())


@pytest.mark.parametrize("table", delta_tables(), ids=lambda p: p.name)
def test_every_delta_table_reads_as_deltalake_reads_it(table):
    theirs = deltalake_rows(str(table))
    if theirs is None:  # deltalake itself cannot read it: the project refuses it, in one paragraph
        with pytest.raises(DataError) as e:
            pipeline.prepare(str(table), world_size=1, label="", use_ray=False)
        assert "Traceback" not in str(e.value)
        return
    if theirs.num_rows == 0:
        with pytest.raises(NoUsableRows):
            pipeline.prepare(str(table), world_size=1, label="", use_ray=False)
        return
    if not any(family(f.type) in {"int", "float", "bool", "temporal", "string", "vector"} for f in theirs.schema):
        with pytest.raises(DataError, match="no feature columns"):  # only structs, maps, binaries: nothing to learn
            pipeline.prepare(str(table), world_size=1, label="", use_ray=False)
        return
    got, want, plan = project_vs_reader(str(table), theirs)
    assert got == want
    # a deleted row is not a row of the table: it is neither read, used nor dropped
    assert plan.accounting.rows_read == theirs.num_rows == plan.accounting.rows_used
    assert plan.accounting.balanced


def test_deletion_vectors_leave_out_exactly_the_deleted_rows():
    """Spark's table-with-dv-small: 10 rows written, 2 deleted by a deletion vector."""
    path = str(DELTA_RS / "table-with-dv-small")
    on_disk = sum(pq.ParquetFile(p).metadata.num_rows for p in Path(path).glob("*.parquet"))
    plan = pipeline.prepare(path, world_size=1, label="", use_ray=False, val_fraction=0.0, numeric=["value"],
                            passthrough=["value"],
                            settings={"train.drop_last": False})
    data = pipeline.rank_data(plan, batch_size=1, device="cpu")
    theirs = deltalake_rows(path)
    assert on_disk == 10 and theirs.num_rows == 8
    assert sorted(data.train.extra["value"].tolist()) == sorted(theirs["value"].to_pylist())
    assert len(set(data.train.row_id.tolist())) == 8  # each kept row once, with its own id


def test_typed_partition_values_can_be_numeric_features():
    path = str(DELTA_RS / "delta-0.8.0-numeric-partition")  # x=10/y=10.0/: int and double partitions
    plan = pipeline.prepare(path, world_size=1, label="", use_ray=False, numeric=["x", "y"], categorical=["z"],
                            passthrough=["x", "y"], val_fraction=0.0, settings={"train.drop_last": False})
    data = pipeline.rank_data(plan, batch_size=1, device="cpu")
    theirs = deltalake_rows(path)
    assert sorted(data.train.extra["x"].tolist()) == sorted(theirs["x"].to_pylist())
    assert sorted(data.train.extra["y"].tolist()) == sorted(theirs["y"].to_pylist())


def test_column_mapping_reads_physical_columns_under_the_tables_names():
    path = str(DELTA_RS / "table_with_partitioning_mapping")  # newid (physical 'id', a partition), description
    plan = pipeline.prepare(path, world_size=1, label="", use_ray=False, numeric=["newid"], categorical=["description"],
                            passthrough=["newid", "description"], val_fraction=0.0, settings={"train.drop_last": False})
    data = pipeline.rank_data(plan, batch_size=1, device="cpu")
    theirs = deltalake_rows(path)
    got = sorted(zip(data.train.extra["newid"].tolist(), data.train.extra["description"].tolist()))
    assert got == sorted(zip(theirs["newid"].to_pylist(), theirs["description"].to_pylist()))


# --- Iceberg ------------------------------------------------------------------------------------------

def pyiceberg_rows(metadata: str) -> pa.Table:
    from pyiceberg.table import StaticTable

    return StaticTable.from_metadata(metadata).scan().to_arrow()


def current_metadata(root: Path) -> str:
    from pipeline import storage
    from pipeline.read import iceberg

    fs, path = storage.filesystem(str(root))
    return iceberg.metadata_file(fs, path)


def duckdb_tables() -> list[tuple[Path, Path]]:
    """(root, table) of every table under data/persistent: the vendored subset, and with PIPELINE_ICEBERG_CORPUS
    set to a checkout of duckdb-iceberg (fetch github:duckdb/duckdb-iceberg), every table of it."""
    corpus = os.environ.get("PIPELINE_ICEBERG_CORPUS")
    roots = [DUCKDB_ICEBERG] + ([Path(corpus)] if corpus else [])
    return sorted({(r, m.parent) for r in roots for m in (r / "data" / "persistent").rglob("metadata") if m.is_dir()})


def one_paragraph(e: BaseException) -> bool:
    return isinstance(e, PipelineError) and "\n" not in str(e) and "Traceback" not in str(e)


def from_partition_metadata(metadata: str) -> pa.Table:
    """The rows of a table whose identity-partitioned column is in no data file, as the Iceberg spec reads them:
    "Values for field ids which are not present in a data file must be resolved according to the following rules:
    Return the value from partition metadata if an Identity Transform exists for the field and the partition value
    is present in the partition struct on data_file object in the manifest." Built from pyiceberg's own plan
    (each file's partition record) and pyarrow's read of each file."""
    from pyiceberg.table import StaticTable
    from pyiceberg.transforms import IdentityTransform

    table = StaticTable.from_metadata(metadata)
    schema, spec = table.schema(), table.spec()
    arrow = schema.as_arrow()
    parts = []
    for task in table.scan().plan_files():
        got = pq.read_table(task.file.file_path.removeprefix("file://"))
        cols = {}
        for f in schema.fields:
            ident = [i for i, pf in enumerate(spec.fields)
                     if pf.source_id == f.field_id and isinstance(pf.transform, IdentityTransform)]
            if f.name in got.column_names:
                cols[f.name] = got[f.name].cast(arrow.field(f.name).type)
            else:
                assert ident, f"{f.name} is neither in the file nor an identity partition"
                cols[f.name] = pa.array([task.file.partition[ident[0]]] * got.num_rows, arrow.field(f.name).type)
        parts.append(pa.table(cols))
    return pa.concat_tables(parts)


def features_for(theirs: pa.Table) -> dict:
    """Columns named where none can be inferred (inference leaves binary ids and structs out): its text,
    binary and uuid columns as categoricals."""
    cats = [f.name for f in theirs.schema if family(f.type) in ("string", "binary", "int", "bool")]
    return {"categorical": cats} if cats else {}


@pytest.mark.parametrize("root,table", [pytest.param(r, t, id=str(t.relative_to(r / "data" / "persistent")))
                                         for r, t in duckdb_tables()])
def test_every_duckdb_iceberg_table_reads_as_pyiceberg_reads_it(root, table, monkeypatch):
    """Each table reads as pyiceberg's scan reads it, or, where pyiceberg cannot read it either, is refused in one
    paragraph (equality deletes; a deletion-vector blob without its Puffin magic; metadata pyiceberg cannot
    parse; a manifest list or bucket that is not there), never a traceback. The one exception is the class
    where pyiceberg is wrong: an identity partition whose source column is in no data file (partition_time,
    partition_timestamp, partition_timestamptz, partition_fixed_length_binary). pyiceberg 0.12 raises
    ResolveError ("Field is required, and could not be found in the file"); the Iceberg spec says such a value
    comes from the partition metadata (see from_partition_metadata), and that is what the project reads."""
    monkeypatch.chdir(root)  # these tables record their locations relative to that folder
    rel = str(table.relative_to(root))
    metadata = os.path.relpath(current_metadata(table))
    try:
        theirs = pyiceberg_rows(metadata)
    except Exception as e:  # noqa: BLE001 - pyiceberg refuses it
        if type(e).__name__ == "ResolveError" and "could not be found in the file" in str(e):
            theirs = from_partition_metadata(metadata)
        else:
            with pytest.raises(PipelineError) as refused:
                pipeline.prepare(rel, world_size=1, label="", use_ray=False)
            assert one_paragraph(refused.value) and rel in str(refused.value), refused.value
            return
    if theirs.num_rows == 0:
        with pytest.raises(NoUsableRows, match="holds no rows"):
            pipeline.prepare(rel, world_size=1, label="", use_ray=False)
        return
    try:
        got, want, plan = project_vs_reader(rel, theirs)
    except DataError as e:
        if "no feature columns" not in str(e):
            raise
        keys = features_for(theirs)
        if not keys:  # nothing that can be a feature (a struct only): said in one paragraph
            assert one_paragraph(e)
            return
        got, want, plan = project_vs_reader(rel, theirs, **keys)
    assert got == want and plan.accounting.rows_read == theirs.num_rows


def test_an_unreadable_manifest_list_or_bucket_is_one_paragraph(tmp_path, monkeypatch):
    """Every exception a table library or a filesystem raises while a table is opened and planned is one
    paragraph naming the table, the object and the cause: a manifest list the metadata names that is gone
    (as duckdb-iceberg's lineitem_iceberg tables, relative to another folder), and a bucket that cannot be
    reached (generated_bounds names s3://fake-bucket)."""
    import shutil

    root = DUCKDB_ICEBERG / "data" / "persistent" / "map_stats"
    shutil.copytree(root, tmp_path / "data" / "persistent" / "map_stats")
    monkeypatch.chdir(tmp_path)
    table = "data/persistent/map_stats/default.db/map_stats"
    gone = sorted((tmp_path / table / "metadata").glob("snap-*.avro"))
    for g in gone:
        g.unlink()
    with pytest.raises(DataError) as e:
        pipeline.prepare(table, world_size=1, label="", use_ray=False)
    assert one_paragraph(e.value) and table in str(e.value) and "FileNotFoundError" in str(e.value)
    assert gone[-1].name in str(e.value) or gone[0].name in str(e.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(DataError) as e:
        pipeline.prepare("s3://fake-bucket/t", world_size=1, label="", use_ray=False)
    assert one_paragraph(e.value) and "s3://fake-bucket/t" in str(e.value)


def catalog(tmp_path, version: int = 2):
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("t", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    cat.create_namespace("ns")
    return cat


def rows(lo: int, hi: int, **extra) -> pa.Table:
    ids = np.arange(lo, hi)
    return pa.table({"id": ids, "x": (ids % 13).astype(np.float64), "cat": pa.array([f"c{i % 5}" for i in ids]),
                     **extra})


def test_an_iceberg_column_added_later_reads_as_null_in_older_files(tmp_path):
    from pyiceberg.types import LongType

    table = catalog(tmp_path).create_table("ns.t", schema=rows(0, 1).schema)
    table.append(rows(0, 300))
    with table.update_schema() as u:
        u.add_column("clicks", LongType())
    table.append(rows(300, 500, clicks=np.arange(200, dtype=np.int64)))
    theirs = table.scan().to_arrow()
    got, want, plan = project_vs_reader(table.location(), theirs, numeric=["x", "clicks"], categorical=["cat"])
    assert got == want and theirs["clicks"].null_count == 300
    assert plan.fitted.to_dict()["stats"]["numeric"]["clicks"]["null_rows"] == 300  # the usual null handling saw them


def test_files_without_field_ids_are_read_through_the_name_mapping_after_a_rename(tmp_path):
    """add_files: Hive/Parquet files moved into Iceberg keep their own column names and no field ids;
    after a rename only the table's name mapping says which column is which."""
    table = catalog(tmp_path).create_table("ns.t", schema=rows(0, 1).schema)
    files = []
    for i, (lo, hi) in enumerate([(0, 250), (250, 600)]):
        files.append(f"{tmp_path}/import-{i}.parquet")
        pq.write_table(rows(lo, hi), files[-1])
    table.add_files(files)
    with table.update_schema() as u:
        u.rename_column("cat", "category")
    table.append(rows(600, 700).rename_columns(["id", "x", "category"]))
    theirs = table.scan().to_arrow()
    assert theirs["category"].null_count == 0
    got, want, _ = project_vs_reader(table.location(), theirs, numeric=["x"], categorical=["category"],
                                     passthrough=["id", "category"])
    assert got == want and len(got) == 700


def test_a_column_dropped_and_added_again_reads_as_the_new_column_never_the_old_values(tmp_path):
    """Columns are matched by the table's current field ids only: `cat` dropped and added again is a new column
    (a new id that no file holds), null in every row as pyiceberg reads it; `x` renamed to `x_old` and a new `x`
    added: the old files' `x` is `x_old`. The dropped column's values must not come back under its name."""
    from pyiceberg.types import DoubleType, StringType

    table = catalog(tmp_path).create_table("ns.t", schema=rows(0, 1).schema)
    table.append(rows(0, 400))
    with table.update_schema() as u:
        u.rename_column("x", "x_old")
    with table.update_schema() as u:
        u.add_column("x", DoubleType())
    later = rows(400, 700)
    table.append(pa.table({"id": later["id"], "x_old": later["x"], "cat": later["cat"],
                           "x": pa.array(np.linspace(0, 1, 300))}))
    with table.update_schema() as u:
        u.delete_column("cat")
    with table.update_schema() as u:
        u.add_column("cat", StringType())
    theirs = table.scan().to_arrow()
    assert theirs["cat"].null_count == 700 and theirs["x"].null_count == 400
    got, want, plan = project_vs_reader(table.location(), theirs, numeric=["x", "x_old"], categorical=["cat"],
                                        passthrough=["id"])
    assert got == want and len(got) == 700
    assert len(plan.fitted.vocab[0]) == 0  # not the dropped column's c0..c4
    extra = pipeline.rank_data(plan, batch_size=1, device="cpu").train.extra
    assert sorted(extra["id"].tolist()) == list(range(700))


def test_add_files_then_a_rename_reads_through_the_tables_name_mapping(tmp_path):
    """Files registered with add_files have no field ids; a rename afterwards changes only the table's schema
    and its name mapping ({"names": ["x", "xr"]}). The column checks use the table's schema and mapping, not
    the files' own names, so `xr` is read from the files' `x` with no later write to help."""
    table = catalog(tmp_path).create_table("ns.t", schema=rows(0, 1).schema)
    files = []
    for i, (lo, hi) in enumerate([(0, 100), (100, 250), (250, 400)]):
        files.append(f"{tmp_path}/import-{i}.parquet")
        pq.write_table(rows(lo, hi), files[-1])
    table.add_files(files)
    with table.update_schema() as u:
        u.rename_column("x", "xr")
    theirs = table.scan().to_arrow()
    assert theirs.column_names == ["id", "xr", "cat"] and theirs["xr"].null_count == 0
    got, want, plan = project_vs_reader(table.location(), theirs, numeric=["xr"], categorical=["cat"])
    assert got == want and len(got) == 400
    pinned = pipeline.prepare(table.location(), world_size=1, label="", use_ray=False, numeric=["x"],
                              version=str(table.current_snapshot().snapshot_id))
    assert pinned.source.num_rows == 400  # the snapshot's own schema where a version is pinned, as pyiceberg reads it


def test_files_without_field_ids_or_a_name_mapping_are_refused_by_name(tmp_path):
    table = catalog(tmp_path).create_table("ns.t", schema=rows(0, 1).schema)
    pq.write_table(rows(0, 100), f"{tmp_path}/import.parquet")
    table.add_files([f"{tmp_path}/import.parquet"])
    with table.transaction() as t:
        t.remove_properties("schema.name-mapping.default")
    with pytest.raises(DataError, match="no Parquet field ids and the Iceberg table has no name mapping"):
        pipeline.prepare(table.location(), world_size=1, label="", use_ray=False)


@pytest.mark.parametrize("puffin", [False, True], ids=["position-delete-file", "deletion-vector"])
def test_iceberg_merge_on_read_deletes_leave_out_exactly_the_deleted_rows(tmp_path, puffin):
    table = catalog(tmp_path).create_table("ns.t", schema=rows(0, 1).schema, properties={"format-version": "2"})
    table.append(rows(0, 400))
    table.append(rows(400, 1000))
    target = sorted(t.file.file_path for t in table.scan().plan_files())[0]
    in_target = pq.read_table(target.removeprefix("file://"))["id"].to_numpy()
    gone = list(range(0, len(in_target), 7))
    metadata = write_delete_snapshot(table, {target: gone}, puffin=puffin)
    theirs = pyiceberg_rows(metadata)
    assert theirs.num_rows == 1000 - len(gone)
    got, want, plan = project_vs_reader(table.location().removeprefix("file://"), theirs, passthrough=["id"])
    assert got == want
    ids = set(pipeline.rank_data(plan, batch_size=1, device="cpu").train.extra["id"].tolist())
    assert ids == set(range(1000)) - set(in_target[gone].tolist())
    assert plan.accounting.rows_read == theirs.num_rows and plan.accounting.balanced


def test_on_ray_deletes_and_column_mapping_give_the_same_fit_and_rows(ray_local):
    """The Ray path (fit tasks, each rank's share read by tasks) carries each row group's deletes and the
    table's column names to the tasks: the same fit as in one process, and every rank's rows together are
    deltalake's rows."""
    from pipeline.cluster import ray_side

    path = str(DELTA_RS / "table_with_deletion_logs")  # Databricks: deletion vectors over 98 of its rows
    keys = dict(label="", val_fraction=0.0, settings={"train.drop_last": False})
    on_ray = pipeline.prepare(path, world_size=2, use_ray=True, **keys)
    here = pipeline.prepare(path, world_size=2, use_ray=False, **keys)
    assert on_ray.fitted == here.fitted and on_ray.train_shares == here.train_shares
    blocks = [b for r in range(2) for b in ray_side.share_dataset(on_ray.spec, on_ray.fitted, on_ray.pieces(r)).take_all()]
    f = on_ray.fitted
    rows = np.stack([b["rows"] for b in blocks])
    got = packed_rows(rows[:, :f.num_features], rows[:, f.num_features:f.num_features + len(f.categorical)].view(np.int32))
    served = f.transform(deltalake_rows(path))
    assert got == packed_rows(served.x_num, served.x_cat) and len(got) == 98
