"""Plans of a Delta table, of an increment (prepare(since=...)) and of a folder with files set aside, saved by the
code before the stage-folder move, still load with their figures, and give the same arrays.

tests/data/layout-v1-tables/ was written once by make.py beside it, with the flat `pipeline/` layout of commit
211f37c (see its docstring; never regenerate it): delta-plan/ (its source a pipeline.tables.Snapshot of
pipeline.tables.TableFile), increment-plan/ (its `increment` a pipeline.increments.Range, its fitted state the
delta plan's extended) and quarantine-plan/ (pipeline.source.BadFile entries and their quarantine accounting).
Each holds plan.pkl with the vocab-<digest>/ and counts-<digest>/ parts it names, expected.json and expected.npz.

The pickles name the data by the absolute folder make.py ran in; nothing here reads the data (a clean clone
elsewhere has it at another path): only the pickles, the parts beside them, and FRAME transformed. No Ray.
"""

from __future__ import annotations

import importlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_saved_layout import assert_plan_shares, fixture_script

import pipeline

HERE = Path(__file__).resolve().parent / "data" / "layout-v1-tables"
PLANS = ("delta-plan", "increment-plan", "quarantine-plan")
EXPECTED = {name: json.loads((HERE / name / "expected.json").read_text()) for name in PLANS}
PLAN_FORMAT = "pipeline.IngestPlan/1"
EXPECTED_ROOT = EXPECTED["delta-plan"]["data_root"]  # the folder make.py ran in: the data paths are relative to it
assert all(e["data_root"] == EXPECTED_ROOT for e in EXPECTED.values())
STAGES = ("pipeline.read.", "pipeline.fit.", "pipeline.cluster.", "pipeline.feed.", "pipeline.bench.")


MAKE = fixture_script(HERE)
FRAME = MAKE.frame()  # the rows whose transform each expected.npz holds


def resolve(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def load(name: str, folder: Path = HERE):
    return pipeline.IngestPlan.load(str(folder / name / "plan.pkl"))


def vocab_lists(fitted) -> dict[str, list[str]]:
    """Every categorical column's vocabulary, its values in id order (id 1 first)."""
    return {c: list(v) for c, v in zip(fitted.categorical, fitted.vocab)}


def counted(h) -> dict[str, list[int]]:
    """Per counted column: [distinct values, rows] over every partition of the category counts (read from the
    counts-<digest>/ parts beside the plan)."""
    out = {c: [0, 0] for c in h.columns}
    for q in range(h.partitions):
        for c, t in h.part(q).items():
            out[c][0] += t.num_rows
            out[c][1] += int(t["n"].to_numpy().sum())
    return out


def relative(path: str, root: str) -> str:
    return Path(path).relative_to(root).as_posix()


def jsonable(x):
    return json.loads(json.dumps(x))


def bad_files(plan) -> list:
    return [[Path(b.path).name, b.reason, b.rows] for b in plan.source.bad_files]


def quarantined(plan) -> list[dict]:
    return [{**e, "file": Path(e["file"]).name} for e in plan.accounting.quarantined]


def table_figures(plan) -> dict | None:
    """The Delta snapshot the plan's source read (None: a folder of Parquet files)."""
    t, root = plan.source.table, EXPECTED_ROOT
    if t is None:
        return None
    return jsonable({"format": t.format, "name": relative(t.name, root), "version": t.version,
                     "fingerprint_version": t.fingerprint[2],
                     "files": [[f.path.rsplit("/", 1)[-1], f.rows, f.deleted_rows] for f in t.files],
                     "schema": t.schema.names if t.schema is not None else None})


def increment_figures(plan) -> dict | None:
    """The range an increment read (None: a full plan)."""
    inc = plan.increment
    if inc is None:
        return None
    return jsonable({"to_dict": {**inc.to_dict(), "source": relative(inc.name, EXPECTED_ROOT)}, "after": inc.after,
                     "upto": inc.upto, "next_id": inc.next_id, "notes": list(inc.notes), "describe": inc.describe()})


def assert_like_saved(plan, name: str, folder: Path = HERE) -> None:
    """The loaded plan's figures equal the ones make.py recorded with the old code."""
    exp = EXPECTED[name]
    src, acct, fitted = plan.source, plan.accounting, plan.fitted
    assert_plan_shares(plan, exp)
    assert [[relative(s.path, EXPECTED_ROOT), s.num_rows] for s in src.shards] == exp["shards"]
    assert len(src.fragments) == exp["fragments"]
    assert acct.as_dict() == exp["accounting"]
    assert [[k, *v] for k, v in sorted(acct.used_by_fragment.items())] == exp["used_by_fragment"]
    assert bad_files(plan) == exp["bad_files"]
    assert quarantined(plan) == exp["quarantined"]
    assert table_figures(plan) == exp["table"]
    assert increment_figures(plan) == exp["increment"]
    assert list(fitted.numeric) == exp["numeric"]
    assert list(fitted.categorical) == exp["categorical"]
    assert [[t.name, t.kind, list(t.classes)] for t in fitted.targets] == exp["targets"]
    assert fitted.num_features == exp["num_features"]
    assert list(fitted.cardinalities) == exp["cardinalities"]
    assert vocab_lists(fitted) == exp["vocab"]
    assert fitted.vocab_digest == exp["vocab_digest"]
    assert [{k: v for k, v in e.items() if k != "source"} for e in jsonable(fitted.lineage)] == exp["lineage"]
    h = fitted.history
    assert h is not None and h.rows == exp["history_rows"] and list(h.columns) == exp["history_columns"]
    assert counted(h) == exp["counted"]  # the counts an increment extends, readable from the parts beside the plan
    named = MAKE.named_files(plan)
    assert named and all(p.startswith(str(folder / name) + "/") for p in named), named  # found beside the plan
    assert [relative(p, str(folder / name)) for p in named] == exp["named_files"]


def assert_transforms_like_saved(fitted, name: str) -> None:
    got = fitted.transform(FRAME)
    assert got.w is None  # no weight column
    with np.load(HERE / name / "expected.npz") as want:
        assert sorted(want.files) == ["x_cat", "x_num", "y"]
        for key in want.files:
            arr = getattr(got, key)
            assert arr.dtype == want[key].dtype, (name, key)
            np.testing.assert_array_equal(arr, want[key], err_msg=f"{name}: {key}")


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted({p for e in EXPECTED.values() for p in e["pickled_classes"]}))
def test_every_pickled_class_path_resolves(path):
    """Each module.qualname an old pickle names still imports under its old path (what pickle.loads needs)."""
    assert callable(resolve(path))


@pytest.mark.parametrize("name", PLANS)
def test_the_pickles_name_the_flat_layout(name):
    """expected.json's class paths are the pickle's own, and they are the flat layout's (no stage folder)."""
    names = MAKE.pickled_classes((HERE / name / "plan.pkl").read_bytes())
    assert names == EXPECTED[name]["pickled_classes"]
    assert not [p for p in names if p.startswith(STAGES)], names


def test_the_old_table_increment_and_bad_file_paths_are_todays_classes():
    from pipeline.read import files, increments, snapshot

    assert resolve("pipeline.tables.Snapshot") is snapshot.Snapshot
    assert resolve("pipeline.tables.TableFile") is snapshot.TableFile
    assert resolve("pipeline.increments.Range") is increments.Range
    assert resolve("pipeline.source.BadFile") is files.BadFile


@pytest.mark.parametrize("name", PLANS)
def test_plan_loads_with_its_figures(name):
    plan = load(name)
    assert_like_saved(plan, name)


@pytest.mark.parametrize("name", PLANS)
def test_plain_pickle_names_the_parts_where_they_were_saved(name):
    """Without IngestPlan.load the pickle names the parts by the absolute folder make.py saved them in; load
    points them beside the plan (test_plan_loads_with_its_figures, and the copy below)."""
    fmt, plan = pickle.loads((HERE / name / "plan.pkl").read_bytes())
    assert fmt == PLAN_FORMAT and type(plan) is pipeline.IngestPlan
    saved_from = EXPECTED[name]["saved_from"]
    assert [relative(p, saved_from) for p in MAKE.named_files(plan)] == EXPECTED[name]["named_files"]


@pytest.mark.parametrize("name", PLANS)
def test_plan_transforms_like_saved(name):
    assert_transforms_like_saved(load(name).fitted, name)


def test_delta_plan_keeps_its_snapshot():
    plan = load("delta-plan")
    table = plan.source.table
    assert type(table) is resolve("pipeline.tables.Snapshot")
    assert table.files and all(type(f) is resolve("pipeline.tables.TableFile") for f in table.files)
    assert plan.increment is None and not plan.source.bad_files
    # the shards are the snapshot's files
    assert sorted(s.path for s in plan.source.shards) == sorted(f.path for f in table.files)
    assert sum(f.rows for f in table.files) == plan.source.num_rows


def test_increment_keeps_its_range_and_every_id():
    exp = EXPECTED["increment-plan"]
    plan, previous = load("increment-plan"), load(exp["previous"])
    inc = plan.increment
    assert type(inc) is resolve("pipeline.increments.Range")
    assert inc.next_id == previous.source.num_rows + plan.source.num_rows  # ids after the chain's rows
    assert plan.source.table.version == inc.upto
    assert previous.source.table.version == inc.after  # the range starts where the delta plan's version ended
    # growth: each column's (ids before, ids after) against the plan it extends, loaded here too
    grown = plan.fitted.growth(previous.fitted)
    assert {c: list(v) for c, v in grown.items()} == exp["growth"]
    assert [b for b, _ in grown.values()] == list(previous.fitted.cardinalities)
    assert [a for _, a in grown.values()] == list(plan.fitted.cardinalities)
    # ids never moved: the delta plan's vocabularies are the first ids of the increment's
    before, after = vocab_lists(previous.fitted), vocab_lists(plan.fitted)
    assert any(len(after[c]) > len(before[c]) for c in before), (before, after)
    for c in before:
        assert after[c][:len(before[c])] == before[c], c
    # the lineage names the delta plan's fitted state, as today's code digests it
    from pipeline.fit import history

    assert [e["previous"] for e in plan.fitted.lineage] == [history.lineage_digest(previous.fitted)]
    assert [relative(e["source"], EXPECTED_ROOT) for e in plan.fitted.lineage] == [exp["increment"]["to_dict"]["source"]]
    assert plan.fitted.history.rows == previous.fitted.history.rows + plan.train_rows


def test_quarantine_plan_accounts_for_its_bad_files():
    exp = EXPECTED["quarantine-plan"]
    plan = load("quarantine-plan")
    bad, acct = plan.source.bad_files, plan.accounting
    assert bad and all(type(b) is resolve("pipeline.source.BadFile") for b in bad)
    assert bad_files(plan) == exp["bad_files"] and quarantined(plan) == exp["quarantined"]
    assert [Path(e["file"]).name for e in acct.quarantined] == [Path(b.path).name for b in bad]
    assert acct.rows_quarantined == exp["accounting"]["rows_quarantined"] == sum(b.rows or 0 for b in bad)
    assert acct.unknown_row_files == exp["accounting"]["unknown_row_files"] == sum(b.rows is None for b in bad)
    assert acct.balanced and acct.rows_read == acct.rows_used + acct.rows_dropped + acct.rows_quarantined
    assert len(acct.manifest_jsonl().splitlines()) == len(exp["quarantined"])
    assert not {Path(b.path).name for b in bad} & {Path(s.path).name for s in plan.source.shards}


@pytest.mark.parametrize("name", PLANS)
def test_plan_round_trip_save(name, tmp_path):
    """The loaded plan saved again with plan.save (today's layout, its parts written beside it) and loaded: the
    same figures and arrays, and the new pickle names today's module paths."""
    plan = load(name)
    (tmp_path / name).mkdir()
    uri = str(tmp_path / name / "plan.pkl")
    plan.save(uri)
    again = load(name, tmp_path)
    exp = EXPECTED[name]
    assert vocab_lists(again.fitted) == vocab_lists(plan.fitted) == exp["vocab"]
    assert again.train_sizes == exp["train_sizes"] and again.val_sizes == exp["val_sizes"]
    assert again.accounting.as_dict() == exp["accounting"]
    assert again.increment == plan.increment and again.source.bad_files == plan.source.bad_files
    assert again.source.table == plan.source.table
    assert_transforms_like_saved(again.fitted, name)
    assert all(p.startswith(str(tmp_path / name) + "/") for p in MAKE.named_files(again))
    data = Path(uri).read_bytes()
    fmt, plain = pickle.loads(data)
    assert fmt == PLAN_FORMAT and type(plain) is pipeline.IngestPlan
    from pipeline import _moved

    assert not [p for p in MAKE.pickled_classes(data) if p.rsplit(".", 1)[0] in _moved.MOVED], MAKE.pickled_classes(data)


@pytest.mark.parametrize("name", PLANS)
def test_an_old_plan_moved_to_another_folder_loads_from_there(name, tmp_path):
    """The old plan's folder (plan.pkl and its parts, not the data) copied elsewhere, as a clean clone at another
    path has it: IngestPlan.load reads the parts beside the copy, with the same figures and arrays."""
    shutil.copytree(HERE / name, tmp_path / name, ignore=shutil.ignore_patterns("expected.*"))
    plan = load(name, tmp_path)
    assert_like_saved(plan, name, tmp_path)
    assert_transforms_like_saved(plan.fitted, name)
