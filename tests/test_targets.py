"""Every target kind and every column a Parquet writer produces, through the public API without Ray:
prepare (validate, fit, plan) -> rank_data (rows, loader) -> serving transform, checked against the
values written."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline
from pipeline import ConfigError, DataError

N = 3000


def write(tmp_path, table: pa.Table, files: int = 3, row_group: int = 400) -> str:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for i in range(files):
        pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]), str(d / f"part-{i}.parquet"),
                       row_group_size=row_group)
    return str(d)


def base(n: int = N, seed: int = 0) -> dict[str, pa.Array]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    return {
        "x": pa.array(x * 3 + 1),
        "z": pa.array(rng.integers(0, 100, n)),
        "color": pa.array(rng.choice(["red", "green", "blue"], n)),
        "flag": pa.array(rng.random(n) < 0.3),
        "bin_int": pa.array((x > 0).astype(np.int8)),
        "bin_bool": pa.array(x > 0.5),
        "cls_str": pa.array(np.where(x > 1, "high", np.where(x < -1, "low", "mid"))),
        "cls_int": pa.array(np.digitize(x, [-1, 0, 1]) * 10),  # 0, 10, 20, 30
        "reg": pa.array(5.0 * x + 100.0),
    }


def all_rows(plan, **kw):
    """Every rank's (train, val) datasets, in-process."""
    return [pipeline.rank_data(plan, rank=r, world_size=plan.world_size, device="cpu", **kw)
            for r in range(plan.world_size)]


def values_by_row(table: pa.Table, col: str, ids) -> list:
    return [table[col][int(i)].as_py() for i in ids]


TARGETS = [("bin_int", "binary", 2), ("bin_bool", "binary", 2), ("cls_str", "multiclass", 3),
           ("cls_int", "multiclass", 4), ("reg", "regression", 0)]


@pytest.mark.parametrize("label,kind,classes", TARGETS)
def test_target_kind_is_detected_and_values_travel_exactly(tmp_path, label, kind, classes):
    table = pa.table(base())
    path = write(tmp_path, table)
    plan = pipeline.prepare(path, label=label, numeric=["x", "z"], categorical=["color"], world_size=2)
    t = plan.fitted.target()
    assert (t.kind, t.num_classes) == (kind, classes)
    seen = []
    for data in all_rows(plan):
        for ds in (data.train, data.val):
            ids = ds.row_id.numpy()
            seen.append(ids)
            y = ds.y.numpy()
            back = plan.fitted.inverse_target(y, label)
            want = values_by_row(table, label, ids)
            if kind == "regression":
                np.testing.assert_allclose(back, want, rtol=1e-5)
            elif label == "bin_bool":
                assert list(back) == [str(v).lower() for v in want]
            else:
                assert list(back) == [str(v) for v in want]
    assert sorted(np.concatenate(seen).tolist()) == list(range(N))  # every row once, train or validation


def test_unseen_class_and_bad_targets_are_errors_at_serving_never_unknown(tmp_path):
    plan = pipeline.prepare(write(tmp_path, pa.table(base())), label="cls_str", numeric=["x"], categorical=[])
    new = pa.table({"x": [0.0, 1.0], "cls_str": ["mid", "enormous"]})
    with pytest.raises(DataError, match="'cls_str' has 'enormous'"):
        plan.fitted.transform(new)
    assert plan.fitted.transform(new, with_target=False).y is None
    assert plan.fitted.transform(new.slice(0, 1)).y.tolist() == [plan.fitted.target().classes.index("mid")]


def test_missing_regression_target_is_dropped_never_filled(tmp_path):
    cols = base()
    reg = np.asarray(cols["reg"])
    cols["reg"] = pa.array(reg, mask=np.arange(N) % 50 == 0)
    plan = pipeline.prepare(write(tmp_path, pa.table(cols)), label="reg", numeric=["x"], on_bad_value="fill")
    assert plan.accounting.dropped == {"null or NaN target in 'reg'": N // 50}
    assert plan.accounting.balanced and plan.accounting.rows_used == N - N // 50
    t = plan.fitted.target()
    assert t.std > 1.0 and abs(t.mean - reg[np.arange(N) % 50 != 0].mean()) < 0.5  # standardised by default
    data = all_rows(plan)[0]
    assert abs(float(data.train.y.mean())) < 0.1 and (np.arange(N)[::50] != data.train.row_id.numpy()[:, None]).all()


def test_explicit_binary_drops_values_that_are_not_0_or_1(tmp_path):
    cols = base()
    cols["bin_int"] = pa.array(np.where(np.arange(N) % 100 == 7, 2, np.asarray(cols["bin_int"])).astype(np.int8))
    path = write(tmp_path, pa.table(cols))
    assert pipeline.prepare(path, label="bin_int", numeric=["x"]).fitted.target().kind == "multiclass"  # auto
    plan = pipeline.prepare(path, label="bin_int", target_kind="binary", numeric=["x"])
    assert plan.accounting.dropped == {"binary target not 0 or 1 in 'bin_int'": N // 100}
    with pytest.raises(DataError, match=r"'bin_int'.*has 2 .*binary target not 0 or 1.*row 7 "):
        pipeline.prepare(path, label="bin_int", target_kind="binary", numeric=["x"], on_bad_value="fail")


def test_several_targets_weights_and_none(tmp_path):
    cols = base()
    w = np.random.default_rng(1).random(N) * 2
    w[5] = -1.0  # a bad weight drops its row
    cols["w"] = pa.array(w)
    table = pa.table(cols)
    path = write(tmp_path, table)
    plan = pipeline.prepare(path, label=["bin_int", "cls_str", "reg"], weight="w", numeric=["x"], categorical=["color"],
                            val_fraction=0.0)
    assert [t.kind for t in plan.fitted.targets] == ["binary", "multiclass", "regression"]
    assert plan.accounting.dropped == {"null, NaN, inf or negative weight in 'w'": 1}
    data = all_rows(plan, batch_size=64)[0]
    batch = next(iter(data.loader))
    assert batch.y.shape == (64, 3) and batch.w.shape == (64,)
    ids = data.loader.last_index
    row_ids = data.train.row_id[ids].numpy()
    np.testing.assert_allclose(batch.w.numpy(), w[row_ids], rtol=1e-6)
    assert plan.fitted.inverse_target(batch.y[:, 1].numpy(), "cls_str").tolist() == values_by_row(table, "cls_str", row_ids)

    none = pipeline.prepare(path, label="", numeric=["x"], val_fraction=0.0)
    assert none.fitted.targets == () and none.accounting.rows_used == N
    batch = next(iter(all_rows(none, batch_size=32)[0].loader))
    assert batch.y.shape == (32, 0) and batch.w is None


def test_vector_features_list_and_fixed_size_list(tmp_path):
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(N, 4)) * [1, 10, 100, 1000]
    emb3 = rng.normal(size=(N, 3))
    lists = pa.array([list(r) for r in emb], type=pa.list_(pa.float32()))
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(emb3.ravel()), 3)
    cols = base() | {"emb": lists, "emb3": fixed}
    path = write(tmp_path, pa.table(cols))
    plan = pipeline.prepare(path, label="bin_int", numeric=["x", "emb", "emb3"], val_fraction=0.0)
    f = plan.fitted
    assert f.dims == (0, 4, 3) and f.num_features == 8
    data = all_rows(plan)[0]
    x = data.train.x_num.numpy()
    ids = data.train.row_id.numpy()
    ref = np.asarray(lists.to_pylist(), dtype=np.float32).astype(np.float64)[ids]
    np.testing.assert_allclose(x[:, 1:5], (ref - ref.mean(0)) / ref.std(0), atol=1e-4)
    np.testing.assert_allclose(x[:, 5:8], (emb3[ids] - emb3.mean(0)) / emb3.std(0), atol=1e-4)

    bad = cols | {"emb": pa.array([list(r) if i % 500 else list(r[:3]) for i, r in enumerate(emb)],
                                  type=pa.list_(pa.float32()))}
    (tmp_path / "bad").mkdir()
    path2 = write(tmp_path / "bad", pa.table(bad))
    with pytest.raises(DataError, match=r"'emb'.*a list whose length is not 4"):
        pipeline.prepare(path2, label="bin_int", numeric=["emb"], on_bad_value="fail")
    dropped = pipeline.prepare(path2, label="bin_int", numeric=["emb"], on_bad_value="drop_row")
    assert dropped.accounting.dropped == {"a list whose length is not 4 in 'emb'": N // 500}


def test_passthrough_columns_travel_beside_their_rows(tmp_path):
    cols = base() | {"id": pa.array([f"user-{i}" for i in range(N)]), "ts": pa.array(np.arange(N).astype("datetime64[ms]"))}
    table = pa.table(cols)
    plan = pipeline.prepare(write(tmp_path, table), label="reg", numeric=["x"], passthrough=["id", "ts", "x"],
                            world_size=2)
    for data in all_rows(plan, batch_size=50):
        for ds in (data.train, data.val):
            ids = ds.row_id.numpy()
            assert list(ds.extra["id"]) == [f"user-{i}" for i in ids]
            assert (ds.extra["ts"] == np.arange(N).astype("datetime64[ms]")[ids]).all()
        batch = next(iter(data.loader))  # a batch's pass-through values: by the loader's last index
        got = data.train.extra["x"][data.loader.last_index.numpy()]
        np.testing.assert_allclose((got - plan.fitted.mean[0]) / plan.fitted.std[0], batch.x_num[:, 0], rtol=1e-5)


def test_a_categorical_read_as_a_dictionary_is_also_passed_through_with_its_nulls(tmp_path):
    rng = np.random.default_rng(3)
    city = rng.choice(["north", "south", "east"], N).astype(object)
    city[rng.random(N) < 0.1] = None
    table = pa.table(base() | {"city": pa.array(city, pa.string())})
    plan = pipeline.prepare(write(tmp_path, table), label="bin_int", numeric=["x"], categorical=["city"],
                            passthrough=["city"], world_size=2)
    served = plan.fitted.transform(table).x_cat[:, 0]  # a plain (not dictionary) column, as a user serves it
    for data in all_rows(plan):
        for ds in (data.train, data.val):
            ids = ds.row_id.numpy()
            assert list(ds.extra["city"]) == [city[i] for i in ids]
            np.testing.assert_array_equal(ds.x_cat[:, 0].numpy(), served[ids])


def test_features_inferred_from_the_schema(tmp_path):
    cols = base() | {"blob": pa.array([b"x"] * N), "nested": pa.array([{"a": 1}] * N),
                     "ts": pa.array(np.arange(N).astype("datetime64[s]")), "id": pa.array(np.arange(N))}
    plan = pipeline.prepare(write(tmp_path, pa.table(cols)), label="reg", exclude=["id", "bin_int", "bin_bool",
                                                                                   "cls_int", "cls_str"])
    c = plan.source.columns
    assert c.numeric == ("x", "z", "ts") and c.categorical == ("color", "flag")
    assert "skipped blob (binary), nested (struct<a: int64>)" in plan.source.describe_columns()
    assert plan.fitted.num_features == 3


def test_numbers_float64_cannot_hold_are_converted_not_a_traceback(tmp_path):
    big = np.arange(N, dtype=np.int64) + 2**60  # beyond 2**53
    cols = base() | {"big": pa.array(big), "dec": pa.array([f"{v:.2f}" for v in np.arange(N) / 7]).cast(pa.decimal128(12, 2)),
                     "half": pa.array(np.arange(N, dtype=np.float16))}
    cols["ts"] = pa.array(np.arange(N).astype("datetime64[ms]"))
    cols["dur"] = pa.array(np.arange(N).astype("timedelta64[s]"))
    plan = pipeline.prepare(write(tmp_path, pa.table(cols)), label="bin_int", numeric=["big", "dec", "half", "ts", "dur"])
    x = all_rows(plan)[0].train.x_num.numpy()
    assert np.isfinite(x).all() and x[:, :5].std(0).min() > 0.5
    notes = [line for line in plan.describe() if line.startswith("[columns]")]  # each conversion said once
    assert len(notes) == 4 and "'big' (int64) holds integers beyond 2^53" in notes[0], notes
    assert "'dec' (decimal128(12, 2)) is rounded" in notes[1] and "'ts' (timestamp[ms]) is its integer count of ms" in notes[2]


def test_an_unexpected_error_in_a_task_is_one_paragraph_naming_file_and_row_group(tmp_path, monkeypatch):
    from pipeline.cluster import tasks

    path = write(tmp_path, pa.table(base()))

    def broken(*args, **kwargs):
        raise ZeroDivisionError("something nobody expected")

    monkeypatch.setattr(tasks, "partial_stats", broken)
    with pytest.raises(DataError) as e:
        pipeline.prepare(path, label="reg", numeric=["x"], use_ray=False)
    msg = str(e.value)
    assert "unexpected ZeroDivisionError while reading row group 0 of" in msg and "part-0.parquet" in msg
    assert "\n" not in msg and "--debug" in msg and "Traceback" in e.value.details


def test_prepare_keywords_are_checked_and_configs_compose(tmp_path):
    path = write(tmp_path, pa.table(base()))
    with pytest.raises(ConfigError, match="did you mean 'numeric'"):
        pipeline.prepare(path, label="reg", numerc=["x"])
    cfg = pipeline.load_config(None, {"data.path": path, "data.label": "reg", "data.numeric": ["x"]})
    plan = pipeline.prepare(config=cfg, categorical=["color"], world_size=3)
    assert plan.source.columns.categorical == ("color",) and plan.world_size == 3
    sizes = plan.train_sizes
    assert max(sizes) - min(sizes) <= 1 and max(plan.val_sizes) - min(plan.val_sizes) <= 1
    two = pipeline.rank_data(plan, rank=0, world_size=2)  # another world size: re-planned from the same fit
    assert two.plan.world_size == 2 and len(two.train) == two.plan.train_sizes[0] and two.plan.fitted is plan.fitted
    with pytest.raises(pipeline.PipelineError, match="rank 2 is not one of world_size=2"):
        pipeline.rank_data(plan, rank=2, world_size=2)


def test_a_saved_fit_is_reused_while_the_data_is_unchanged_and_refused_after(tmp_path):
    import os

    path = write(tmp_path, pa.table(base()))
    first = pipeline.prepare(path, label="reg", numeric=["x"], world_size=2)
    fit = str(tmp_path / "fit.json")
    first.save_fit(fit)
    again = pipeline.prepare(path, label="reg", numeric=["x"], world_size=3, fit_from=fit)
    assert again.fitted == first.fitted and again.timings["fit_on"] == f"reused {fit}" and again.timings["fit_s"] == 0
    assert again.accounting.as_dict() == first.accounting.as_dict() and sum(again.train_sizes) == sum(first.train_sizes)
    with pytest.raises(pipeline.PipelineError, match=r"settings changed \(data.numeric"):
        pipeline.prepare(path, label="reg", numeric=["x", "z"], fit_from=fit)
    f0 = os.path.join(path, "part-0.parquet")
    pq.write_table(pq.read_table(f0).slice(0, 10), f0)  # the data changed under the saved fit
    with pytest.raises(pipeline.PipelineError, match="1 files were added, removed or changed since"):
        pipeline.prepare(path, label="reg", numeric=["x"], fit_from=fit)
