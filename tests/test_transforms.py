"""Per-column transforms (pipeline/fit/transforms.py): each apply checked against a plain numpy reference,
the hash against a pure-Python FNV-1a, the sketch's quantiles against exact ones within its stated
error, and the whole recipe bit-identical between training (the rank's packed rows), serving
(FittedPreprocessor.transform) and a saved-and-loaded preprocessor."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline
from pipeline.errors import DataError
from pipeline.fit.preprocess import FittedPreprocessor
from pipeline.fit.transforms import SKETCH_ALPHA, Sketch, cross_hash, fnv1a, hashed_ids


def fnv1a_reference(text: str, h: int = 0xCBF29CE484222325) -> int:
    for b in text.encode():
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def test_the_hash_is_fnv1a_of_the_utf8_text_whatever_the_layout():
    values = ["", "a", "ab", "hello world", "é中文", "x" * 70, None, "68fd1e64", "3"]
    want = [fnv1a_reference(v) if v is not None else None for v in values]
    for arr in (pa.array(values), pa.array(values, pa.large_string()), pa.array(values, pa.string_view()),
                pa.array(values).dictionary_encode(), pa.chunked_array([values[:4], values[4:]]),
                pa.array(values).slice(0)):
        h, ok = fnv1a(arr)
        assert [int(x) if o else None for x, o in zip(h, ok)] == want, arr.type
    # texts all as long (hashed ids: the bytes taken as a matrix), also sliced, with a seed (a cross), and
    # with a null or one other length among them (the general path)
    same = ["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "ê中xyz"]  # (the last: 8 bytes of UTF-8)
    for arr in (pa.array(same), pa.array(same).slice(2), pa.array(same, pa.large_string()),
                pa.array([*same, None]), pa.array([*same, "abc"])):
        h, ok = fnv1a(arr)
        assert [int(x) for x, o in zip(h, ok) if o] == [fnv1a_reference(v) for v in arr.to_pylist() if v is not None]
    seed = np.array([fnv1a_reference("a\x1f")] * len(same), np.uint64)
    assert [int(x) for x in fnv1a(pa.array(same), seed=seed)[0]] == [fnv1a_reference("a\x1f" + v) for v in same]
    # numbers hash as their text: 3, 3.0 and "3" are one value
    h3, _ = fnv1a(pa.array([3, 4]))
    hf, _ = fnv1a(pa.array([3.0, 4.0]))
    assert list(h3) == list(hf) == [fnv1a_reference("3"), fnv1a_reference("4")]
    # a cross is the texts joined by a 0x1f byte; any null makes it null
    t = pa.table({"a": ["x", "ab", None], "b": ["yz", "c", "q"]})
    h, ok = cross_hash(t, ("a", "b"))
    assert list(ok) == [True, True, False]
    assert int(h[0]) == fnv1a_reference("x\x1fyz") and int(h[1]) == fnv1a_reference("ab\x1fc")
    assert list(hashed_ids(h, ok, 10)) == [1 + fnv1a_reference("x\x1fyz") % 10, 1 + fnv1a_reference("ab\x1fc") % 10, 0]


@pytest.mark.parametrize("seed", range(3))
def test_the_sketch_merges_exactly_and_its_quantiles_are_within_the_stated_error(seed):
    rng = np.random.default_rng(seed)
    v = np.concatenate([rng.lognormal(2.0, 2.0, 20_000), -rng.exponential(5.0, 3_000), np.zeros(500),
                        [np.nan, np.inf]])
    parts = np.array_split(rng.permutation(v), 7)
    merged = Sketch.of(parts[0])
    for p in parts[1:]:
        merged = merged.merge(Sketch.of(p))
    whole = Sketch.of(v)
    assert merged.to_dict() == whole.to_dict() and merged.count == v.size - 2
    finite = np.sort(v[np.isfinite(v)])
    qs = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
    for q, got in zip(qs, whole.quantiles(qs)):
        exact = finite[int(q * (finite.size - 1))]
        assert abs(got - exact) <= SKETCH_ALPHA * abs(exact) + 1e-12, (q, got, exact)


def write(tmp_path, table: pa.Table, name: str = "d") -> str:
    d = tmp_path / name
    d.mkdir()
    for i, part in enumerate(np.array_split(np.arange(table.num_rows), 3)):
        pq.write_table(table.take(pa.array(part)), d / f"part-{i}.parquet", row_group_size=700)
    return str(d)


def ctr_table(n: int = 6000, seed: int = 0) -> pa.Table:
    """Criteo-like: counts with nulls, negatives and a heavy tail; hashed-looking categories, Zipf-like."""
    rng = np.random.default_rng(seed)
    counts = np.floor(rng.pareto(1.2, n) * 3).astype(np.int64) - (rng.random(n) < 0.05)
    cats = rng.zipf(1.3, n) % 5000
    return pa.table({
        "I1": pa.array(counts, mask=rng.random(n) < 0.1),
        "I2": pa.array(rng.normal(10, 3, n)),
        "C1": pa.array([f"{x:08x}" for x in cats], mask=rng.random(n) < 0.05),
        "C2": pa.array([f"{x:08x}" for x in rng.integers(0, 50, n)]),
        "label": pa.array((rng.random(n) < 0.25).astype(np.int8)),
    })


RECIPE = {
    "numeric_transform": {"log1p": True, "scale": "none", "fill": "zero"},
    "columns": {"I2": {"scale": "bucketize", "buckets": 8, "log1p": False, "fill": "median"},
                "hashed": {"columns": ["C2"], "encode": "hash", "buckets": 64},
                "C1": {"encode": "vocab+hash", "buckets": 32, "min_count": 3}},
    "crosses": [{"columns": ["C1", "C2"], "buckets": 128}],
}


@pytest.fixture(scope="module")
def fitted_recipe(tmp_path_factory) -> tuple[pa.Table, FittedPreprocessor]:
    """The CTR table and the RECIPE fitted on it (every row a training row)."""
    t = ctr_table()
    path = write(tmp_path_factory.mktemp("ctr"), t)
    plan = pipeline.prepare(path, label="label", world_size=1, numeric=["I1", "I2"], categorical=["C1", "C2"],
                            val_fraction=0.0, **RECIPE)
    return t, plan.fitted


def test_numeric_transforms_against_numpy(fitted_recipe):
    t, f = fitted_recipe
    out = f.transform(t)
    i1 = t["I1"].to_numpy(zero_copy_only=False).astype(np.float64)
    want = np.where(np.isnan(i1), 0.0, np.log1p(np.maximum(i1, 0.0)))  # negatives to 0, log1p, nulls 0
    assert np.array_equal(out.x_num[:, 0], want.astype(np.float32))
    i2 = t["I2"].to_numpy()
    bounds = np.asarray(f.boundaries[1])
    assert len(bounds) == 7
    exact = np.quantile(i2, np.arange(1, 8) / 8, method="lower")
    assert np.all(np.abs(bounds - exact) <= SKETCH_ALPHA * np.abs(exact) + 1e-9)
    assert np.array_equal(out.x_num[:, 1], np.searchsorted(bounds, i2, side="right").astype(np.float32))
    assert np.bincount(out.x_num[:, 1].astype(int)).min() > 0.8 * len(t) / 8  # about equal-count buckets
    assert f.num_features == 3 and f.indicators == ("I1",)  # I1 had nulls: its 0/1 missing indicator stays


def test_categorical_encodings_and_crosses(fitted_recipe):
    t, f = fitted_recipe
    assert f.categorical == ("C1", "C2", "C1*C2")
    c1 = t["C1"].to_pylist()
    counts = {v: c1.count(v) for v in set(c1) - {None}}
    vocab = f.vocab[0]
    assert set(vocab) == {v for v, c in counts.items() if c >= 3}  # the per-column min_count
    assert f.cardinalities == (len(vocab) + 1 + 32, 65, 129)
    x = f.transform(t).x_cat
    ids = {v: i + 1 for i, v in enumerate(vocab)}
    want = [0 if v is None else ids[v] if v in ids else len(vocab) + 1 + fnv1a_reference(v) % 32 for v in c1]
    assert x[:, 0].tolist() == want
    assert x[:, 1].tolist() == [1 + fnv1a_reference(v) % 64 for v in t["C2"].to_pylist()]
    assert x[:, 2].tolist() == [0 if a is None else 1 + fnv1a_reference(f"{a}\x1f{b}") % 128
                                for a, b in zip(c1, t["C2"].to_pylist())]
    # coverage of hashed ids: the share of rows whose bucket holds two or more distinct values
    def shared(values, buckets):
        present = [v for v in values if v is not None]
        per = {}
        for v in set(present):
            per.setdefault(fnv1a_reference(v) % buckets, set()).add(v)
        return sum(len(per[fnv1a_reference(v) % buckets]) >= 2 for v in present) / len(present)

    c2 = t["C2"].to_pylist()
    assert f.stats["categorical"]["C2"] == {"hashed_into": 64, "nulls": 0, "distinct": len(set(c2)),
                                            "shared_bucket_share": pytest.approx(shared(c2, 64))}
    cross = [None if a is None else f"{a}\x1f{b}" for a, b in zip(c1, c2)]
    assert f.stats["categorical"]["C1*C2"]["shared_bucket_share"] == pytest.approx(shared(cross, 128))
    rest = [v for v in c1 if v is not None and v not in ids]
    cov = f.stats["categorical"]["C1"]
    assert cov["unknown_share"] == 0.0 and cov["hashed_share"] == pytest.approx(len(rest) / sum(counts.values()))
    assert cov["shared_bucket_share"] == pytest.approx(shared(rest, 32) * len(rest) / sum(counts.values()))
    from pipeline.fit.preprocess import coverage_lines

    lines = coverage_lines(f, 1000, 1)
    assert f"'C2' {len(set(c2)):,} values hashed into 64 buckets" in lines[0]
    warned = [line for line in lines if line.startswith("[warning] 'C2'")]
    assert len(warned) == (shared(c2, 64) > 0.05) and all("Raise its buckets" in w for w in warned)


def test_training_serving_and_a_saved_preprocessor_give_identical_arrays(tmp_path):
    t = ctr_table(seed=3)
    path = write(tmp_path, t)
    plan = pipeline.prepare(path, label="label", world_size=2, numeric=["I1", "I2"], categorical=["C1", "C2"],
                            passthrough=["I1", "I2", "C1", "C2", "label"], val_fraction=0.2, **RECIPE)
    loaded = FittedPreprocessor.from_dict(json.loads(json.dumps(plan.fitted.to_dict())))
    assert loaded == plan.fitted
    f = plan.fitted
    for r in range(2):
        data = pipeline.rank_data(plan, batch_size=64, device="cpu", rank=r, world_size=2)
        for ds in (data.train, data.val):
            raw = pa.table({c: ds.extra[c] for c in ("I1", "I2", "C1", "C2", "label")})
            served = loaded.transform(raw)
            batch = ds.get_batch(__import__("torch").arange(len(ds)))
            assert np.array_equal(batch.x_num.numpy(), served.x_num) and np.array_equal(batch.x_cat.numpy(), served.x_cat)
    assert f.transform(t).x_num.tobytes() == loaded.transform(t).x_num.tobytes()


def test_a_wrong_transform_is_refused_naming_the_column_and_what_is_allowed(tmp_path):
    path = write(tmp_path, ctr_table(600))
    keys = dict(label="label", world_size=1, numeric=["I1", "I2"], categorical=["C1", "C2"])
    with pytest.raises(DataError, match=r"preprocess.columns.I9 names 'I9', which is not a feature column"):
        pipeline.prepare(path, **keys, columns={"I9": {"log1p": True}})
    with pytest.raises(DataError, match=r"sets \['log1p'\] for 'C1', a categorical column"):
        pipeline.prepare(path, **keys, columns={"C1": {"log1p": True}})
    with pytest.raises(DataError, match="has no hash buckets; set buckets"):
        pipeline.prepare(path, **keys, columns={"C1": {"encode": "hash"}})
    with pytest.raises(DataError, match="which the files do not have"):
        pipeline.prepare(path, **keys, crosses=[{"columns": ["C1", "nope"], "buckets": 4}])
    with pytest.raises(pipeline.ConfigError, match="'standardize', 'minmax', 'bucketize' or 'none'"):
        pipeline.prepare(path, **keys, columns={"I1": {"scale": "log"}})


def test_minmax_clip_and_constant_fill():
    import pyarrow as pa

    from pipeline.fit.columns import Columns
    from pipeline.fit.preprocess import partial_stats
    from pipeline.fit.transforms import NumericOp

    v = np.array([-5.0, 0.0, 2.0, 7.0, 100.0, np.nan])
    op = NumericOp(clip_min=0.0, clip_max=10.0, scale="minmax", fill="constant", fill_value=5.0)
    cols = Columns(numeric=("v",), dims=(0,), numeric_ops=(op,))
    t = pa.table({"v": v})
    f = FittedPreprocessor.from_stats(partial_stats(t, cols), cols, max_size=10, min_count=1, missing_indicator=False)
    out = f.transform(t, with_target=False).x_num[:, 0]
    assert out.tolist() == np.array([0.0, 0.0, 0.2, 0.7, 1.0, 0.5], dtype=np.float32).tolist()
    assert not math.isnan(f.fills[0])


@pytest.mark.parametrize("log1p", [False, True])
def test_clip_bounds_from_fitted_quantiles_are_within_the_sketchs_error(log1p, tmp_path):
    """clip_quantiles = [0.01, 0.99]: the bounds are the fitted 1st and 99th percentiles (within the
    sketch's relative error), the scaler's mean and std those of the clipped values (likewise), and
    serving and a saved-and-loaded preprocessor give identical arrays (training packs through the same
    apply)."""
    rng = np.random.default_rng(3)
    n = 40_000
    x = rng.pareto(1.5, n) * 10.0
    x[rng.random(n) < 0.05] = np.nan
    table = pa.table({"x": x, "label": rng.integers(0, 2, n)})
    path = tmp_path / "d"
    path.mkdir()
    for i, part in enumerate(np.array_split(np.arange(n), 4)):
        pq.write_table(table.take(part), path / f"part-{i}.parquet")
    plan = pipeline.prepare(str(path), label="label", numeric=["x"], categorical=[], world_size=1, val_fraction=0.0,
                            columns={"x": {"clip_quantiles": [0.01, 0.99], "log1p": log1p}})
    f = plan.fitted
    ok = x[np.isfinite(x)]
    exact = np.quantile(ok, [0.01, 0.99])
    (lo, hi), = f.clips
    assert abs(lo - exact[0]) <= 2 * SKETCH_ALPHA * abs(exact[0]) and abs(hi - exact[1]) <= 2 * SKETCH_ALPHA * exact[1]
    c = np.clip(ok, lo, hi)
    c = np.log1p(c) if log1p else c
    assert abs(f.mean[0] - c.mean()) <= 2 * SKETCH_ALPHA * abs(c.mean()) and abs(f.std[0] - c.std()) <= 2 * SKETCH_ALPHA * c.std()
    served = f.transform(table).x_num
    want = (c - f.mean[0]) / f.std[0]
    np.testing.assert_allclose(served[np.isfinite(x), 0], want, rtol=1e-5, atol=1e-6)
    f.save(str(tmp_path / "p.json"))
    assert FittedPreprocessor.load(str(tmp_path / "p.json")).transform(table).x_num.tobytes() == served.tobytes()
    with pytest.raises(DataError, match="both clip .* and clip_quantiles"):
        pipeline.prepare(str(path), label="label", numeric=["x"], categorical=[], world_size=1,
                         columns={"x": {"clip": [0, 1], "clip_quantiles": [0.01, 0.99]}})
    with pytest.raises(DataError, match="0 <= low < high <= 1"):
        pipeline.prepare(str(path), label="label", numeric=["x"], categorical=[], world_size=1,
                         columns={"x": {"clip_quantiles": [0.9, 0.1]}})


def test_a_users_function_runs_before_the_statistics_and_at_serving(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    t = ctr_table(2000, seed=5)
    path = write(tmp_path, t)
    keys = dict(label="label", numeric=["I2", "ratio"], categorical=["C2"], val_fraction=0.0,
                function="user_functions:ratio_and_domain")
    plan = pipeline.prepare(path, world_size=1, **keys)
    f = plan.fitted
    from user_functions import ratio_and_domain

    assert set(f.vocab[0]) == {v[:2] for v in t["C2"].to_pylist()}  # the statistics are of its output
    ratio = ratio_and_domain(t)["ratio"].to_numpy(zero_copy_only=False)
    assert f.mean[1] == pytest.approx(np.nanmean(ratio))
    loaded = FittedPreprocessor.from_dict(json.loads(json.dumps(f.to_dict())))
    served = loaded.transform(t)  # raw rows: serving runs the function too
    data = pipeline.rank_data(plan, batch_size=64, device="cpu")
    import torch

    order = np.argsort(data.train.row_id.numpy())
    batch = data.train.get_batch(torch.as_tensor(order))
    assert np.array_equal(batch.x_num.numpy(), served.x_num) and np.array_equal(batch.x_cat.numpy(), served.x_cat)
    with pytest.raises(DataError, match="cannot be imported here"):
        FittedPreprocessor.from_dict({**f.to_dict(), "function": "no_such_module:fn"})
    with pytest.raises(DataError, match="returned a Table of"):
        pipeline.prepare(path, world_size=1, **{**keys, "function": "user_functions:drops_rows"})


@pytest.mark.parametrize("op", [dict(log1p=True, scale="none", fill="zero"), dict(scale="minmax", fill="constant"),
                                dict(clip_min=-5.0, clip_max=40.0, log1p=True, scale="none", fill="zero"),
                                dict(scale="bucketize", boundaries=(0.0, 10.0), fill="zero")])
@pytest.mark.parametrize("dtype", [pa.int8(), pa.int64(), pa.uint64()])
def test_an_integer_column_without_moments_gives_the_statistics_of_its_values(op, dtype):
    """The fit takes an integer column's count, nulls, least and greatest straight from the integers when
    its transform needs no mean or variance (stats.integer_bounds): the same figures as the statistics of
    every value converted and prescaled, with nulls, negatives, huge integers and a row mask."""
    from pipeline.fit.stats import NumericStats, integer_bounds, needs_moments
    from pipeline.fit.transforms import NumericOp, prescale

    rng = np.random.default_rng(7)
    op = NumericOp(**op)
    assert not needs_moments(op)
    lo, hi = (-100, 100) if dtype == pa.int8() else (0, 2**64 - 1) if dtype == pa.uint64() else (-2**62, 2**62)
    values = [int(x) for x in rng.integers(lo, hi, 5000, dtype=np.uint64 if dtype == pa.uint64() else np.int64,
                                             endpoint=True)]
    values = [None if i % 7 == 0 else v for i, v in enumerate(values)]
    col = pa.chunked_array([pa.array(values[:3000], dtype), pa.array(values[3000:], dtype)])
    for rows in (None, rng.random(len(values)) < 0.9, np.zeros(len(values), bool)):
        got = integer_bounds(col, op, rows)
        raw = col.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        want = NumericStats.of(prescale(op, raw if rows is None else raw[rows]))
        assert (got.count, got.nulls, got.min, got.max) == (want.count, want.nulls, want.min, want.max)
