"""What merge-on-read deletes cost: one Iceberg table read through the public API (validate, fit, a rank's
share into its packed tensor) at the snapshot before and after 10% of its rows were deleted by position
delete files (or deletion vectors), side by side in one run, best of --repeats.

    .venv/bin/python tests/bench_table_deletes.py --rows 2000000 --files 8 [--puffin]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))
from iceberg_deletes import write_delete_snapshot  # noqa: E402

import pipeline  # noqa: E402


def build(where: str, rows: int, files: int, share: float, puffin: bool) -> tuple[str, str, int]:
    from pyiceberg.catalog.sql import SqlCatalog

    rng = np.random.default_rng(0)
    cat = SqlCatalog("b", uri=f"sqlite:///{where}/catalog.db", warehouse=f"file://{where}/warehouse")
    cat.create_namespace("ns")
    table = None
    for f in range(files):
        n = rows // files
        cols = {"id": np.arange(f * n, (f + 1) * n), **{f"x{j}": rng.standard_normal(n) for j in range(8)},
                **{f"c{j}": pa.array(rng.integers(0, 1000 * (j + 1), n).astype(str)) for j in range(3)},
                "label": rng.integers(0, 2, n)}
        t = pa.table(cols)
        if table is None:
            table = cat.create_table("ns.t", schema=t.schema, properties={"format-version": "2"})
        table.append(t)
    before = table.current_snapshot().snapshot_id
    deletes = {}
    for task in table.scan().plan_files():
        n = task.file.record_count
        deletes[task.file.file_path] = np.sort(rng.choice(n, int(n * share), replace=False)).tolist()
    write_delete_snapshot(table, deletes, puffin=puffin)
    return table.location().removeprefix("file://"), str(before), sum(len(p) for p in deletes.values())


def read(path: str, version: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    plan = pipeline.prepare(path, world_size=1, use_ray=False, version=version, label="label",
                            settings={"train.drop_last": False})
    data = pipeline.rank_data(plan, batch_size=1024, device="cpu")
    return time.perf_counter() - t0, len(data.train) + len(data.val)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--puffin", action="store_true", help="deletion vectors (v3 Puffin) instead of delete files")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as where:
        path, before, deleted = build(where, a.rows, a.files, a.share, a.puffin)
        plain, marked = [], []
        for _ in range(a.repeats):  # alternated, so both see the same machine
            plain.append(read(path, before))
            marked.append(read(path, ""))
        (tp, n_plain), (tm, n_marked) = min(plain), min(marked)
        assert n_plain - n_marked == deleted, (n_plain, n_marked, deleted)
        what = "deletion vectors" if a.puffin else "position delete files"
        print(f"[deletes] {a.rows:,} rows in {a.files} files; {deleted:,} ({a.share:.0%}) deleted by {what}")
        print(f"  without deletes (snapshot before)  {tp:6.2f} s  {n_plain:,} rows")
        print(f"  with deletes applied               {tm:6.2f} s  {n_marked:,} rows")
        print(f"  ratio with/without                 {tm / tp:6.3f}x  (best of {a.repeats})")


if __name__ == "__main__":
    main()
