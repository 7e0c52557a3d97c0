"""The partitioned count shuffle (pipeline/fit/counts.py) behind every fit's vocabularies: the ids are the
documented order (most rows, then FNV-1a hash, then text) cut at max_size and min_count, the same for
any number of hash ranges and with Ray or without; the coverage figures equal a direct count; a lookup
loads only the parts it touches; what leaves a reducer is sizes and histograms, never a value."""

import pickle

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import fnv1a64, vocab_order
from pipeline.fit import counts
from pipeline.fit.columns import Columns, Target
from pipeline.fit.preprocess import FittedPreprocessor, PartialStats, partial_stats
from pipeline.fit.transforms import CategoricalOp


def heavy_tailed(n: int, distinct: int, seed: int) -> pd.DataFrame:
    """CTR-shaped categoricals: Zipf-like counts, so many values share a count (ties at the cut)."""
    rng = np.random.default_rng(seed)
    pick = lambda: np.minimum(rng.zipf(1.3, n), distinct) - 1  # noqa: E731
    return pd.DataFrame({"x": rng.normal(size=n), "a": [f"a{v}" for v in pick()],
                         "b": [f"b{v}" if v % 11 else None for v in pick()],
                         "h": [f"h{v}" for v in pick()], "label": rng.integers(0, 2, n)})


def columns(ops=()) -> Columns:
    return Columns(numeric=("x",), dims=(0,), categorical=("a", "b", "h"), targets=(Target("label", "int", "auto"),),
                   categorical_ops=ops)


def fit(df: pd.DataFrame, cols: Columns, partitions: int, chunks: int = 3, **kw) -> FittedPreprocessor:
    total = PartialStats()
    for part in np.array_split(np.arange(len(df)), chunks):
        total = total.merge(partial_stats(pa.Table.from_pandas(df.iloc[part], preserve_index=False), cols))
    opts = dict(max_size=100, min_count=1, missing_indicator=False) | kw
    return FittedPreprocessor.from_stats(total, cols, partitions=partitions, **opts)


@pytest.mark.parametrize("max_size,min_count", [(10**6, 1), (37, 1), (50, 3), (1, 1)])
def test_ids_are_the_documented_order_cut_exactly_on_any_number_of_parts(max_size, min_count):
    df = heavy_tailed(30_000, 5_000, seed=max_size + min_count)
    cols = columns()
    reference = {}
    for c in cols.categorical:
        counted = df[c].dropna().value_counts()
        reference[c] = vocab_order((v, n) for v, n in counted.items() if n >= min_count)[:max_size]
    table = pa.Table.from_pandas(df, preserve_index=False)
    first = None
    for p in (1, 2, 7, 64):
        fitted = fit(df, cols, p, max_size=max_size, min_count=min_count)
        for c, v in zip(cols.categorical, fitted.vocab):
            assert list(v) == reference[c], (c, p)
            assert v.partitions == p and len(v) == len(reference[c])
        x_cat = fitted.transform(table).x_cat
        first = x_cat if first is None else first
        np.testing.assert_array_equal(x_cat, first)
    # the ids themselves: a value's id is its place in the reference, 0 for the rest and for nulls
    for j, c in enumerate(cols.categorical):
        ids = {v: i + 1 for i, v in enumerate(reference[c])}
        want = np.array([ids.get(v, 0) if isinstance(v, str) else 0 for v in df[c]], np.int32)
        np.testing.assert_array_equal(first[:, j], want)


def test_the_cut_falls_inside_a_tie_and_takes_the_lowest_hashes():
    """Ten values with one row each and max_size 4: the four with the lowest FNV-1a hashes are kept, in
    hash order, wherever their hash ranges are."""
    values = [f"v{i}" for i in range(10)]
    df = pd.DataFrame({"x": 0.0, "a": values, "b": "z", "h": "z", "label": [0, 1] * 5})
    want = sorted(values, key=fnv1a64)[:4]
    for p in (1, 3, 10):
        assert list(fit(df, columns(), p, chunks=2, max_size=4).vocab[0]) == want


def test_coverage_equals_a_direct_count_for_vocab_vocab_hash_and_hash_columns():
    df = heavy_tailed(20_000, 3_000, seed=5)
    ops = (CategoricalOp(), CategoricalOp(encode="vocab+hash", buckets=64), CategoricalOp(encode="hash", buckets=97))
    for p in (1, 5):
        stats = fit(df, columns(ops), p, max_size=40, min_count=2).stats["categorical"]
        a = df["a"].value_counts()
        kept_a = vocab_order((v, n) for v, n in a.items() if n >= 2)[:40]
        assert stats["a"] == {"distinct": len(a), "kept": len(kept_a), "nulls": 0,
                              "unknown_share": pytest.approx(1 - a[kept_a].sum() / a.sum())}
        b = df["b"].value_counts()
        kept_b = vocab_order((v, n) for v, n in b.items() if n >= 2)[:40]
        rest = b.drop(kept_b)
        bucket = np.array([fnv1a64(v) % 64 for v in rest.index])
        per = pd.Series(1, index=bucket).groupby(level=0).sum()
        shared_rows = rest[np.isin(bucket, per[per >= 2].index)].sum()
        assert stats["b"] == {"distinct": len(b), "kept": len(kept_b), "nulls": int(df["b"].isna().sum()),
                              "unknown_share": 0.0, "hashed_share": pytest.approx(rest.sum() / b.sum()),
                              "hashed_into": 64, "shared_bucket_share": pytest.approx(shared_rows / b.sum())}
        h = df["h"].value_counts()
        hb = np.array([fnv1a64(v) % 97 for v in h.index])
        occ = pd.Series(1, index=hb).groupby(level=0).sum()
        assert stats["h"] == {"hashed_into": 97, "distinct": len(h), "nulls": 0,
                              "shared_bucket_share": pytest.approx(h[np.isin(hb, occ[occ >= 2].index)].sum() / h.sum())}


def test_what_reducers_send_back_holds_no_value():
    """The reduce summaries that travel to the planning process: sizes and count histograms only."""
    df = heavy_tailed(20_000, 4_000, seed=9)
    cols = [counts.Column("a", True, 1, 100), counts.Column("h", False, buckets=16)]
    table = pa.Table.from_pandas(df, preserve_index=False)
    s = partial_stats(table, Columns(categorical=("a", "h"), categorical_ops=(CategoricalOp(), CategoricalOp("hash", 16))))
    mapped = counts.split({c.name: s.counts(c.name) for c in cols}, cols, 4)
    summary, _ = counts.reduce_counts([mapped[0]], cols)
    blob = pickle.dumps(summary)
    assert b"a1" not in blob and summary["a"]["distinct"] > 100
    assert len(summary["a"]["hist"][0]) < summary["a"]["distinct"] / 5  # far fewer counts than values
    assert len(blob) < 2_000 + 16 * 9


def test_a_lookup_loads_only_the_parts_it_touches(tmp_path):
    df = heavy_tailed(5_000, 2_000, seed=2)
    fitted = fit(df, columns(), 16, max_size=10**6)
    fitted.save(str(tmp_path / "p.json"))
    loaded = FittedPreprocessor.load(str(tmp_path / "p.json"))
    one = pa.table({"x": [0.0], "a": ["a1"], "b": [None], "h": [None], "label": [1]})
    x_cat = loaded.transform(one).x_cat
    assert x_cat[0, 0] == fitted.transform(one).x_cat[0, 0] > 0
    assert list(loaded.vocab[0].parts._loaded) == [counts.partition_of(np.array([fnv1a64("a1")], np.uint64), 16)[0]]


def test_partitions_auto_grows_with_the_rows():
    assert [counts.partitions_for("auto", n) for n in (10, 2_000_000, 32_000_000, 4_200_000_000)] == [1, 1, 8, 64]
    assert counts.partitions_for(7, 10) == 7


@pytest.mark.ray
def test_on_ray_the_fit_gives_the_ids_of_one_process(ray_local, tmp_path):
    """pipeline.prepare on Ray (map, reduce and finalize tasks, parts in the object store) against the same
    fit in this process, with other numbers of parts: the same vocabularies, ids and coverage; saved and
    loaded, the same again."""
    import pipeline

    df = heavy_tailed(40_000, 6_000, seed=4)
    data = tmp_path / "data"
    data.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(df)), 4)):
        pq.write_table(pa.Table.from_pandas(df.iloc[part], preserve_index=False), data / f"p{i}.parquet",
                               row_group_size=3_000)
    kw = dict(label="label", numeric=["x"], categorical=["a", "b", "h"], world_size=1, vocab_max_size=500,
              vocab_min_count=2, val_fraction=0.0)
    on_ray = pipeline.prepare(str(data), use_ray=True, vocab_partitions=5, **kw).fitted
    here = pipeline.prepare(str(data), use_ray=False, vocab_partitions=1, **kw).fitted
    assert all(type(s).__name__ == "ObjectRef" for s in on_ray.vocab[0].parts.sources)
    assert [list(v) for v in on_ray.vocab] == [list(v) for v in here.vocab]
    assert on_ray.stats["categorical"] == here.stats["categorical"]
    table = pa.Table.from_pandas(df, preserve_index=False)
    np.testing.assert_array_equal(on_ray.transform(table).x_cat, here.transform(table).x_cat)
    on_ray.save(str(tmp_path / "out" / "preprocessor.json"))  # parts written by tasks on this node
    loaded = FittedPreprocessor.load(str(tmp_path / "out" / "preprocessor.json"))
    np.testing.assert_array_equal(loaded.transform(table).x_cat, here.transform(table).x_cat)


def test_values_sharing_a_count_and_a_hash_are_ordered_by_text():
    """64-bit hashes collide about once in 2**32 pairs; forced here, the order falls back to the text."""
    t = pa.table({"h": pa.array([5, 9, 5, 5, 1], pa.uint64()), "n": [3, 3, 3, 3, 3], "v": ["c", "x", "a", "b", "z"]})
    assert t["v"].take(pa.array(counts._order(t))).to_pylist() == ["z", "a", "b", "c", "x"]


def test_a_full_disk_is_one_paragraph_naming_the_file_and_the_size(tmp_path, monkeypatch):
    """Saving the vocabulary parts where the disk is full (writes go to /dev/full: the kernel's ENOSPC)."""
    from pipeline import storage
    from pipeline.errors import PipelineError

    fitted = fit(heavy_tailed(3_000, 500, seed=1), columns(), 2)

    class Full:
        def create_dir(self, *a, **k):
            pass

        def open_output_stream(self, path):
            return pa.OSFile("/dev/full", "wb")

        def move(self, a, b):
            pass

        def open_input_file(self, path):
            raise FileNotFoundError(path)

    real = storage.filesystem
    monkeypatch.setattr(storage, "filesystem", lambda uri: (Full(), real(uri)[1]) if "vocab-" in uri else real(uri))
    with pytest.raises(PipelineError) as e:
        fitted.save(str(tmp_path / "p.json"))
    text = str(e.value)
    assert "part-00000.arrow" in text and "bytes" in text and "No space left" in text and "\n" not in text


def test_a_full_object_store_is_one_paragraph_naming_the_sizes_and_the_fix():
    import ray

    from pipeline.cluster.ray_side import _fit_failure

    e = _fit_failure(ray.exceptions.ObjectStoreFullError("Failed to put object abc in object store because it is "
                                                         "full. Object size is 2147483648 bytes.\nmore lines"))
    text = str(e)
    assert "category counts did not fit" in text and "2147483648 bytes" in text and "Object store per node" in text
    assert "vocab_partitions" in text and "\n" not in text


def test_a_saved_plan_names_its_vocabulary_files_and_loading_maps_them(tmp_path):
    """IngestPlan.save writes the parts beside the plan and pickles their file names: each process that
    loads it (the torchrun ranks of a node) memory-maps the same files instead of holding a copy."""
    import os

    import pipeline

    df = heavy_tailed(40_000, 50_000, seed=3)
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), data / "p.parquet")
    plan = pipeline.prepare(str(data), use_ray=False, world_size=2, label="label", numeric=["x"],
                            categorical=["a", "b", "h"], vocab_partitions=3, vocab_max_size=10**6)
    plan.save(str(tmp_path / "plan.pkl"))
    (folder,) = [f for f in os.listdir(tmp_path) if f.startswith("vocab-")]
    values = sum(len(v) for v in plan.fitted.vocab)
    assert values > 5_000 and os.path.getsize(tmp_path / "plan.pkl") < 64 * 1024  # names, not values
    loaded = pipeline.IngestPlan.load(str(tmp_path / "plan.pkl"))
    assert all(isinstance(s, str) and folder in s for s in loaded.fitted.vocab[0].parts.sources)
    table = pa.Table.from_pandas(df, preserve_index=False)
    np.testing.assert_array_equal(loaded.fitted.transform(table).x_cat, plan.fitted.transform(table).x_cat)
    maps = open("/proc/self/maps").read()
    assert f"{folder}/part-00000.arrow" in maps and f"{folder}/part-00000.index.arrow" in maps


def test_a_fitted_state_pickled_when_the_parts_lived_in_vocab_py_still_loads():
    """Parts and PartedVocabulary moved from pipeline/vocab.py to pipeline/vocab_parts.py, and both then to
    pipeline/fit/ (the stage folders); a plan pickled before either move (its classes named pipeline.vocab.*)
    unpickles to the same vocabularies, as does one pickled between them (pipeline.vocab_parts.*)."""
    df = heavy_tailed(3_000, 1_000, seed=4)
    fitted = fit(df, columns(), 4, max_size=10**6)
    blob = pickle.dumps(fitted, protocol=0)  # text opcodes: the module names can be rewritten in place
    assert b"pipeline.fit.vocab_parts\n" in blob
    table = pa.Table.from_pandas(df.head(200), preserve_index=False)
    for then in (b"pipeline.vocab\n", b"pipeline.vocab_parts\n"):
        old = pickle.loads(blob.replace(b"pipeline.fit.vocab_parts\n", then))
        assert type(old.vocab[0]).__module__ == "pipeline.fit.vocab_parts"
        np.testing.assert_array_equal(old.transform(table).x_cat, fitted.transform(table).x_cat)


def test_counts_merged_by_threads_as_they_come_equal_one_merge_and_a_mask_equals_a_filter():
    """The local fit's threads merge count tables as they finish them (stats.CountTables, every 64 tables,
    in any order), and take the training rows by mask; the statistics and the ids are those of merging
    the filtered batches in order."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.fit.stats import CountTables

    df = heavy_tailed(40_000, 3_000, seed=5)
    cols = columns()
    batches = [pa.Table.from_pandas(df.iloc[p], preserve_index=False) for p in np.array_split(np.arange(len(df)), 150)]
    rng = np.random.default_rng(0)
    masks = [rng.random(b.num_rows) < 0.9 for b in batches]
    plain = PartialStats()
    for b, m in zip(batches, masks):
        plain = plain.merge(partial_stats(b.filter(pa.array(m)), cols))
    gathered = CountTables()

    def one(i: int) -> PartialStats:
        s = partial_stats(batches[i], cols, masks[i])
        gathered.take([s])
        return s

    with ThreadPoolExecutor(3) as pool:
        parts = list(pool.map(one, range(len(batches))))
    gathered.give(parts[0])
    threaded = PartialStats()
    for s in parts:
        threaded = threaded.merge(s)
    assert threaded.rows == plain.rows and threaded.category_nulls == plain.category_nulls
    assert threaded.target_counts == plain.target_counts
    assert [(n.count, n.mean, n.m2, n.nulls) for n in threaded.numeric["x"]] == \
        [(n.count, n.mean, n.m2, n.nulls) for n in plain.numeric["x"]]
    opts = dict(max_size=500, min_count=2, missing_indicator=False)
    a = FittedPreprocessor.from_stats(plain, cols, **opts)
    b = FittedPreprocessor.from_stats(threaded, cols, **opts)
    for c, va, vb in zip(cols.categorical, a.vocab, b.vocab):
        assert len(va) > 0 and list(va) == list(vb), c
    assert a.stats["categorical"] == b.stats["categorical"]


_AFTER_SHUTDOWN = r"""
import json, sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq, ray
import pipeline
from pipeline.fit import vocab_parts

path, out, inline = sys.argv[1], sys.argv[2], sys.argv[3] == "inline"
if not inline:
    vocab_parts.INLINE_BYTES = 0  # parts written to a folder while Ray is up (a large fit's way)
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
keys = dict(world_size=2, label="label", val_fraction=0.0, settings={"preprocess.vocab_partitions": 3})
plan = pipeline.prepare(path, use_ray=True, **keys)
assert plan.timings["fit_on"] == "Ray" and plan.fitted.vocab[0].parts.sources  # the parts were Ray objects
before = plan.fitted.transform(pq.read_table(path))
ray.shutdown()
rows = pq.read_table(path)
after = plan.fitted.transform(rows)  # a notebook serving after the run
plan.save(out + "/plan.pkl")
plan.fitted.save(out + "/preprocessor.json")
loaded = pipeline.IngestPlan.load(out + "/plan.pkl").fitted.transform(rows)
served = pipeline.FittedPreprocessor.load(out + "/preprocessor.json").transform(rows)
here = pipeline.prepare(path, use_ray=False, **keys).fitted.transform(rows)
for name, t in [("after", after), ("loaded", loaded), ("served", served), ("here", here)]:
    assert np.array_equal(t.x_cat, before.x_cat) and np.array_equal(t.x_num, before.x_num), name
print(json.dumps({"to_dict": len(plan.fitted.to_dict()["categorical"][0]["vocab"]), "ids": int(before.x_cat.max())}))
"""


@pytest.mark.ray
@pytest.mark.parametrize("how", ["inline", "folder"])
def test_a_plan_fitted_on_ray_saves_and_transforms_after_ray_shutdown(tmp_path, how):
    """The vocabulary parts of a fit on Ray live in the object store; a notebook saves the plan for serving after
    ray.shutdown(). Small parts travel in the plan, larger ones were written to a folder while Ray was up: either
    way the plan transforms, saves and loads after the session ended, with the ids it had (a Ray of its own, in a
    process of its own: the session's Ray is not shut down under the other tests)."""
    import json
    import subprocess
    import sys

    df = heavy_tailed(6000, 400, seed=3)
    pq.write_table(pa.Table.from_pandas(df[["x", "a", "label"]], preserve_index=False), tmp_path / "d.parquet",
                   row_group_size=1500)
    run = subprocess.run([sys.executable, "-c", _AFTER_SHUTDOWN, str(tmp_path / "d.parquet"), str(tmp_path), how],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["to_dict"] == got["ids"] == df["a"].nunique()
