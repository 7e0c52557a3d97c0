"""Bad input: each kind of damage made here, then checked for a clear error or exact accounting.

Damage is made by classes (zero bytes, wrong magic, truncation, corrupt pages, drifting or wrong
types, bad values), not by particular files, and files from other writers must simply work.
"""

import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import make_config
import pipeline
from pipeline import cli
from pipeline.read import source
from pipeline.demo import _shard
from pipeline.errors import DataError

ROWS = 3000  # per shard


def write(path, table=None, seed=0, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table if table is not None else _shard(ROWS, 0, seed), path, **kw)
    return path


def good_dir(tmp_path, n=3, **kw):
    d = tmp_path / "data"
    for i in range(n):
        write(str(d / f"part-{i}.parquet"), seed=i, **kw)
    return d


def flip_page(path, *, header: bool):
    """Corrupt the first column chunk behind an intact footer: its page header, or bytes inside the page."""
    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    off = col.data_page_offset if header else col.data_page_offset + col.total_compressed_size // 2
    b = bytearray(open(path, "rb").read())
    for i in range(off, off + 16):
        b[i] ^= 0xFF
    open(path, "wb").write(bytes(b))


def truncate(path, keep=0.6):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * keep)])


# ---------------------------------------------------------------------------------------------
# Footer and schema damage: found by `inspect` before any heavy work (no Ray)


@pytest.mark.parametrize("damage, needle", [
    (lambda p: open(p, "wb").close(), "empty (0 bytes)"),
    (lambda p: open(p, "w").write("a,b,c\n1,2,3\n"), "not a Parquet file"),
    (truncate, "truncated"),
    (lambda p: open(p, "r+b").write(b"PAR1" + b"\0" * 64), "unreadable Parquet footer"),
])
def test_damaged_files_fail_clearly_or_are_quarantined(tmp_path, damage, needle):
    d = good_dir(tmp_path)
    bad = str(d / "part-1.parquet")
    if needle == "unreadable Parquet footer":  # magic intact at both ends, footer bytes garbage
        data = bytearray(open(bad, "rb").read())
        data[-40:-8] = b"\xff" * 32
        open(bad, "wb").write(bytes(data))
    else:
        damage(bad)
    with pytest.raises(DataError) as e:
        source.inspect(make_config(str(d)))
    msg = str(e.value)
    assert bad in msg and needle in msg and "quarantine" in msg and "\n" not in msg
    src = source.inspect(make_config(str(d), **{"quality.on_bad_file": "quarantine"}))
    assert [b.path for b in src.bad_files] == [bad] and len(src.shards) == 2
    assert src.num_rows == 2 * ROWS


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.drop_columns(["num_03"]), "column 'num_03' (data.numeric) is missing"),
    (lambda t: t.set_column(t.schema.get_field_index("num_03"), "num_03", pa.array(["x"] * t.num_rows)),
     "column 'num_03' is string, config says numeric"),
    (lambda t: t.set_column(t.schema.get_field_index("device"), "device",
                            pa.array(np.arange(t.num_rows) % 5)), "column 'device' is int here but string in most shards"),
    (lambda t: t.set_column(t.schema.get_field_index("label"), "label", pa.array(["yes"] * t.num_rows)),
     "column 'label' is string here but int in most shards (type drift)"),
    (lambda t: t.set_column(t.schema.get_field_index("label"), "label", pa.array([[1.0]] * t.num_rows)),
     "target column 'label' is vector; a target must be a bool, an integer, a float or a string"),
    (lambda t: t.set_column(t.schema.get_field_index("num_03"), "num_03", pa.array([{"a": 1}] * t.num_rows)),
     "column 'num_03' is struct<a: int64>, config says numeric"),
])
def test_schema_problems_name_file_column_and_fix(tmp_path, mutate, needle):
    d = good_dir(tmp_path)
    bad = write(str(d / "part-2.parquet"), mutate(_shard(ROWS, 0, 2)))
    with pytest.raises(DataError) as e:
        source.inspect(make_config(str(d)))
    assert bad in str(e.value) and needle in str(e.value), str(e.value)


def test_lossless_widening_between_shards_is_fine(tmp_path):
    d = good_dir(tmp_path, n=2)
    t = _shard(ROWS, 0, 5)
    i = t.schema.get_field_index("num_00")
    t = t.set_column(i, "num_00", pa.array(np.arange(ROWS, dtype=np.int32)))  # int32 where others are float64
    t = t.set_column(t.schema.get_field_index("label"), "label", t["label"].cast(pa.bool_()))
    write(str(d / "part-5.parquet"), t)
    src = source.inspect(make_config(str(d)))
    assert len(src.shards) == 3 and not src.bad_files


def test_validate_lists_every_bad_file_and_exits_nonzero(tmp_path, capsys):
    d = good_dir(tmp_path)
    open(d / "part-0.parquet", "wb").close()
    truncate(str(d / "part-2.parquet"))
    assert cli.main(["validate", "--data.path", str(d)]) == 2
    out, err = capsys.readouterr()
    assert out.count("BAD") == 2 and "part-0.parquet" in out and "part-2.parquet" in out
    assert err.startswith("error: ") and "Traceback" not in err
    assert cli.main(["validate", "--data.path", str(d), "--quality.on_bad_file", "quarantine"]) == 0


# ---------------------------------------------------------------------------------------------
# Files from other writers


def _frame(seed):
    return _shard(ROWS, 0, seed).to_pandas()


@pytest.mark.parametrize("writer", ["pandas", "polars", "duckdb", "spark_partitions", "codecs", "dictionary"])
def test_files_from_other_writers(tmp_path, writer, ray_local):
    d = tmp_path / writer
    d.mkdir()
    if writer == "pandas":
        for i in range(2):
            _frame(i).to_parquet(d / f"{i}.parquet", index=True)
    elif writer == "polars":
        import polars as pl

        for i in range(2):
            pl.from_pandas(_frame(i)).write_parquet(d / f"{i}.parquet", row_group_size=1000)
    elif writer == "duckdb":
        import duckdb

        for i in range(2):
            df = _frame(i)  # noqa: F841 (read by duckdb's replacement scan)
            duckdb.sql(f"COPY df TO '{d / f'{i}.parquet'}' (FORMAT PARQUET)")
    elif writer == "spark_partitions":  # plan=.../ directories hold a column the files lack
        df = pd.concat([_frame(0), _frame(1)])
        pq.write_to_dataset(pa.Table.from_pandas(df, preserve_index=False), str(d), partition_cols=["plan"])
        open(d / "_SUCCESS", "w").close()
        open(d / ".part.crc", "w").close()
    elif writer == "codecs":
        for i, codec in enumerate(["snappy", "zstd", "gzip", "lz4", "brotli", "none"]):
            write(str(d / f"{codec}.parquet"), seed=i, compression=codec, row_group_size=700)
    elif writer == "dictionary":
        t = _shard(ROWS, 0, 0)
        t = t.set_column(t.schema.get_field_index("city"), "city", t["city"].dictionary_encode())
        write(str(d / "dict.parquet"), t, use_dictionary=True)
    cfg = make_config(str(d), **{"data.val_fraction": 0.0})
    plan = pipeline.prepare(config=cfg)
    src, fitted, acct = plan.source, plan.fitted, plan.accounting
    assert not src.bad_files
    assert acct.balanced and acct.rows_used == src.num_rows
    assert len(transformed_ids(plan)) == src.num_rows
    if writer == "spark_partitions":
        assert set(fitted.vocab[cfg.data.categorical.index("plan")]) == {f"plan_{i:03d}" for i in range(4)}


def transformed_ids(plan) -> list[int]:
    """Row ids of every row the plan's pieces yield, read and transformed by Ray Data tasks."""
    from pipeline.cluster import ray_side

    pieces = [p for r in range(plan.world_size) for p in plan.pieces(r)]
    return [int(r["row_id"]) for r in ray_side.share_dataset(plan.spec, plan.fitted, pieces)
            .select_columns(["row_id"]).take_all()]


# ---------------------------------------------------------------------------------------------
# Corrupt pages and bad values: found while reading, under Ray


def test_corrupt_page_fails_naming_the_file(tmp_path, ray_local, capsys):
    d = good_dir(tmp_path, write_page_checksum=True)
    bad = str(d / "part-1.parquet")
    flip_page(bad, header=False)
    rc = cli.main(["fit", "--data.path", str(d), "--run.output", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2 and bad in err and "row group 0 (rows 0-" in err and "cannot be decoded" in err and "CRC" in err
    assert "Traceback" not in err and err.count("\n") == 1


def clean_shard(seed):
    """A demo shard without its (deliberate) nulls, so that only the damage a test adds is bad."""
    t = _shard(ROWS, 0, seed)
    for i, name in enumerate(t.column_names):
        fill = "none" if pa.types.is_string(t.schema.field(i).type) else 0
        t = t.set_column(i, name, pc.fill_null(t[name], fill))
    return t


def test_bad_value_fail_policy_names_column_row_and_value(tmp_path, ray_local, capsys):
    d = tmp_path / "data"
    for i in range(2):
        write(str(d / f"part-{i}.parquet"), clean_shard(i))
    t = clean_shard(7)
    y = t["label"].to_numpy().astype(np.int64)
    y[123] = 7
    write(str(d / "part-9.parquet"), t.set_column(t.schema.get_field_index("label"), "label", pa.array(y)))
    rc = cli.main(["fit", "--data.path", str(d), "--run.output", str(tmp_path / "r"), "--quality.on_bad_value", "fail",
                   "--data.target_kind", "binary"])
    err = capsys.readouterr().err
    assert rc == 2 and "part-9.parquet" in err and "'label'" in err and "7" in err and "row 123" in err
    assert "Traceback" not in err


def reference_bad_rows(d, cfg) -> int:
    total = 0
    for name in ["part-0", "part-1", "part-2", "part-4"]:
        pf = pq.ParquetFile(d / f"{name}.parquet")
        groups = range(1, pf.num_row_groups) if name == "part-1" else range(pf.num_row_groups)  # rg 0 is corrupt
        df = pd.concat([pf.read_row_group(g).to_pandas() for g in groups])
        bad = np.zeros(len(df), dtype=bool)
        for c in cfg.data.numeric:
            bad |= ~np.isfinite(df[c].astype(float).to_numpy())
        for c in cfg.data.categorical:
            bad |= df[c].isna().to_numpy()
        bad |= ~df["label"].astype(float).isin([0.0, 1.0]).to_numpy()
        total += int(bad.sum())
    return total


def test_every_row_accounted_for_under_quarantine(tmp_path, ray_local):
    """Known damage: a zero-byte file, a truncated file, a corrupt row group, bad labels and features."""
    d = tmp_path / "data"
    for i in range(3):
        write(str(d / f"part-{i}.parquet"), seed=i, row_group_size=1000)  # 3 row groups each
    open(d / "empty.parquet", "wb").close()  # 0 rows, quarantined
    write(str(d / "trunc.parquet"), seed=8)
    truncate(str(d / "trunc.parquet"))  # footer gone: rows unknown
    flip_page(str(d / "part-1.parquet"), header=True)  # row group 0 of part-1: 1000 rows quarantined
    t = _shard(ROWS, 0, 4)
    y = t["label"].to_numpy().astype(np.float64)
    y[:10] = np.nan  # null labels
    y[10:15] = 3  # out of range
    num = t["num_02"].to_numpy(zero_copy_only=False).copy()
    num[100:120] = np.inf
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(y, mask=np.isnan(y)))
    t = t.set_column(t.schema.get_field_index("num_02"), "num_02", pa.array(num))
    write(str(d / "part-4.parquet"), t)

    for policy, dropped in [("fill", 15), ("drop_row", None)]:
        cfg = make_config(str(d), **{"quality.on_bad_file": "quarantine", "quality.on_bad_value": policy,
                                     "data.target_kind": "binary"})
        plan = pipeline.prepare(config=cfg)
        fitted, acct = plan.fitted, plan.accounting
        assert acct.rows_read == 4 * ROWS  # 3 good + part-4; empty has 0 rows; trunc's are unknown
        assert acct.rows_quarantined == 1000 and acct.unknown_row_files == 1
        assert len(acct.quarantined) == 3
        if dropped is not None:
            assert acct.rows_dropped == dropped  # labels only: features are filled
        else:  # every row with any bad value, the demo's own nulls included: counted independently
            assert acct.rows_dropped == reference_bad_rows(d, cfg)
        assert acct.balanced and acct.rows_used == acct.rows_read - acct.rows_dropped - acct.rows_quarantined
        ids = transformed_ids(plan)
        assert len(ids) == acct.rows_used == len(set(ids))
        assert np.isfinite(fitted.mean).all() and np.isfinite(fitted.std).all()
        assert "[DOES NOT BALANCE]" not in acct.summary()
