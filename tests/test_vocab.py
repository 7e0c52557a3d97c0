"""Vocabularies at CTR scale: the hash index gives exactly index_in's ids (collisions included), the Arrow
file beside the JSON round-trips and is refused when it does not belong, and under Ray the fitted state
travels to tasks as references, not values."""

import os
import pickle
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.fit.columns import category_ids
from pipeline.errors import PipelineError
from pipeline.fit.preprocess import FittedPreprocessor
from pipeline.fit.transforms import fnv1a
from pipeline.fit.vocab import Vocabulary, build_index, index_size
from test_preprocess import fit_local, frame


def _reference(query: pa.Array, values: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.index_in(query, value_set=values), -1).to_numpy(zero_copy_only=False) + 1


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 200_003])
def test_ids_are_index_in_positions_for_hits_misses_and_nulls(n):
    rng = np.random.default_rng(n)
    values = pa.array([f"{x:08x}" for x in rng.permutation(4 * n + 10)[:n]], pa.string())
    asked = [values[int(i)].as_py() if i < n else f"miss{i}" if i < 2 * n + 5 else None
             for i in rng.integers(0, 2 * n + 10, 5000)]
    query = pa.array(asked, pa.string())
    v = Vocabulary(values)
    np.testing.assert_array_equal(v.ids(query), _reference(query, values))
    # a dictionary-encoded column (how string categoricals are read) gives the same ids
    np.testing.assert_array_equal(category_ids(query.dictionary_encode(), v), _reference(query, values))


def test_colliding_hashes_never_give_a_wrong_id():
    """Values whose 64-bit hashes collide (forced here) are told apart by their text."""
    real = fnv1a(pa.array(["b", "d"]))[0]
    # "a" claims "b"'s hash and comes first in its probe run; "c" claims "d"'s
    v = Vocabulary(["a", "b", "c", "d"], hashes=np.array([real[0], real[0], real[1], real[1]], np.uint64))
    np.testing.assert_array_equal(v.ids(pa.array(["b", "d", "zz", None])), [2, 4, 0, 0])


def test_the_index_places_every_value_once_within_its_table():
    h = fnv1a(pa.array([str(i) for i in range(50_000)]))[0]
    table = build_index(h)
    placed = table[table >= 0]
    assert sorted(placed.tolist()) == list(range(50_000))
    assert table[-1] == -1 and len(table) >= index_size(50_000) >= 100_000


def test_a_vocabulary_reads_as_a_sequence_of_str():
    v = Vocabulary(("red", "green"))
    assert v == ("red", "green") and list(v) == ["red", "green"] and len(v) == 2 and v[1] == "green"
    assert "red" in v and "blue" not in v and v != ("green", "red")


def test_saved_vocabularies_live_beside_the_json_and_round_trip(tmp_path):
    df = frame(4000, 3)
    fitted = fit_local(df, partitions=3)
    fitted.save(str(tmp_path / "preprocessor.json"))
    fitted.save(str(tmp_path / "again.json"))
    files = sorted(os.listdir(tmp_path))
    folders = [f for f in files if f.startswith("vocab-")]
    assert len(folders) == 1, files  # two JSONs of one fit share one folder of vocabulary parts
    assert sorted(os.listdir(tmp_path / folders[0])) == [f"part-{q:05d}{x}" for q in range(3)
                                                         for x in (".arrow", ".index.arrow")]
    text = (tmp_path / "preprocessor.json").read_text()
    assert '"vocab"' not in text and '"vocab_size"' in text and "green" not in text  # no value in the JSON
    loaded = FittedPreprocessor.load(str(tmp_path / "preprocessor.json"))
    assert loaded == fitted
    assert loaded.transform(df).x_cat.tobytes() == fitted.transform(df).x_cat.tobytes()


def test_one_vocabulary_file_of_version_4_round_trips(tmp_path):
    """Vocabularies built outside a fit (or loaded from version 4) are saved as one Arrow file."""
    df = frame(4000, 3)
    fitted = replace(fit_local(df), vocab=tuple(v.whole() for v in fit_local(df).vocab))
    fitted.save(str(tmp_path / "preprocessor.json"))
    assert [f for f in os.listdir(tmp_path) if f.endswith(".arrow")]
    loaded = FittedPreprocessor.load(str(tmp_path / "preprocessor.json"))
    assert loaded == fitted and loaded.transform(df).x_cat.tobytes() == fitted.transform(df).x_cat.tobytes()


def test_a_missing_or_foreign_vocabulary_folder_is_refused(tmp_path):
    a, b = fit_local(frame(3000, 1), partitions=2), fit_local(frame(3000, 2), max_size=3, partitions=2)
    a.save(str(tmp_path / "a.json"))
    b.save(str(tmp_path / "b" / "b.json"))
    (mine,) = [f for f in os.listdir(tmp_path) if f.startswith("vocab-")]
    (other,) = [f for f in os.listdir(tmp_path / "b") if f.startswith("vocab-")]
    os.replace(tmp_path / "b" / other, tmp_path / "elsewhere")
    with pytest.raises(PipelineError, match="missing or belong to another fit.*Copy the folder"):
        FittedPreprocessor.load(str(tmp_path / "b" / "b.json"))
    os.replace(tmp_path / mine, tmp_path / "keep")
    os.replace(tmp_path / "elsewhere", tmp_path / mine)  # b's vocabularies under a's name
    with pytest.raises(PipelineError, match="belong to another fit.*the ids would be wrong"):
        FittedPreprocessor.load(str(tmp_path / "a.json"))


def test_inline_vocabularies_of_earlier_versions_still_load():
    fitted = fit_local(frame(500, 5))
    d = fitted.to_dict() | {"version": 3}
    assert isinstance(d["categorical"][0]["vocab"], list)
    assert FittedPreprocessor.from_dict(d) == fitted


@pytest.mark.ray
def test_under_ray_tasks_get_vocabularies_by_reference(ray_local):
    """A shared fitted state pickles to a few KiB whatever its vocabularies' size, and a Ray task
    transforms with it to the same arrays."""
    import ray

    rng = np.random.default_rng(0)
    n = 20_000
    import pandas as pd

    df = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "const": 1.0, "ints": rng.integers(0, 9, n),
                       "color": [f"c{x}" for x in rng.integers(0, 10_000, n)], "code": rng.integers(0, 7, n),
                       "label": rng.integers(0, 2, n)})
    fitted = fit_local(df, max_size=100_000)
    by_value = len(pickle.dumps(fitted.unshared()))
    shared = fitted.shared()
    by_reference = len(pickle.dumps(shared))
    assert len(fitted.vocab[0]) > 5000 and by_reference < by_value / 4, (by_reference, by_value)

    @ray.remote(num_cpus=0)
    def ids_there(f, table):
        return f.transform(table).x_cat

    table = pa.Table.from_pandas(df, preserve_index=False)
    np.testing.assert_array_equal(ray.get(ids_there.remote(shared, table)), fitted.transform(table).x_cat)
    restored = pickle.loads(pickle.dumps(shared.unshared()))  # what IngestPlan.save writes: by value
    assert restored == fitted and restored.vocab[0].parts.job is None
