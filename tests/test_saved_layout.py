"""Plans and fitted states saved by the code before the stage-folder move still load, and give the same arrays.

tests/data/layout-v1/ was written once by make.py beside it, with the flat `pipeline/` layout of commit f5db656
(see its docstring; never regenerate it). The pickled plan names its classes by that layout's module paths
(expected.json's "pickled_classes": pipeline.vocab_parts.Parts, pipeline.preprocess.FittedPreprocessor, ...), so
each of them must keep resolving. No Ray, no torch, no data files read.

`IngestPlan.save` made its path absolute, so the pickle names the vocabulary parts and the category counts by
the folder it was saved from (expected.json's "saved_from"); `relocated` points them at this checkout's copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import pipeline

HERE = Path(__file__).resolve().parent / "data" / "layout-v1"
EXPECTED = json.loads((HERE / "expected.json").read_text())
PLAN_FORMAT = "pipeline.IngestPlan/1"


def fixture_script(folder: Path):
    """A fixture folder's make.py as a module (its frame(), the rows whose transform expected.npz holds, and
    pickled_classes()), imported by path: the script stays off sys.path and out of sys.modules."""
    spec = importlib.util.spec_from_file_location(f"make_{folder.name.replace('-', '_')}", folder / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    return make


FRAME = fixture_script(HERE).frame()


def expected_arrays() -> dict[str, np.ndarray]:
    with np.load(HERE / "expected.npz") as d:
        return {k: d[k] for k in d.files}


def assert_transforms_like_saved(fitted) -> None:
    got, want = fitted.transform(FRAME), expected_arrays()
    assert got.w is None  # no weight column
    for name in ("x_num", "x_cat", "y"):
        arr = getattr(got, name)
        assert arr.dtype == want[name].dtype, name
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def _moved(path: str) -> str:
    old = EXPECTED["saved_from"]
    if path.startswith(str(HERE) + "/"):  # IngestPlan.load found it beside the plan already
        return path
    assert path == old or path.startswith(old + "/"), f"{path!r} is not under the folder the plan was saved from"
    return str(HERE) + path[len(old):]


def relocated(plan):
    """The plan with the files its pickle names (vocabulary parts, category counts) under this checkout's copy of
    the fixtures instead of the absolute folder make.py saved it from."""
    parts = {id(v.parts): v.parts for v in plan.fitted.vocab if hasattr(v, "parts")}
    assert parts, "the saved plan keeps its vocabularies in parts (vocab-<digest>/), named by the pickle"
    for p in parts.values():
        p.sources = [_moved(s) for s in p.sources]
        assert all(Path(s + ".arrow").is_file() for s in p.sources), p.sources
    h = plan.fitted.history
    assert h is not None and h.partitions, "plan.save keeps the category counts (counts-<digest>/)"
    h.sources = [_moved(s) for s in h.sources]
    assert all(Path(s).is_file() for s in h.sources), h.sources
    return plan


def assert_counts(h) -> None:
    """The category counts an increment extends (prepare(since=...)): readable, one count per training row."""
    assert h is not None and h.rows == EXPECTED["train_rows"]
    assert list(h.columns) == ["city", "device", "plan"]  # the vocabulary columns ('channel' is hashed)
    counted = {c: 0 for c in h.columns}
    for q in range(h.partitions):
        for c, t in h.part(q).items():
            counted[c] += int(t["n"].to_numpy().sum())
    assert counted["device"] == counted["plan"] == EXPECTED["train_rows"]  # no nulls in these two
    assert 0 < counted["city"] < EXPECTED["train_rows"]  # 'city' has nulls


def vocab_lists(fitted) -> dict[str, list[str]]:
    """Every categorical column's vocabulary, its values in id order (id 1 first)."""
    return {c: list(v) for c, v in zip(fitted.categorical, fitted.vocab)}


@pytest.fixture()
def plan():
    loaded = pipeline.IngestPlan.load(str(HERE / "plan.pkl"))
    sources = [s for v in loaded.fitted.vocab if hasattr(v, "parts") for s in v.parts.sources] + loaded.fitted.history.sources
    assert sources and all(s.startswith(str(HERE) + "/") for s in sources), sources  # found beside the plan by load
    return relocated(loaded)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXPECTED["pickled_classes"])
def test_every_pickled_class_path_resolves(path):
    """Each module.qualname the old pickle names still imports under its old path (what pickle.loads needs)."""
    module, name = path.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    assert callable(obj)


def test_plain_pickle_loads():
    data = (HERE / "plan.pkl").read_bytes()
    fmt, plan = pickle.loads(data)
    assert fmt == PLAN_FORMAT
    assert type(plan) is pipeline.IngestPlan
    assert plan.train_sizes == EXPECTED["train_sizes"]


def test_public_classes_are_the_old_paths():
    import pipeline.preprocess

    import pipeline.ingest

    assert pipeline.preprocess.FittedPreprocessor is pipeline.FittedPreprocessor
    assert pipeline.ingest.IngestPlan is pipeline.IngestPlan
    assert pipeline.preprocess.Transformed is pipeline.Transformed


def assert_plan_shares(plan, exp: dict) -> None:
    """A loaded plan is today's IngestPlan with the world, rows and shares an expected.json recorded, also
    re-planned for 3 ranks from the fit's counts alone (no data read)."""
    assert type(plan) is pipeline.IngestPlan and type(plan.fitted) is pipeline.FittedPreprocessor
    assert plan.world_size == exp["world_size"]
    assert plan.source.num_rows == exp["num_rows"]
    assert plan.train_rows == exp["train_rows"]
    assert plan.train_sizes == exp["train_sizes"]
    assert plan.val_sizes == exp["val_sizes"]
    assert not plan.empty
    assert plan.for_world(3).train_sizes == exp["world3_train_sizes"]
    assert plan.for_world(3).val_sizes == exp["world3_val_sizes"]


def test_plan_loads_with_its_counts(plan):
    assert_plan_shares(plan, EXPECTED)
    assert [Path(s.path).relative_to(EXPECTED["saved_from"]).as_posix() for s in plan.source.shards] == \
        ["data/part-00000.parquet", "data/part-00001.parquet"]
    assert list(plan.fitted.numeric) == EXPECTED["numeric"]
    assert list(plan.fitted.categorical) == EXPECTED["categorical"]
    assert plan.fitted.num_features == EXPECTED["num_features"]
    assert [[t.name, t.kind, list(t.classes)] for t in plan.fitted.targets] == EXPECTED["targets"]
    assert vocab_lists(plan.fitted) == EXPECTED["vocab"]
    assert_counts(plan.fitted.history)


def test_plan_transforms_like_saved(plan):
    assert_transforms_like_saved(plan.fitted)


@pytest.mark.parametrize("name", ["preprocessor.json", "fit.json"])
def test_fitted_state_loads_and_transforms_like_saved(name):
    path = str(HERE / "fitted" / name)
    if name == "fit.json":  # plan.save_fit: the fitted state is its "fitted" entry (what prepare(fit_from=) loads)
        saved = json.loads(Path(path).read_text())
        assert saved["format"] == "pipeline.Fit/1"
        fitted = pipeline.FittedPreprocessor.from_dict(saved["fitted"], path)
    else:
        fitted = pipeline.FittedPreprocessor.load(path)
    assert type(fitted) is pipeline.FittedPreprocessor
    assert vocab_lists(fitted) == EXPECTED["vocab"]
    assert_counts(fitted.history)
    assert_transforms_like_saved(fitted)


def test_plan_round_trip_pickle(plan):
    """The loaded plan pickled again (in memory, as Ray sends it) and loaded: the same vocabularies and arrays."""
    again = pickle.loads(pickle.dumps(plan))
    assert type(again) is pipeline.IngestPlan and type(again.fitted) is pipeline.FittedPreprocessor
    assert vocab_lists(again.fitted) == vocab_lists(plan.fitted) == EXPECTED["vocab"]
    assert again.train_sizes == plan.train_sizes
    assert_transforms_like_saved(again.fitted)


def test_plan_round_trip_save(plan, tmp_path):
    """The loaded plan saved again with plan.save (today's layout, its parts written beside it) and loaded."""
    uri = str(tmp_path / "plan.pkl")
    plan.save(uri)
    assert any(p.name.startswith("vocab-") for p in tmp_path.iterdir())
    again = pipeline.IngestPlan.load(uri)
    sources = [s for v in again.fitted.vocab if hasattr(v, "parts") for s in v.parts.sources]
    assert sources and all(s.startswith(str(tmp_path)) for s in sources), sources  # read from the new copy
    assert vocab_lists(again.fitted) == vocab_lists(plan.fitted) == EXPECTED["vocab"]
    assert again.train_sizes == EXPECTED["train_sizes"] and again.val_sizes == EXPECTED["val_sizes"]
    assert_transforms_like_saved(again.fitted)
    fmt, plain = pickle.load(io.BytesIO(Path(uri).read_bytes()))
    assert fmt == PLAN_FORMAT and type(plain) is pipeline.IngestPlan


def test_a_saved_plan_moved_to_another_folder_loads_and_transforms_from_there(plan, tmp_path):
    """plan.save's folder copied elsewhere (a run folder moved to another disk or bucket) and the original
    removed: IngestPlan.load reads the vocabulary and count parts beside the plan."""
    import shutil

    first = tmp_path / "first"
    first.mkdir()
    plan.save(str(first / "plan.pkl"))
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    again = pipeline.IngestPlan.load(str(moved / "plan.pkl"))
    sources = [s for v in again.fitted.vocab if hasattr(v, "parts") for s in v.parts.sources] + again.fitted.history.sources
    assert sources and all(s.startswith(str(moved) + "/") for s in sources), sources
    assert vocab_lists(again.fitted) == EXPECTED["vocab"]
    assert_transforms_like_saved(again.fitted)
    assert_counts(again.fitted.history)
