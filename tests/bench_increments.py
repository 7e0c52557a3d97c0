"""The fit of a 10% increment (prepare(since=...)) beside a full refit of the same table, measured side by
side in one run (docs/continuous.md records the figures). Not a test: tests check correctness, not time.

    .venv/bin/python tests/bench_increments.py [--rows 2000000] [--shards 10] [--out /tmp/bench-increments]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import pipeline

CATS = {"c_small": 100, "c_mid": 10_000, "c_big": 300_000, "c_ids": 3_000_000}  # Zipf-like over this many values


def shard(path: Path, i: int, rows: int) -> None:
    rng = np.random.default_rng(i)
    cols = {f"x{j}": rng.normal(size=rows) for j in range(8)}
    for name, n in CATS.items():
        cols[name] = pa.array(np.char.add("v", (rng.zipf(1.2, rows) % n).astype(str)))
    cols["y"] = rng.integers(0, 2, rows)
    pq.write_table(pa.table(cols), path / f"part-{i:04d}.parquet", row_group_size=200_000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows of the table before the increment")
    ap.add_argument("--shards", type=int, default=10)
    ap.add_argument("--out", default="/tmp/bench-increments")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per = a.rows // a.shards
    for i in range(a.shards):
        shard(out, i, per)
    settings = dict(label="y", numeric=[f"x{j}" for j in range(8)], categorical=list(CATS), vocab_min_count=2,
                    vocab_max_size=10_000_000)
    saved = out.parent / (out.name + "-saved")
    shutil.rmtree(saved, ignore_errors=True)
    base = pipeline.prepare(str(out), **settings)
    base.save(str(saved / "plan.pkl"))  # yesterday's plan, as a daily job keeps it: counts and vocabularies on files
    shard(out, a.shards, a.rows // 10)  # the increment: 10% of the table's rows
    inc_rows = pq.read_metadata(out / f"part-{a.shards:04d}.parquet").num_rows
    full_s, inc_s, full_p, inc_p = [], [], [], []
    for _ in range(a.repeat):  # alternated, so both see the same machine load
        t = time.perf_counter()
        full = pipeline.prepare(str(out), **settings)
        full_p.append(time.perf_counter() - t)
        full_s.append(full.timings["fit_s"])
        t = time.perf_counter()
        inc = pipeline.prepare(str(out), since=str(saved / "plan.pkl"))
        inc_p.append(time.perf_counter() - t)
        inc_s.append(inc.timings["fit_s"])
    same = [len(i) == len(f) for i, f in zip(inc.fitted.vocab, full.fitted.vocab)]  # the kept sets: test_increments.py
    h = inc.fitted.history
    print(f"table: {a.rows:,} rows in {a.shards} shards, increment {inc_rows:,} rows "
          f"({100 * inc_rows / a.rows:.0f}%); 8 numeric, {len(CATS)} categorical columns")
    print(f"fit pass: full refit {min(full_s):.2f}s, increment {min(inc_s):.2f}s -> {min(inc_s) / min(full_s):.2f}x")
    print(f"prepare(): full refit {min(full_p):.2f}s, increment {min(inc_p):.2f}s -> {min(inc_p) / min(full_p):.2f}x")
    print(f"same vocabulary sizes as the full refit: {all(same)}")
    print(f"kept counts: {h.values:,} distinct values over {len(h.columns)} columns in {h.partitions} parts; vocab sizes "
          f"{dict(zip(inc.fitted.categorical, map(len, inc.fitted.vocab)))}")
    inc.fitted.save(str(saved / "today" / "pre.json"))
    files = sorted((saved / "today").rglob("*"))
    size = lambda prefix: sum(f.stat().st_size for f in files if f.is_file() and f.parent.name.startswith(prefix))  # noqa: E731
    print(f"saved: counts {size('counts-') / 2**20:.1f} MiB, vocabularies {size('vocab-') / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
