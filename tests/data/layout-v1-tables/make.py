"""The saved-layout fixtures of three more kinds of plan: written by the code at commit 211f37c (the flat
`pipeline/` layout: pipeline/tables.py, pipeline/increments.py, pipeline/source.py, ...) before the stage-folder
move; do not regenerate after the move (the new code would name its new module paths, and the test would
prove nothing). tests/test_saved_layout_tables.py loads them with the current code.

- delta/: a Delta Lake table (written by deltalake): version 0 (1,200 rows), version 1 (800 rows appended), and
  version 2 (1,000 rows appended, with category values the first two versions never had);
- delta-plan/: `pipeline.prepare(delta, version="1", ...)` with world_size=2: the plan's source holds a
  pipeline.tables.Snapshot of version 1 and its pipeline.tables.TableFile entries;
- increment-plan/: `pipeline.prepare(delta, since=<delta-plan/plan.pkl>)`: the rows version 2 added (the
  plan's `increment` is a pipeline.increments.Range, after "1" up to "2"), its fitted state the delta plan's
  extended (known ids never move; new values take the next ids);
- folder/: a folder of Parquet files: three good shards, one truncated (its footer gone), one of zero bytes and
  one whose 'num_01' is a string column;
- quarantine-plan/: `pipeline.prepare(folder, on_bad_file="quarantine", ...)`: the source holds three
  pipeline.source.BadFile entries and the accounting their quarantine entries.

Each plan folder holds plan.pkl (`IngestPlan.save`, with the vocab-<digest>/ and counts-<digest>/ parts it names
beside it), expected.npz (`plan.fitted.transform(frame())`'s arrays: x_num, x_cat, y; no weight column) and
expected.json (the figures the test compares; see `expected()` below), with "pickled_classes": every
module.qualname the pickle names, which must keep resolving after the move. `IngestPlan.save` makes its path
absolute, so the pickles name the data, the vocabulary parts and the counts by the absolute folder make.py ran
in ("saved_from"); the test reads no data file, only the parts beside each plan (IngestPlan.load finds them).

Run it once, from a worktree of that commit, with that commit's package first on the path (the venv's editable
install points at the main checkout; PYTHONPATH comes before it):

    git worktree add /work/wt211 211f37c
    cd /work/wt211 && PYTHONPATH=/work/wt211 /work/main/.venv/bin/python /work/main/tests/data/layout-v1-tables/make.py

It refuses to run with the stage-folder layout (no pipeline/tables.py beside pipeline/__init__.py). No Ray: the
fit runs in this process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

HERE = Path(__file__).resolve().parent
WORLD = 2
NUMERIC = ("num_00", "num_01", "num_02", "num_03")
CATEGORICAL = ("city", "device", "plan", "channel")
LABEL = ("label", "segment")  # a binary and a multiclass target
SEGMENTS = ("bronze", "silver", "gold", "platinum")
# 'channel' is hashed into 16 buckets (no vocabulary); 'city' keeps its 20 most frequent values and hashes the rest
# into 8 extra ids; 'device' and 'plan' keep plain vocabularies.
COLUMNS = {"channel": {"encode": "hash", "buckets": 16}, "city": {"encode": "vocab+hash", "buckets": 8, "max_size": 20}}
SETTINGS = {"label": list(LABEL), "numeric": list(NUMERIC), "categorical": list(CATEGORICAL), "columns": COLUMNS}
PLANS = ("delta-plan", "increment-plan", "quarantine-plan")


def rows(lo: int, hi: int, new: bool = False) -> pa.Table:
    """Rows lo..hi-1 (seeded by lo): 'city' Zipf-like over 30 values, 3% null; new=True: about a third of the rows
    take values no earlier batch had (city_030.. city_035, device_005, plan_004)."""
    n = hi - lo
    rng = np.random.default_rng([7, lo])
    x = np.round(rng.standard_normal((n, len(NUMERIC))) * [1.0, 5.0, 20.0, 0.5] + [0.0, 10.0, -3.0, 1.0], 2)
    x[rng.random(n) < 0.03, 1] = np.nan
    city = np.minimum(rng.zipf(1.4, n) - 1, 29)
    device, plan_ = rng.integers(0, 5, n), rng.integers(0, 4, n)
    if new:
        fresh = rng.random(n) < 0.35
        city = np.where(fresh, 30 + rng.integers(0, 6, n), city)
        device = np.where(fresh & (rng.random(n) < 0.5), 5, device)
        plan_ = np.where(fresh & (rng.random(n) < 0.5), 4, plan_)
    city_s = [None if m else f"city_{c:03d}" for c, m in zip(city, rng.random(n) < 0.03)]
    logit = x[:, 0] - 0.1 * np.nan_to_num(x[:, 1]) + 0.3 * (device == 2)
    return pa.table({
        "id": pa.array(np.arange(lo, hi), pa.int64()),
        **{c: pa.array(x[:, j], pa.float64(), from_pandas=True) for j, c in enumerate(NUMERIC)},
        "city": pa.array(city_s, pa.string()),
        "device": pa.array([f"device_{d:03d}" for d in device], pa.string()),
        "plan": pa.array([f"plan_{p:03d}" for p in plan_], pa.string()),
        "channel": pa.array([f"channel_{c:03d}" for c in rng.integers(0, 30, n)], pa.string()),
        "label": pa.array((logit + rng.standard_normal(n) > 0).astype(np.int8)),
        "segment": pa.array([SEGMENTS[s] for s in rng.integers(0, 4, n)], pa.string()),
    })


def frame() -> pd.DataFrame:
    """The rows the test transforms (kept here so the test and this script use the same ones): values every fit
    saw, values only the increment's fit saw (city_031, device_005, plan_004), values no fit saw, and nulls."""
    return pd.DataFrame({
        "num_00": [0.5, -3.25, None, 12.0, 0.0, 7.75, 1.5],
        "num_01": [1.0, None, -2.5, 40.0, 3.5, -0.125, 10.0],
        "num_02": [10.0, 20.0, 30.0, None, -5.0, 0.25, -3.0],
        "num_03": [-1.0, 0.0, 1.0, 2.0, None, 100.0, 1.0],
        "city": ["city_000", "city_001", "city_never_seen", None, "city_031", "city_005", "city_029"],
        "device": ["device_000", "device_004", "device_002", "device_never_seen", None, "device_005", "device_001"],
        "plan": ["plan_003", None, "plan_000", "plan_001", "plan_004", "plan_never_seen", "plan_002"],
        "channel": ["channel_000", "channel_029", None, "channel_never_seen", "channel_007", "channel_012",
                    "channel_003"],
        "label": pd.array([0, 1, 1, 0, 1, 0, 1], dtype="int8"),
        "segment": ["bronze", "silver", "gold", "platinum", "gold", "bronze", "silver"],
    })


def pickled_classes(data: bytes) -> list[str]:
    """Every module.qualname a pickle's GLOBAL / STACK_GLOBAL opcodes name, as the unpickler asks for them."""
    import io
    import pickle

    seen: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return sorted(seen)


def named_files(plan) -> list[str]:
    """The files the saved plan's pickle names besides the data: vocabulary parts and category counts."""
    parts = {id(v.parts): v.parts for v in plan.fitted.vocab if hasattr(v, "parts")}
    out = [s + ".arrow" for p in parts.values() for s in p.sources]
    if plan.fitted.history is not None:
        out += list(plan.fitted.history.sources)
    return out


def counted(h) -> dict[str, list[int]]:
    """Per counted column: (distinct values, rows) over every partition of the category counts."""
    out: dict[str, list[int]] = {c: [0, 0] for c in h.columns}
    for q in range(h.partitions):
        for c, t in h.part(q).items():
            out[c][0] += t.num_rows
            out[c][1] += int(t["n"].to_numpy().sum())
    return out


def expected(plan, saved, folder: Path, commit: str, named: list[str]) -> dict:
    """What the test compares after loading the plan with the current code (all JSON: tuples become lists)."""
    src, acct, fitted = plan.source, plan.accounting, plan.fitted
    root = str(HERE)
    out = {
        "commit": commit,
        "saved_from": str(folder),
        "data_root": root,  # the data paths below are relative to it
        "world_size": plan.world_size,
        "num_rows": src.num_rows,
        "train_rows": plan.train_rows,
        "train_sizes": plan.train_sizes,
        "val_sizes": plan.val_sizes,
        "world3_train_sizes": plan.for_world(3).train_sizes,
        "world3_val_sizes": plan.for_world(3).val_sizes,
        "shards": [[str(Path(s.path).relative_to(root)), s.num_rows] for s in src.shards],
        "fragments": len(src.fragments),
        "accounting": acct.as_dict(),
        "used_by_fragment": [[k, *v] for k, v in sorted(acct.used_by_fragment.items())],
        "quarantined": [{**e, "file": Path(e["file"]).name} for e in acct.quarantined],
        "bad_files": [[Path(b.path).name, b.reason, b.rows] for b in src.bad_files],
        "table": None if src.table is None else {
            "format": src.table.format, "name": str(Path(src.table.name).relative_to(root)),
            "version": src.table.version, "fingerprint_version": src.table.fingerprint[2],
            "files": [[f.path.rsplit("/", 1)[-1], f.rows, f.deleted_rows] for f in src.table.files],
            "schema": src.table.schema.names if src.table.schema is not None else None},
        "increment": None if plan.increment is None else {
            "to_dict": {**plan.increment.to_dict(), "source": str(Path(plan.increment.name).relative_to(root))},
            "after": plan.increment.after, "upto": plan.increment.upto, "next_id": plan.increment.next_id,
            "notes": list(plan.increment.notes), "describe": plan.increment.describe()},
        "numeric": list(fitted.numeric),
        "categorical": list(fitted.categorical),
        "targets": [[t.name, t.kind, list(t.classes)] for t in fitted.targets],
        "num_features": fitted.num_features,
        "cardinalities": list(fitted.cardinalities),
        "vocab": {c: list(v) for c, v in zip(fitted.categorical, fitted.vocab)},
        "history_rows": fitted.history.rows if fitted.history is not None else None,
        "history_columns": list(fitted.history.columns) if fitted.history is not None else None,
        "counted": counted(saved.fitted.history),
        "vocab_digest": fitted.vocab_digest,
        "lineage": [{k: v for k, v in e.items() if k != "source"} for e in fitted.lineage],  # source: absolute
        "named_files": [str(Path(p).relative_to(folder)) for p in named],
        "pickled_classes": pickled_classes((folder / "plan.pkl").read_bytes()),
    }
    return json.loads(json.dumps(out))


def write(plan, name: str, commit: str, previous=None, previous_name: str = "") -> dict:
    import pipeline

    folder = HERE / name
    folder.mkdir()
    plan.save(str(folder / "plan.pkl"))
    saved = pipeline.IngestPlan.load(str(folder / "plan.pkl"))  # names the parts' files (`plan` holds them in memory)
    assert named_files(saved) and all(p.startswith(str(folder) + "/") for p in named_files(saved)), named_files(saved)
    out = plan.fitted.transform(frame())
    assert out.w is None
    np.savez(folder / "expected.npz", x_num=out.x_num, x_cat=out.x_cat, y=out.y)
    exp = expected(plan, saved, folder, commit, named_files(saved))
    if previous is not None:  # prepare(since=previous): each column's (ids before, ids after)
        exp["growth"] = {c: list(v) for c, v in plan.fitted.growth(previous.fitted).items()}
        exp["previous"] = previous_name
    (folder / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    return exp


def main() -> None:
    from deltalake import write_deltalake

    import pipeline

    where = Path(pipeline.__file__).resolve().parent
    assert (where / "tables.py").is_file() and not (where / "read").exists(), \
        f"{where}: not the flat layout; run this with the code of commit 211f37c first on the path (see the docstring)"
    assert "ray" not in sys.modules, "the fixtures are fitted in this process, without Ray"
    commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    for name in ("delta", "folder", *PLANS):
        shutil.rmtree(HERE / name, ignore_errors=True)

    # (a) a Delta table at version 1 (two data files)
    delta = str(HERE / "delta")
    write_deltalake(delta, rows(0, 1200))
    write_deltalake(delta, rows(1200, 2000), mode="append")  # v1
    plan_a = pipeline.prepare(delta, world_size=WORLD, use_ray=False, version="1", **SETTINGS)
    assert plan_a.timings["fit_on"] == "this process", plan_a.timings
    assert type(plan_a.source.table).__module__ == "pipeline.tables", type(plan_a.source.table)
    write(plan_a, "delta-plan", commit)

    # (b) an increment: the rows version 2 added, the delta plan's fit extended
    write_deltalake(delta, rows(2000, 3000, new=True), mode="append")  # v2
    plan_b = pipeline.prepare(delta, since=str(HERE / "delta-plan" / "plan.pkl"), world_size=WORLD, use_ray=False)
    assert (plan_b.increment.after, plan_b.increment.upto) == ("1", "2"), plan_b.increment
    assert plan_b.timings["fit_on"] == "this process", plan_b.timings
    previous = pipeline.IngestPlan.load(str(HERE / "delta-plan" / "plan.pkl"))
    grown = plan_b.fitted.growth(previous.fitted)
    assert any(b < a for b, a in grown.values()), grown  # the increment brought new values
    write(plan_b, "increment-plan", commit, previous=previous, previous_name="delta-plan")

    # (c) a folder of Parquet files with three bad ones, set aside
    import pyarrow.parquet as pq

    folder = HERE / "folder"
    folder.mkdir()
    for i in range(3):
        pq.write_table(rows(i * 700, (i + 1) * 700), folder / f"part-{i:05d}.parquet", row_group_size=300)
    pq.write_table(rows(2100, 2800), folder / "part-00003.parquet")
    data = (folder / "part-00003.parquet").read_bytes()
    (folder / "part-00003.parquet").write_bytes(data[: int(len(data) * 0.6)])  # truncated: the footer is gone
    (folder / "part-00004.parquet").write_bytes(b"")  # zero bytes
    odd = rows(2800, 3100)
    odd = odd.set_column(odd.schema.get_field_index("num_01"), "num_01", pa.array([f"{v}" for v in odd["num_01"].to_pylist()]))
    pq.write_table(odd, folder / "part-00005.parquet")  # 'num_01' a string column: its rows are known, set aside
    plan_c = pipeline.prepare(str(folder), world_size=WORLD, use_ray=False, on_bad_file="quarantine", **SETTINGS)
    assert plan_c.timings["fit_on"] == "this process", plan_c.timings
    assert len(plan_c.source.bad_files) == 3 and plan_c.accounting.balanced, (plan_c.source.bad_files, plan_c.accounting)
    write(plan_c, "quarantine-plan", commit)

    size = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    print(f"wrote {HERE} ({size:,} bytes) with the code of {commit} at {where}")
    for plan in (plan_a, plan_b, plan_c):
        print(" ", plan.describe()[1])


if __name__ == "__main__":
    main()
