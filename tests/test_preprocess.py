"""Preprocessing against a numpy/pandas reference, fragment-merge invariance, save/load equality."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from helpers import vocab_order
from pipeline.fit.columns import Columns, Target
from pipeline.fit.preprocess import FittedPreprocessor, PartialStats, partial_stats

NUM = ["a", "b", "const", "ints"]
CAT = ["color", "code"]


def frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    a = rng.normal(5.0, 3.0, n)
    a[rng.random(n) < 0.1] = np.nan  # nulls in a numeric column
    colors = rng.choice(["red", "green", "blue", "teal", "rare"], n, p=[0.4, 0.3, 0.2, 0.09, 0.01]).astype(object)
    colors[rng.random(n) < 0.05] = None
    return pd.DataFrame({
        "a": a,
        "b": rng.exponential(100.0, n),
        "const": np.full(n, 3.5),
        "ints": rng.integers(-1000, 1000, n),
        "color": colors,
        "code": rng.integers(0, 7, n),  # an integer categorical column
        "label": rng.integers(0, 2, n),
    })


COLS = Columns(numeric=tuple(NUM), dims=(0,) * len(NUM), categorical=tuple(CAT), targets=(Target("label", "int", "auto"),))


def fit_local(df: pd.DataFrame, chunks: int = 1, cols: Columns = COLS, **kw) -> FittedPreprocessor:
    total = PartialStats()
    for part in np.array_split(np.arange(len(df)), chunks):
        total = total.merge(partial_stats(pa.Table.from_pandas(df.iloc[part], preserve_index=False), cols))
    opts = dict(max_size=100, min_count=1, missing_indicator=True) | kw
    return FittedPreprocessor.from_stats(total, cols, **opts)


def reference(df_fit: pd.DataFrame, df: pd.DataFrame, max_size=100, min_count=1):
    cols = []
    for c in NUM:
        mean, var = df_fit[c].mean(), df_fit[c].var(ddof=0)
        std = np.sqrt(var) if var > 0 else 1.0
        cols.append(((df[c].astype(float) - mean) / std).fillna(0.0).to_numpy())
    for c in NUM:
        if df_fit[c].isna().any():
            cols.append(df[c].isna().to_numpy().astype(float))
    x = np.stack(cols, 1).astype(np.float32)
    ids = []
    for c in CAT:
        counts = df_fit[c].dropna().astype(str).value_counts()
        kept = vocab_order((v, n) for v, n in counts.items() if n >= min_count)[:max_size]
        lookup = {v: i + 1 for i, v in enumerate(kept)}
        ids.append(df[c].map(lambda v: lookup.get(str(v), 0) if v is not None and v == v else 0).to_numpy())
    return x, np.stack(ids, 1).astype(np.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transform_matches_reference_with_nulls_constants_and_unseen(seed):
    df_fit = frame(5000, seed)
    df_new = frame(1000, seed + 100)
    df_new.loc[::7, "color"] = "never-seen"
    df_new.loc[::11, "code"] = 99
    fitted = fit_local(df_fit)
    x_ref, ids_ref = reference(df_fit, df_new)
    out = fitted.transform(df_new)
    assert out.x_num.dtype == np.float32 and out.x_cat.dtype == np.int32 and out.y.dtype == np.float32
    np.testing.assert_allclose(out.x_num, x_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.x_cat, ids_ref)
    assert (out.x_cat[::7, 0] == 0).all() and (out.x_cat[::11, 1] == 0).all()  # unseen -> 0
    assert np.all(out.x_num[:, NUM.index("const")] == 0.0)  # constant column: no division by zero
    assert fitted.indicators == ("a",)  # only the column that had nulls gets an indicator


@pytest.mark.parametrize("chunks", [2, 7, 50])
def test_fit_is_independent_of_how_rows_are_split(chunks):
    df = frame(3000, 5)
    one, many = fit_local(df, 1), fit_local(df, chunks)
    np.testing.assert_allclose(many.mean, one.mean, rtol=1e-12)
    np.testing.assert_allclose(many.std, one.std, rtol=1e-10)
    assert many.vocab == one.vocab and many.stats["targets"] == one.stats["targets"] and many.targets == one.targets


def test_vocab_size_limit_and_min_count():
    df = frame(5000, 3)
    f = fit_local(df, max_size=2, min_count=1)
    assert f.vocab[0] == ("red", "green")
    f = fit_local(df, min_count=200)  # 'rare' (about 1%) falls under the minimum count
    assert "rare" not in f.vocab[0] and "red" in f.vocab[0]
    x_ref, ids_ref = reference(df, df, min_count=200)
    np.testing.assert_array_equal(f.transform(df).x_cat, ids_ref)


def test_save_load_gives_identical_arrays(tmp_path):
    df = frame(4000, 9)
    fitted = fit_local(df, 3)
    path = str(tmp_path / "pre.json")
    fitted.save(path)
    loaded = FittedPreprocessor.load(path)
    assert loaded == fitted
    a, b = fitted.transform(df), loaded.transform(pa.Table.from_pandas(df))
    for x, y in [(a.x_num, b.x_num), (a.x_cat, b.x_cat), (a.y, b.y)]:
        assert x.tobytes() == y.tobytes()
    serving = loaded.transform(df.drop(columns=["label"]))  # serving data has no label
    assert serving.y is None and serving.x_num.tobytes() == a.x_num.tobytes()
    assert loaded.targets[0].kind == "binary"  # 0/1 integers


def test_version_1_files_still_load():
    d = fit_local(frame(300, 1)).to_dict()
    v1 = {"format": d["format"], "version": 1, "label": "label", "categorical": d["categorical"], "stats": {},
          "numeric": [{k: e[k] for k in ("name", "mean", "std", "missing_indicator")} for e in d["numeric"]]}
    old = FittedPreprocessor.from_dict(v1)
    assert old.targets[0].kind == "binary" and old.mean == fit_local(frame(300, 1)).mean


def test_dictionary_encoded_categorical_is_the_same_as_plain():
    df = frame(2000, 4)
    fitted = fit_local(df)
    table = pa.Table.from_pandas(df, preserve_index=False)
    dict_table = table.set_column(table.schema.get_field_index("color"), "color", table["color"].dictionary_encode())
    np.testing.assert_array_equal(fitted.transform(dict_table).x_cat, fitted.transform(table).x_cat)


def test_dictionary_columns_fit_and_transform_like_plain_ones():
    """The reader hands string categoricals over as dictionaries (row_groups.opened): their ids and counts
    must equal the plain column's, with nulls, unused and unseen dictionary entries, chunks with
    different dictionaries, and dictionaries of numbers (a pandas categorical of ints)."""
    df = frame(3000, 5)
    table = pa.Table.from_pandas(df, preserve_index=False)
    fitted = fit_local(df)
    color = table["color"].combine_chunks()
    parts = [color.slice(0, 1000).dictionary_encode(), color.slice(1000).dictionary_encode()]
    unused = pa.DictionaryArray.from_arrays(parts[0].indices, pa.concat_arrays([parts[0].dictionary, pa.array(["never", "unseen"], parts[0].dictionary.type)]))
    code = pa.array(df["code"].astype("category"))  # dictionary<int8, int64>
    assert pa.types.is_dictionary(code.type)
    dict_table = table.set_column(table.schema.get_field_index("color"), "color", pa.chunked_array([unused, parts[1]]))
    dict_table = dict_table.set_column(dict_table.schema.get_field_index("code"), "code", code)
    np.testing.assert_array_equal(fitted.transform(dict_table).x_cat, fitted.transform(table).x_cat)
    np.testing.assert_array_equal(fitted.pack(dict_table), fitted.pack(table))
    plain, as_dict = partial_stats(table, COLS), partial_stats(dict_table, COLS)
    counts = lambda s, c: dict(zip(*s.counts(c).to_pydict().values()))  # noqa: E731
    assert all(counts(as_dict, c) == counts(plain, c) for c in COLS.categorical)
    assert as_dict.category_nulls == plain.category_nulls
    assert "never" not in counts(as_dict, "color")  # a dictionary entry no row uses is not a category


def test_load_refuses_unknown_format_and_newer_version():
    with pytest.raises(ValueError, match="not a fitted preprocessor"):
        FittedPreprocessor.from_dict({"format": "other"})
    d = fit_local(frame(100, 0)).to_dict() | {"version": 99}
    with pytest.raises(ValueError, match="newer"):
        FittedPreprocessor.from_dict(d)


def test_vocabulary_coverage_is_said_and_a_large_unknown_share_is_warned(tmp_path):
    """A high-cardinality column at the default vocab_max_size: most rows become "unknown", and the
    plan says so (per column: distinct, kept, unknown share) with a warning naming the setting."""
    import pyarrow.parquet as pq

    import pipeline

    rng = np.random.default_rng(0)
    n = 50_000
    ids = np.where(rng.random(n) < 0.2, rng.integers(0, 10, n), rng.integers(10, 10**9, n))
    table = pa.table({"user": pa.array([f"u{i}" for i in ids]), "small": pa.array([f"s{i % 5}" for i in range(n)]),
                      "y": pa.array(rng.integers(0, 2, n))})
    pq.write_table(table, tmp_path / "f.parquet")
    plan = pipeline.prepare(str(tmp_path), label="y", world_size=1, categorical=["user", "small"], val_fraction=0.0)
    cov = plan.fitted.stats["categorical"]
    counts = dict(zip(*np.unique(table["user"].to_numpy(zero_copy_only=False), return_counts=True)))
    kept = set(plan.fitted.vocab[0])
    assert len(kept) == 1000 and cov["user"]["distinct"] == len(counts) and cov["user"]["kept"] == 1000
    assert cov["user"]["unknown_share"] == pytest.approx(sum(c for v, c in counts.items() if v not in kept) / n)
    assert cov["user"]["unknown_share"] > 0.7 and cov["small"]["unknown_share"] == 0.0
    lines = "\n".join(plan.describe())
    assert f"'user' 1,000 of {len(counts):,} values kept" in lines
    warnings = [line for line in plan.describe() if line.startswith("[warning]")]
    assert len(warnings) == 1 and "'user'" in warnings[0] and "preprocess.vocab_max_size = 1,000" in warnings[0]
    # The transformed rows agree: the share of unknown ids is the share said.
    x_cat = plan.fitted.transform(table).x_cat
    assert (x_cat[:, 0] == 0).mean() == pytest.approx(cov["user"]["unknown_share"])
