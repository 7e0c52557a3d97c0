"""Distributed fit in one pass, vectorised transform, and the fitted state saved for serving.

Fit: every fragment yields partial statistics (count, mean and M2 in float64, min, max, nulls,
category counts, label counts); the driver merges them with the parallel-variance formula (Chan et
al.), so the result does not depend on how rows were split into fragments.

Transform: pyarrow/numpy only, no per-row Python. The same `FittedPreprocessor.transform` runs in
the Ray tasks that feed training and at serving time without Ray, so both give identical arrays.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import storage

FORMAT = "pipeline.FittedPreprocessor"
VERSION = 1


# ---------------------------------------------------------------------------------------------
# Partial statistics and their merge


@dataclass
class NumericStats:
    count: int = 0  # finite, non-null values
    mean: float = 0.0
    m2: float = 0.0
    min: float = float("inf")
    max: float = float("-inf")
    nulls: int = 0  # null or NaN

    @classmethod
    def of(cls, values: np.ndarray) -> "NumericStats":
        """values: float64, NaN where the input was null or NaN."""
        ok = values[~np.isnan(values)]
        s = cls(nulls=int(values.size - ok.size))
        if ok.size:
            s.count = int(ok.size)
            s.mean = float(ok.mean())
            s.m2 = float(((ok - s.mean) ** 2).sum())
            s.min, s.max = float(ok.min()), float(ok.max())
        return s

    def merge(self, o: "NumericStats") -> "NumericStats":
        n = self.count + o.count
        if n == 0:
            return NumericStats(nulls=self.nulls + o.nulls)
        delta = o.mean - self.mean
        mean = self.mean + delta * o.count / n
        m2 = self.m2 + o.m2 + delta * delta * self.count * o.count / n
        return NumericStats(n, mean, m2, min(self.min, o.min), max(self.max, o.max), self.nulls + o.nulls)

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else 0.0


@dataclass
class PartialStats:
    rows: int = 0
    numeric: dict[str, NumericStats] = field(default_factory=dict)
    categories: dict[str, dict[str, int]] = field(default_factory=dict)
    category_nulls: dict[str, int] = field(default_factory=dict)
    label_counts: dict[str, int] = field(default_factory=dict)

    def merge(self, o: "PartialStats") -> "PartialStats":
        out = PartialStats(rows=self.rows + o.rows)
        for k in self.numeric.keys() | o.numeric.keys():
            out.numeric[k] = self.numeric.get(k, NumericStats()).merge(o.numeric.get(k, NumericStats()))
        for k in self.categories.keys() | o.categories.keys():
            merged = dict(self.categories.get(k, {}))
            for v, c in o.categories.get(k, {}).items():
                merged[v] = merged.get(v, 0) + c
            out.categories[k] = merged
            out.category_nulls[k] = self.category_nulls.get(k, 0) + o.category_nulls.get(k, 0)
        for v in self.label_counts.keys() | o.label_counts.keys():
            out.label_counts[v] = self.label_counts.get(v, 0) + o.label_counts.get(v, 0)
        return out


def _as_float64(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Numeric column -> float64 numpy with NaN for nulls (ints and decimals widen losslessly enough)."""
    arr = pc.cast(col, pa.float64())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.to_numpy(zero_copy_only=False)  # nulls -> NaN


def _as_string(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return col if pa.types.is_string(col.type) else pc.cast(col, pa.string())


def partial_stats(table: pa.Table, numeric: list[str], categorical: list[str], label: str | None) -> PartialStats:
    s = PartialStats(rows=table.num_rows)
    for c in numeric:
        s.numeric[c] = NumericStats.of(_as_float64(table[c]))
    for c in categorical:
        col = _as_string(table[c])
        vc = pc.value_counts(col)
        s.categories[c] = {v: n for v, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())
                           if v is not None}
        s.category_nulls[c] = col.null_count
    if label is not None:
        vc = pc.value_counts(_as_string(table[label]))
        s.label_counts = {str(v): n for v, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())}
    return s


# ---------------------------------------------------------------------------------------------
# The fitted state


@dataclass(frozen=True)
class Batch:
    """Transformed arrays: float32 features, int64 category ids (0 = unknown or null), float32 label."""

    x_num: np.ndarray
    x_cat: np.ndarray
    y: np.ndarray | None


@dataclass(frozen=True)
class FittedPreprocessor:
    numeric: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    indicators: tuple[str, ...]  # numeric columns that get a 0/1 missing-indicator feature
    categorical: tuple[str, ...]
    vocab: tuple[tuple[str, ...], ...]  # per categorical column; value at position i has id i + 1
    label: str
    stats: dict[str, Any]  # what was seen at fit time (rows, min/max, nulls, label counts): for humans

    @property
    def num_features(self) -> int:
        return len(self.numeric) + len(self.indicators)

    @property
    def cardinalities(self) -> tuple[int, ...]:
        """Embedding table sizes, the unknown id 0 included."""
        return tuple(len(v) + 1 for v in self.vocab)

    @classmethod
    def from_stats(cls, s: PartialStats, numeric, categorical, label: str, *, max_size: int, min_count: int,
                   missing_indicator: bool) -> "FittedPreprocessor":
        nstats = [s.numeric[c] for c in numeric]
        # A constant (or all-null) column gets std 1, so it maps to 0 instead of dividing by zero.
        std = tuple(float(np.sqrt(n.var)) if n.var > 0 else 1.0 for n in nstats)
        vocab = []
        for c in categorical:
            kept = [(v, n) for v, n in s.categories[c].items() if n >= min_count]
            kept.sort(key=lambda vn: (-vn[1], vn[0]))  # most frequent first; ties by value, so it is deterministic
            vocab.append(tuple(v for v, _ in kept[:max_size]))
        stats = {
            "rows": s.rows,
            "numeric": {c: {"count": n.count, "nulls": n.nulls, "min": n.min if n.count else None,
                            "max": n.max if n.count else None} for c, n in zip(numeric, nstats)},
            "categorical": {c: {"distinct": len(s.categories[c]), "nulls": s.category_nulls[c]} for c in categorical},
            "label_counts": dict(sorted(s.label_counts.items())),
        }
        return cls(
            numeric=tuple(numeric), mean=tuple(float(n.mean) for n in nstats), std=std,
            indicators=tuple(c for c, n in zip(numeric, nstats) if missing_indicator and n.nulls > 0),
            categorical=tuple(categorical), vocab=tuple(vocab), label=label, stats=stats,
        )

    def transform(self, data: Any, *, with_label: bool | None = None) -> Batch:
        """Transform a pyarrow Table / RecordBatch or a pandas DataFrame; no Ray needed.

        with_label: None takes the label when the column is present (serving data usually lacks it).
        """
        table = _to_table(data)
        n = table.num_rows
        x = np.empty((n, self.num_features), dtype=np.float32)
        for j, (c, mean, std) in enumerate(zip(self.numeric, self.mean, self.std)):
            v = _as_float64(table[c])
            z = (v - mean) / std
            z[np.isnan(z)] = 0.0  # null/NaN is filled with the fitted mean, which standardises to 0
            x[:, j] = z
        for k, c in enumerate(self.indicators):
            x[:, len(self.numeric) + k] = np.isnan(_as_float64(table[c]))
        x_cat = np.empty((n, len(self.categorical)), dtype=np.int64)
        for j, (c, vocab) in enumerate(zip(self.categorical, self.vocab)):
            idx = pc.index_in(_as_string(table[c]), value_set=pa.array(vocab, type=pa.string()))
            x_cat[:, j] = pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        y = None
        if with_label or (with_label is None and self.label in table.column_names):
            y = _as_float64(table[self.label]).astype(np.float32)
        return Batch(x, x_cat, y)

    # -- persistence --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "label": self.label,
            "numeric": [{"name": c, "mean": m, "std": s, "missing_indicator": c in self.indicators}
                        for c, m, s in zip(self.numeric, self.mean, self.std)],
            "categorical": [{"name": c, "vocab": list(v), "unknown_id": 0} for c, v in zip(self.categorical, self.vocab)],
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FittedPreprocessor":
        if d.get("format") != FORMAT or not isinstance(d.get("version"), int):
            raise ValueError(f"not a fitted preprocessor (format {d.get('format')!r}); expected {FORMAT!r}")
        if d["version"] > VERSION:
            raise ValueError(f"fitted preprocessor version {d['version']} is newer than this code reads "
                             f"({VERSION}); upgrade the pipeline package")
        num = d["numeric"]
        return cls(
            numeric=tuple(e["name"] for e in num), mean=tuple(float(e["mean"]) for e in num),
            std=tuple(float(e["std"]) for e in num),
            indicators=tuple(e["name"] for e in num if e["missing_indicator"]),
            categorical=tuple(e["name"] for e in d["categorical"]),
            vocab=tuple(tuple(e["vocab"]) for e in d["categorical"]), label=d["label"], stats=d.get("stats", {}),
        )

    def save(self, uri: str) -> None:
        # repr() of a float64 round-trips exactly through JSON, so load() gives bit-identical arrays.
        storage.write_json(uri, self.to_dict())

    @classmethod
    def load(cls, uri: str) -> "FittedPreprocessor":
        return cls.from_dict(storage.read_json(uri))


def _to_table(data: Any) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if type(data).__module__.startswith("pandas"):
        return pa.Table.from_pandas(data, preserve_index=False)
    if isinstance(data, dict):
        return pa.table(data)
    raise TypeError(f"transform takes a pyarrow Table/RecordBatch, a pandas DataFrame or a dict of columns, "
                    f"got {type(data).__name__}")


# ---------------------------------------------------------------------------------------------
# The Ray side: one pass to fit, one lazy dataset to transform


def fragments_dataset(source):
    """A Ray Dataset with one row (one read task) per fragment, in global row order."""
    import ray

    items = [{"path": f.path, "row_group": f.row_group, "row_start": f.row_start, "num_rows": f.num_rows}
             for f in source.fragments]
    return ray.data.from_items(items, override_num_blocks=max(1, len(items)))


def _fragments(batch: pa.Table):
    from .source import Fragment

    for row in batch.to_pylist():
        yield Fragment(row["path"], row["row_group"], row["row_start"], row["num_rows"])


def fit(source, cfg) -> FittedPreprocessor:
    """One distributed pass over the data; partial statistics merged on the driver."""
    from .source import read_fragment

    numeric, categorical, label = list(cfg.data.numeric), list(cfg.data.categorical), cfg.data.label
    columns = [*numeric, *categorical, label]
    uri = source.uri

    def fit_fragments(batch: pa.Table) -> dict[str, np.ndarray]:
        parts = [pickle.dumps(partial_stats(read_fragment(uri, f, columns), numeric, categorical, label))
                 for f in _fragments(batch)]
        return {"partial": np.array(parts, dtype=object)}

    rows = fragments_dataset(source).map_batches(fit_fragments, batch_format="pyarrow", batch_size=1).take_all()
    total = PartialStats()
    for r in rows:
        total = total.merge(pickle.loads(r["partial"]))
    p = cfg.preprocess
    return FittedPreprocessor.from_stats(total, numeric, categorical, label, max_size=p.vocab_max_size,
                                         min_count=p.vocab_min_count, missing_indicator=p.missing_indicator)


def transform_dataset(source, fitted: FittedPreprocessor):
    """Lazy Ray Dataset of transformed rows: row_id, x_num [F] float32, x_cat [C] int64, y float32."""
    from .source import read_fragment

    columns = [*fitted.numeric, *fitted.categorical, fitted.label]
    uri = source.uri

    def read_transform(batch: pa.Table) -> dict[str, np.ndarray]:
        outs, ids = [], []
        for f in _fragments(batch):
            outs.append(fitted.transform(read_fragment(uri, f, columns), with_label=True))
            ids.append(np.arange(f.row_start, f.row_start + f.num_rows, dtype=np.int64))
        return {"row_id": np.concatenate(ids),
                "x_num": np.concatenate([o.x_num for o in outs]),
                "x_cat": np.concatenate([o.x_cat for o in outs]),
                "y": np.concatenate([o.y for o in outs])}

    return fragments_dataset(source).map_batches(read_transform, batch_format="pyarrow", batch_size=1)
