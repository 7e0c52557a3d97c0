"""Partial statistics, their merge, and the fitted state: transform, save/load. No Ray, no torch.

Fit: every fragment yields partial statistics (count, mean and M2 in float64, min, max, nulls per
numeric feature slot; category counts; class counts or moments per target); they are merged in
fragment order with the parallel-variance formula (Chan et al.), so the result is the same whether
Ray tasks or one process computed the partials.

Transform: pyarrow/numpy only, no per-row Python. The same `FittedPreprocessor.transform` feeds
training (inside Ray tasks or a torchrun process) and serving, so both give identical arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import counts as shuffle
from . import storage
from . import vocab as vocab_file
from .columns import Columns, as_float64, as_matrix, as_string, category_ids, count_merge, count_table, value_counts
from .errors import DataError
from .vocab import Parts, PartedVocabulary, Vocabulary, as_vocabularies, column_digest
from .transforms import (CategoricalOp, FittedNumeric, NumericOp, Sketch, apply_function, apply_numeric, cross_hash,
                         cross_name, fit_numeric, fnv1a, hashed_ids, prescale, user_function)

FORMAT = "pipeline.FittedPreprocessor"
VERSION = 5  # 5: vocabularies in parts by hash range, a folder beside the JSON; 4: one Arrow IPC file (older: inline)
MAX_CLASSES = 2**24  # class ids travel as float32 in the packed rows: exact below 2**24


# ---------------------------------------------------------------------------------------------
# Partial statistics and their merge


@dataclass
class NumericStats:
    count: int = 0  # finite, non-null values
    mean: float = 0.0
    m2: float = 0.0
    min: float = float("inf")
    max: float = float("-inf")
    nulls: int = 0  # null, NaN or inf

    @classmethod
    def of(cls, values: np.ndarray) -> "NumericStats":
        """values: float64, NaN where the input was null; only finite values count (inf is a bad value)."""
        finite = np.isfinite(values)
        ok = values if finite.all() else values[finite]
        s = cls(nulls=int(values.size - ok.size))
        if ok.size:
            s.count = int(ok.size)
            s.mean = float(ok.mean())
            d = ok - s.mean
            d *= d  # the same squares, and the same pairwise sum, as ((ok - mean) ** 2).sum()
            s.m2 = float(d.sum())
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


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for v, c in b.items():
        out[v] = out.get(v, 0) + c
    return out


@dataclass
class PartialStats:
    rows: int = 0
    numeric: dict[str, list[NumericStats]] = field(default_factory=dict)  # one per feature slot of the column
    null_rows: dict[str, int] = field(default_factory=dict)  # numeric column -> rows with any missing slot
    categories: dict[str, list[pa.Table]] = field(default_factory=dict)  # count tables {v, n}, merged lazily
    category_nulls: dict[str, int] = field(default_factory=dict)
    target_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # counted targets: value -> rows
    target_moments: dict[str, NumericStats] = field(default_factory=dict)  # regression targets
    sketches: dict[str, list[Sketch]] = field(default_factory=dict)  # quantiles, where a transform needs them

    def merge(self, o: "PartialStats") -> "PartialStats":
        out = PartialStats(rows=self.rows + o.rows)
        for k in self.sketches.keys() | o.sketches.keys():
            a, b = self.sketches.get(k), o.sketches.get(k)
            out.sketches[k] = b if a is None else a if b is None else [x.merge(y) for x, y in zip(a, b)]
        for k in self.numeric.keys() | o.numeric.keys():
            a, b = self.numeric.get(k), o.numeric.get(k)
            out.numeric[k] = b if a is None else a if b is None else [x.merge(y) for x, y in zip(a, b)]
            out.null_rows[k] = self.null_rows.get(k, 0) + o.null_rows.get(k, 0)
        for k in self.categories.keys() | o.categories.keys():
            parts = self.categories.get(k, []) + o.categories.get(k, [])
            out.categories[k] = parts if len(parts) <= _MERGE_EVERY else [count_merge(parts)]
        for k in self.category_nulls.keys() | o.category_nulls.keys():  # (the counts may have gone to the shuffle)
            out.category_nulls[k] = self.category_nulls.get(k, 0) + o.category_nulls.get(k, 0)
        for k in self.target_counts.keys() | o.target_counts.keys():
            out.target_counts[k] = _add_counts(self.target_counts.get(k, {}), o.target_counts.get(k, {}))
        for k in self.target_moments.keys() | o.target_moments.keys():
            out.target_moments[k] = self.target_moments.get(k, NumericStats()).merge(o.target_moments.get(k, NumericStats()))
        return out


    def counts(self, c: str) -> pa.Table:
        """Categorical column c's counts over every batch merged: {v, n}."""
        return count_merge(self.categories.get(c, []))


_MERGE_EVERY = 64  # count tables are kept apart and merged in one group-by: at most this many at a time


def feature_values(table: pa.Table, name: str, dim: int) -> np.ndarray:
    """A numeric feature column as float64 [n, max(dim, 1)], NaN where missing (or a list of another length)."""
    if dim:
        return as_matrix(table[name], dim)[0]
    return as_float64(table[name])[:, None]


def numeric_ops(cols) -> tuple[NumericOp, ...]:
    """One op per numeric column (the default where none is given); cols: a Columns or a FittedPreprocessor."""
    return cols.numeric_ops or (NumericOp(),) * len(cols.numeric)


def categorical_ops(cols) -> tuple[CategoricalOp, ...]:
    return cols.categorical_ops or (CategoricalOp(),) * len(cols.categorical)


def shuffle_columns(cols: Columns, max_size: int, min_count: int) -> list[shuffle.Column]:
    """How each categorical feature (crosses included) is counted by the partitioned shuffle (counts.py)."""
    out = [shuffle.Column(c, op.counted, op.min_count or min_count, op.max_size or max_size,
                          op.buckets if op.encode != "vocab" else 0)
           for c, op in zip(cols.categorical, categorical_ops(cols))]
    return out + [shuffle.Column(cross_name(x), False, buckets=x.buckets) for x in cols.crosses]


def partial_stats(table: pa.Table, cols: Columns) -> PartialStats:
    """A batch's statistics, of the values each column's scaler sees (after its clip and log1p)."""
    s = PartialStats(rows=table.num_rows)
    for c, d, op in zip(cols.numeric, cols.dims, numeric_ops(cols)):
        if d:
            v = prescale(op, feature_values(table, c, d))
            s.numeric[c] = [NumericStats.of(v[:, j]) for j in range(v.shape[1])]
            s.null_rows[c] = int((~np.isfinite(v)).any(axis=1).sum())
            slots = [v[:, j] for j in range(v.shape[1])]
        else:
            v = prescale(op, as_float64(table[c]))
            s.numeric[c] = [NumericStats.of(v)]
            s.null_rows[c] = s.numeric[c][0].nulls
            slots = [v]
        if op.needs_sketch:
            s.sketches[c] = [Sketch.of(x) for x in slots]
    for c, op in zip(cols.categorical, categorical_ops(cols)):
        # a hashed column is counted by its 64-bit hashes, for its coverage line only (which rows share a bucket)
        s.categories[c] = [count_table(table[c]) if op.counted else hash_counts(*fnv1a(table[c]))]
        s.category_nulls[c] = table[c].null_count
    for x in cols.crosses:
        h, ok = cross_hash(table, x.cross)
        s.categories[cross_name(x)] = [hash_counts(h, ok)]
        s.category_nulls[cross_name(x)] = int((~ok).sum())
    for t in cols.targets:
        if t.counted:
            s.target_counts[t.name] = value_counts(table[t.name])
        else:
            s.target_moments[t.name] = NumericStats.of(as_float64(table[t.name]))
    return s


# ---------------------------------------------------------------------------------------------
# The fitted state


@dataclass(frozen=True)
class FittedTarget:
    """How one target column becomes a float32 slot of the packed rows.

    binary: 0/1 (bool or the numbers 0 and 1). multiclass: the class id, the value's position in
    `classes` (a float32 holding an integer: `batch.y.long()` for cross-entropy). regression: the
    value, or (value - mean) / std when it was standardised (`inverse_target` undoes it)."""

    name: str
    kind: str
    classes: tuple[str, ...] = ()  # multiclass: the values, as text, in id order
    mean: float = 0.0  # regression: subtracted (0 when not standardised)
    std: float = 1.0  # regression: divided by (1 when not standardised)
    counts: tuple[int, ...] = ()  # binary/multiclass: training rows per class id (for baselines)

    @property
    def num_classes(self) -> int:
        return 2 if self.kind == "binary" else len(self.classes) if self.kind == "multiclass" else 0


@dataclass(frozen=True)
class Transformed:
    """`FittedPreprocessor.transform`'s numpy result (serving): x_num float32 [n, F]; x_cat int32 [n, C]
    (0 = unknown or null); y float32 [n] for one target, [n, T] for several, None when the table has
    no target columns; w float32 [n] or None. Training batches carry the same values as torch tensors
    (`pipeline.Batch`)."""

    x_num: np.ndarray
    x_cat: np.ndarray
    y: np.ndarray | None
    w: np.ndarray | None = None


UNKNOWN_WARN = 0.05  # a categorical column where more of the fit's rows than this map to "unknown" is warned about


def hash_counts(h: np.ndarray, valid: np.ndarray) -> pa.Table:
    """Rows per distinct 64-bit hash {v: uint64, n}: how a hashed column is counted."""
    values, n = np.unique(h[valid], return_counts=True)
    return pa.table({"v": pa.array(values, pa.uint64()), "n": pa.array(n, pa.int64())})


def coverage_lines(fitted: "FittedPreprocessor", max_size: int, min_count: int) -> list[str]:
    """One line on what every categorical column's vocabulary keeps, and a warning per column where a
    large share of rows becomes "unknown", naming the settings that change it."""
    cats = fitted.stats.get("categorical", {})
    if not cats:
        return []
    def said(v: dict) -> str:
        if "kept" not in v:
            return (f"{v.get('distinct', 0):,} values hashed into {v['hashed_into']:,} buckets, "
                    f"{100 * v.get('shared_bucket_share', 0.0):.1f}% of rows share a bucket")
        out = f"{v['kept']:,} of {v['distinct']:,} values kept, {100 * v['unknown_share']:.1f}% of rows unknown"
        if "hashed_share" in v:
            out += (f", {100 * v['hashed_share']:.1f}% hashed into {v['hashed_into']:,} buckets "
                    f"({100 * v['shared_bucket_share']:.1f}% of rows share a bucket)")
        return out

    out = ["[fit] vocabulary coverage: " + "; ".join(f"'{c}' {said(v)}" for c, v in cats.items())]
    ops = dict(zip(fitted.categorical, categorical_ops(fitted)))
    for c, v in cats.items():
        if v.get("shared_bucket_share", 0.0) > UNKNOWN_WARN:
            out.append(f"[warning] '{c}': {100 * v['shared_bucket_share']:.1f}% of the fit's rows share a hash bucket "
                       f"with another value ({v.get('distinct', 0):,} distinct values hashed into {v['hashed_into']:,} "
                       f"buckets): the model cannot tell those values apart. Raise its buckets (preprocess.columns, or "
                       f"preprocess.crosses for a cross)")
        if v.get("unknown_share", 0.0) > UNKNOWN_WARN:
            op = ops[c]  # the column's own max_size / min_count (preprocess.columns) win over the defaults
            cap, least = op.max_size or max_size, op.min_count or min_count
            where = lambda own, key: f"its {key.removeprefix('vocab_')}" if own else f"preprocess.{key}"  # noqa: E731
            why = (f"{where(op.max_size, 'vocab_max_size')} = {cap:,} keeps the most frequent" if v["kept"] >= cap else
                   f"{where(op.min_count, 'vocab_min_count')} = {least} leaves out the rarer")
            out.append(f"[warning] '{c}': {100 * v['unknown_share']:.1f}% of the fit's rows map to the unknown id (0): "
                       f"{v['distinct']:,} distinct values, {v['kept']:,} kept ({why}). Raise "
                       f"preprocess.vocab_max_size or lower preprocess.vocab_min_count to keep more, or give the rest hashed "
                       f"ids of their own (encode = \"vocab+hash\", buckets = N in preprocess.columns)")
    return out


def _resolve_kind(t, counts: dict[str, int] | None) -> str:
    if t.kind != "auto":
        return t.kind
    if t.family == "float":
        return "regression"
    if t.family == "bool" or set(counts or {}) <= {"0", "1"}:
        return "binary"
    return "multiclass"


def _class_order(values, family: str) -> list[str]:
    if family == "int":
        return sorted(values, key=int)
    if family == "float":
        return sorted(values, key=float)
    return sorted(values)


@dataclass(frozen=True)
class FittedPreprocessor:
    numeric: tuple[str, ...]
    dims: tuple[int, ...]  # per numeric column: 0 scalar, d a list of d numbers (d feature slots)
    mean: tuple[float, ...]  # per feature slot
    std: tuple[float, ...]
    indicators: tuple[str, ...]  # numeric columns that get a 0/1 missing-indicator feature
    categorical: tuple[str, ...]
    vocab: tuple[Vocabulary, ...]  # per categorical column; value at position i has id i + 1 (tuples of str accepted)
    targets: tuple[FittedTarget, ...]
    weight: str | None
    stats: dict[str, Any]  # what was seen at fit time (rows, min/max, nulls, target counts): for humans
    # Per numeric column its transforms.NumericOp; per feature slot the output for a missing value and,
    # bucketized, its boundaries (`mean` and `std` are then each slot's shift and scale: out = (x - mean)
    # / std after the op's clip and log1p). Per categorical feature (crosses last) its CategoricalOp.
    # Empty: the defaults (standardize, fill with the mean; a vocabulary).
    numeric_ops: tuple[NumericOp, ...] = ()
    fills: tuple[float, ...] = ()
    boundaries: tuple[tuple[float, ...], ...] = ()
    categorical_ops: tuple[CategoricalOp, ...] = ()
    function: str = ""  # preprocess.function, run on the input before anything else (serving too)
    clips: tuple[tuple[float, ...], ...] = ()  # per feature slot: clip_quantiles' fitted (low, high); empty: none

    def __post_init__(self):
        if not all(isinstance(v, (Vocabulary, PartedVocabulary)) for v in self.vocab):
            object.__setattr__(self, "vocab", as_vocabularies(self.vocab))

    @property
    def num_features(self) -> int:
        return len(self.mean) + len(self.indicators)

    @property
    def cardinalities(self) -> tuple[int, ...]:
        """Embedding table sizes, the unknown id 0 included (and a hashed column's buckets)."""
        return tuple(len(v) + 1 + (op.buckets if op.encode != "vocab" else 0)
                     for v, op in zip(self.vocab, categorical_ops(self)))

    @cached_property
    def vocab_digest(self) -> str:
        """A digest of every vocabulary: names the vocabulary file saved beside the JSON."""
        return vocab_file.digest(self.vocab)

    def shared(self) -> "FittedPreprocessor":
        """Under Ray: the vocabularies put in the object store once, so that every task and training worker
        this is pickled to gets references and maps its node's one copy (see vocab.py)."""
        for v in self.vocab:
            if len(v):
                v.share()
        return self

    def unshared(self) -> "FittedPreprocessor":
        from dataclasses import replace

        return replace(self, vocab=tuple(v.unshared() for v in self.vocab))

    def slots(self, i: int) -> list[FittedNumeric]:
        """Numeric column i's fitted feature slots."""
        at = sum(max(d, 1) for d in self.dims[:i])
        k = max(self.dims[i], 1)
        fills = self.fills or (0.0,) * len(self.mean)
        bounds = self.boundaries or ((),) * len(self.mean)
        op = numeric_ops(self)[i]
        clips = self.clips or ((),) * len(self.mean)
        return [FittedNumeric(self.mean[j], self.std[j], fills[j], bounds[j], op.scale == "bucketize", clips[j])
                for j in range(at, at + k)]

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.targets)

    def target(self, name: str | None = None) -> FittedTarget:
        if name is None:
            if len(self.targets) != 1:
                raise ValueError(f"this preprocessor has {len(self.targets)} targets {list(self.target_names)}; name one")
            return self.targets[0]
        for t in self.targets:
            if t.name == name:
                return t
        raise ValueError(f"no target '{name}'; targets are {list(self.target_names)}")

    @property
    def width(self) -> int:
        """Float32 slots per packed row: features, category ids, targets, weight."""
        return self.num_features + len(self.categorical) + len(self.targets) + (1 if self.weight else 0)

    @classmethod
    def from_stats(cls, s: PartialStats, cols: Columns, *, max_size: int, min_count: int, missing_indicator: bool,
                   standardize_target: bool = False, partitions: int = 1,
                   shuffled: tuple | None = None) -> "FittedPreprocessor":
        """The fitted state from the merged partial statistics. The vocabularies come from the partitioned
        count shuffle (counts.py): `shuffled` = (parts, reduce summaries, finalize summaries) when it ran
        across the cluster (ray_side.shuffle_counts), otherwise it runs here over s.categories into
        `partitions` parts; the ids are the same either way."""
        slots = []
        for c, op in zip(cols.numeric, numeric_ops(cols)):
            sketches = s.sketches.get(c) or [None] * len(s.numeric[c])
            # A constant (or all-null) slot gets scale 1, so it maps to 0 instead of dividing by zero.
            slots += [fit_numeric(op, n.count, float(n.mean), n.var, n.min, n.max, sk)
                      for n, sk in zip(s.numeric[c], sketches)]
        columns = shuffle_columns(cols, max_size, min_count)
        if shuffled is None:  # the partitioned shuffle in this process, over the partial statistics' counts
            shuffled = shuffle.in_process(s.categories, columns, partitions)
        sources, first, second = shuffled
        parts = Parts(sources)
        vocab = [PartedVocabulary(c, parts, [x[c]["kept"] for x in second],
                                  column_digest(len(second), [x[c]["digest"] for x in second]))
                 if op.counted else Vocabulary() for c, op in zip(cols.categorical, categorical_ops(cols))]
        targets = []
        for t in cols.targets:
            counts = s.target_counts.get(t.name)
            kind = _resolve_kind(t, counts)
            if kind == "regression":
                m = s.target_moments[t.name]
                mean, std = (m.mean, float(np.sqrt(m.var)) or 1.0) if standardize_target else (0.0, 1.0)
                targets.append(FittedTarget(t.name, kind, mean=float(mean), std=float(std)))
                continue
            classes = ("0", "1") if kind == "binary" else tuple(_class_order(counts, t.family))
            if t.family == "bool" and kind == "binary":
                classes = ("false", "true")
            if len(classes) > MAX_CLASSES:
                raise DataError(f"target '{t.name}' has {len(classes):,} distinct values, more than the {MAX_CLASSES:,} "
                                f"classes supported; set data.target_kind = \"regression\" if it is a quantity")
            targets.append(FittedTarget(t.name, kind, classes=classes,
                                        counts=tuple(counts.get(v, 0) for v in classes)))
        stats = {
            "rows": s.rows,
            "numeric": {c: {"count": sum(n.count for n in s.numeric[c]), "null_rows": s.null_rows.get(c, 0),
                            "min": min((n.min for n in s.numeric[c] if n.count), default=None),
                            "max": max((n.max for n in s.numeric[c] if n.count), default=None)} for c in cols.numeric},
            "categorical": shuffle.coverage(columns, first, second, s.category_nulls),
            "targets": {t.name: dict(sorted(s.target_counts[t.name].items())) if t.name in s.target_counts else
                        {"mean": s.target_moments[t.name].mean, "std": float(np.sqrt(s.target_moments[t.name].var)),
                         "min": s.target_moments[t.name].min, "max": s.target_moments[t.name].max}
                        for t in cols.targets},
        }
        default = all(op.is_default for op in numeric_ops(cols))
        cat_ops = (*categorical_ops(cols), *cols.crosses)
        return cls(
            numeric=tuple(cols.numeric), dims=tuple(cols.dims), mean=tuple(f.shift for f in slots),
            std=tuple(f.scale for f in slots),
            indicators=tuple(c for c in cols.numeric if missing_indicator and s.null_rows.get(c, 0) > 0),
            categorical=(*cols.categorical, *(cross_name(x) for x in cols.crosses)),
            vocab=(*vocab, *(Vocabulary() for _ in cols.crosses)), targets=tuple(targets), weight=cols.weight, stats=stats,
            numeric_ops=() if default else numeric_ops(cols), fills=() if default else tuple(f.fill for f in slots),
            boundaries=() if default else tuple(f.boundaries for f in slots),
            clips=tuple(f.clip for f in slots) if any(f.clip for f in slots) else (),
            categorical_ops=() if all(op == CategoricalOp() for op in cat_ops) else cat_ops, function=cols.function,
        )

    # -- transform ------------------------------------------------------------------------------

    def transform(self, data: Any, *, with_target: bool | None = None) -> Transformed:
        """Transform a pyarrow Table / RecordBatch, a pandas DataFrame or a dict of columns; no Ray needed.

        with_target: None takes the targets (and weight) when their columns are present (serving data
        usually lacks them). A target value the fit never saw (an unseen class, a null, a binary target
        that is not 0/1) is an error naming the column and the value, never a silent 'unknown'."""
        table = _to_table(data)
        if self.function:
            table = apply_function(self.function, table)
        x, x_cat = self.features(table)
        names = self.target_names
        want = bool(names) and (with_target or (with_target is None and all(n in table.column_names for n in names)))
        y = w = None
        if want:
            y2 = self.target_matrix(table, strict=True)
            y = y2[:, 0] if len(names) == 1 else y2
            if self.weight and self.weight in table.column_names:
                w = as_float64(table[self.weight]).astype(np.float32)
        return Transformed(x, x_cat, y, w)

    def pack(self, table: pa.Table) -> np.ndarray:
        """float32 [n, width]: the training layout, one row per input row: standardised features, then
        category ids (int32 bit patterns in float32 slots), then targets, then the weight. A shuffled
        batch of such rows is one gather (see dataset.py). Built a column at a time in a column-major
        buffer, then turned into rows in one copy: writing each column straight into the rows would touch
        every row's cache line once per column."""
        f, c, t = self.num_features, len(self.categorical), len(self.targets)
        columns = np.empty((self.width, table.num_rows), dtype=np.float32)
        self._features_into(table, columns[:f], columns[f:f + c].view(np.int32))
        if t:
            columns[f + c:f + c + t] = self.target_matrix(table).T
        if self.weight:
            columns[f + c + t] = as_float64(table[self.weight])
        return np.ascontiguousarray(columns.T)

    def features(self, table: pa.Table, x: np.ndarray | None = None,
                 x_cat: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(x_num float32 [n, F], x_cat int32 [n, C]), written into x / x_cat when given (views are fine)."""
        n = table.num_rows
        xt = np.empty((self.num_features, n), dtype=np.float32)
        ct = np.empty((len(self.categorical), n), dtype=np.int32)
        self._features_into(table, xt, ct)
        x = np.empty((n, self.num_features), dtype=np.float32) if x is None else x
        x_cat = np.empty((n, len(self.categorical)), dtype=np.int32) if x_cat is None else x_cat
        x[...], x_cat[...] = xt.T, ct.T
        return x, x_cat

    def _features_into(self, table: pa.Table, xt: np.ndarray, ct: np.ndarray) -> None:
        """The features column-major: xt float32 [F, n], ct int32 [C, n]."""
        at = 0
        for i, (c, d, op) in enumerate(zip(self.numeric, self.dims, numeric_ops(self))):
            v = feature_values(table, c, d)  # [n, k]; a scalar column is [n, 1], its transpose one row of xt
            k = v.shape[1]
            if op.is_default:  # standardize, fill with the mean
                z = v - np.asarray(self.mean[at:at + k])
                z /= np.asarray(self.std[at:at + k])  # in place: no second [n, k] temporary
                bad = ~np.isfinite(z)
                if bad.any():
                    z[bad] = 0.0  # null/NaN/inf is filled with the fitted mean, which standardises to 0
            else:
                z = apply_numeric(op, self.slots(i), v)
            xt[at:at + k] = z.T
            at += k
        for c in self.indicators:
            xt[at] = (~np.isfinite(feature_values(table, c, self.dims[self.numeric.index(c)]))).any(axis=1)
            at += 1
        for j, (c, vocab, op) in enumerate(zip(self.categorical, self.vocab, categorical_ops(self))):
            ct[j] = self._category_ids(table, c, vocab, op)

    @staticmethod
    def _category_ids(table: pa.Table, c: str, vocab: Vocabulary, op: CategoricalOp) -> np.ndarray:
        if op.cross:
            return hashed_ids(*cross_hash(table, op.cross), op.buckets)
        if op.encode == "hash":
            return hashed_ids(*fnv1a(table[c]), op.buckets)
        ids = category_ids(table[c], vocab)
        if op.encode == "vocab+hash":  # values outside the vocabulary: hashed into ids after it
            out = ~(ids > 0) & table[c].is_valid().to_numpy(zero_copy_only=False)
            if out.any():
                h, ok = fnv1a(table[c].filter(pa.array(out)))
                ids[out] = hashed_ids(h, ok, op.buckets, first=len(vocab) + 1)
        return ids

    def target_matrix(self, table: pa.Table, *, strict: bool = False) -> np.ndarray:
        """float32 [n, T]: each target as it travels in the packed rows. NaN marks a value this fit
        cannot represent; strict raises instead (serving), naming the column and the value."""
        y = np.empty((table.num_rows, len(self.targets)), dtype=np.float32)
        for j, t in enumerate(self.targets):
            y[:, j] = self._target_values(t, table[t.name])
            if strict:
                bad = np.isnan(y[:, j])
                if bad.any():
                    i = int(np.argmax(bad))
                    allowed = (f"one of the {len(t.classes)} classes seen at fit time" if t.kind == "multiclass" else
                               "0 or 1 (or a bool)" if t.kind == "binary" else "a finite number")
                    raise DataError(f"target '{t.name}' has {table[t.name][i].as_py()!r} at row {i}; expected {allowed}. "
                                    f"Drop such rows before transform, or call transform(..., with_target=False) to "
                                    f"transform the features alone")
        return y

    @staticmethod
    def _target_values(t: FittedTarget, col) -> np.ndarray:
        if t.kind == "regression":
            v = (as_float64(col) - t.mean) / t.std
            return np.where(np.isfinite(v), v, np.nan)
        if t.kind == "binary" and t.classes == ("0", "1"):
            v = as_float64(col)
            return np.where((v == 0.0) | (v == 1.0), v, np.nan)
        idx = pc.index_in(as_string(col), value_set=pa.array(t.classes, type=pa.string()))
        return pc.fill_null(pc.cast(idx, pa.float64()), np.nan).to_numpy(zero_copy_only=False)

    def inverse_target(self, values: Any, name: str | None = None) -> np.ndarray:
        """Model outputs back in the data's terms: regression values in the target's own units (undoes
        standardisation); class ids (binary/multiclass) as the class values, as text."""
        t = self.target(name)
        v = np.asarray(values)
        if t.kind == "regression":
            return v.astype(np.float64) * t.std + t.mean
        return np.asarray(t.classes, dtype=object)[v.astype(np.int64)]

    # -- persistence --------------------------------------------------------------------------

    def to_dict(self, vocab_file: str | None = None) -> dict[str, Any]:
        """The fitted state as JSON-able data. vocab_file: the name (beside the JSON) of the Arrow file that
        holds the vocabularies (see state); None lists them inline (small fits, tests)."""
        numeric = []
        for i, (c, d, op) in enumerate(zip(self.numeric, self.dims, numeric_ops(self))):
            entry = {"name": c, "missing_indicator": c in self.indicators}
            slots = self.slots(i)
            one = (lambda xs: xs) if d else (lambda xs: xs[0])  # noqa: E731 - a list per slot for a vector
            if d:
                entry["dim"] = d
            entry.update(mean=one([f.shift for f in slots]), std=one([f.scale for f in slots]))
            if not op.is_default:
                entry.update(transform=_op_dict(op), fill=one([f.fill for f in slots]),
                             boundaries=one([list(f.boundaries) for f in slots]))
                if op.clip_quantiles:
                    entry["clip"] = one([list(f.clip) for f in slots])
            numeric.append(entry)
        cats = []
        for c, v, op in zip(self.categorical, self.vocab, categorical_ops(self)):
            entry = {"name": c, "unknown_id": 0, **({"vocab_size": len(v)} if vocab_file else {"vocab": list(v)})}
            if vocab_file and isinstance(v, PartedVocabulary):
                entry.update(vocab_parts=list(v.sizes), vocab_digest=v.digest)
            if op != CategoricalOp():
                entry["transform"] = _op_dict(op)
            cats.append(entry)
        return {
            "format": FORMAT, "version": VERSION, "numeric": numeric, "categorical": cats,
            "targets": [{"name": t.name, "kind": t.kind, "classes": list(t.classes), "mean": t.mean, "std": t.std,
                         "counts": list(t.counts)} for t in self.targets],
            "weight": self.weight, "stats": self.stats, **({"function": self.function} if self.function else {}),
            **({"vocab_file": {"name": vocab_file, "digest": self.vocab_digest}} if vocab_file else {}),
        }

    def state(self, uri: str) -> dict[str, Any]:
        """to_dict for a JSON saved at `uri`, the vocabularies written beside it, named by their digest
        (written once: a fit.json and a preprocessor.json in one folder share them): a fit's parts as a
        folder of part files (each written by a task where the part is, under Ray), vocabularies built
        otherwise as one Arrow IPC file."""
        if not any(len(v) for v in self.vocab):
            return self.to_dict()
        parted = [v for v in self.vocab if isinstance(v, PartedVocabulary) and len(v)]
        if parted and len({id(v.parts) for v in parted}) == 1 and all(
                isinstance(v, PartedVocabulary) or not len(v) for v in self.vocab):
            name = f"vocab-{self.vocab_digest}"
            folder = _beside(uri, name)
            last = storage.join(folder, f"part-{parted[0].partitions - 1:05d}")
            if vocab_file.part_tag(last) != self.vocab_digest:
                parted[0].parts.write(folder, [v.name for v in parted], self.vocab_digest)
            return self.to_dict(vocab_file=name)
        whole = tuple(v.whole() if isinstance(v, PartedVocabulary) else v for v in self.vocab)
        name = vocab_file.file_name(self.vocab_digest)
        fs, path = storage.filesystem(_beside(uri, name))
        if not storage.exists(fs, path):
            vocab_file.write(_beside(uri, name), whole, self.categorical, self.vocab_digest)
        return self.to_dict(vocab_file=name)

    @classmethod
    def from_dict(cls, d: dict[str, Any], uri: str | None = None) -> "FittedPreprocessor":
        """The inverse of to_dict / state; uri: where the JSON was read from (its vocabulary file is
        beside it)."""
        if d.get("format") != FORMAT or not isinstance(d.get("version"), int):
            raise ValueError(f"not a fitted preprocessor (format {d.get('format')!r}); expected {FORMAT!r}")
        if d["version"] > VERSION:
            raise ValueError(f"fitted preprocessor version {d['version']} is newer than this code reads "
                             f"({VERSION}); upgrade the pipeline package")
        num = d["numeric"]
        flat = lambda key: tuple(float(x) for e in num for x in (e[key] if isinstance(e[key], list) else [e[key]]))  # noqa: E731
        if d["version"] == 1:  # one binary label
            targets = (FittedTarget(d["label"], "binary", classes=("0", "1")),)
        else:
            targets = tuple(FittedTarget(t["name"], t["kind"], tuple(t["classes"]), float(t["mean"]), float(t["std"]),
                                         tuple(t.get("counts", ()))) for t in d["targets"])
        ops = tuple(_op_of(NumericOp, e.get("transform")) for e in num)
        default = all(op.is_default for op in ops)
        slots = lambda e, key, empty: (e.get(key, empty) if e.get("dim") else [e.get(key, empty)])  # noqa: E731
        cat_ops = tuple(_op_of(CategoricalOp, e.get("transform")) for e in d["categorical"])
        return cls(
            numeric=tuple(e["name"] for e in num), dims=tuple(int(e.get("dim", 0)) for e in num),
            mean=flat("mean"), std=flat("std"),
            indicators=tuple(e["name"] for e in num if e["missing_indicator"]),
            categorical=tuple(e["name"] for e in d["categorical"]),
            vocab=_vocabularies(d, uri), targets=targets, weight=d.get("weight"),
            stats=d.get("stats", {}),
            numeric_ops=() if default else ops,
            fills=() if default else tuple(float(x) for e in num for x in slots(e, "fill", 0.0)),
            boundaries=() if default else tuple(tuple(float(b) for b in x) for e in num for x in slots(e, "boundaries", [])),
            clips=tuple(tuple(float(b) for b in x) for e in num for x in slots(e, "clip", []))
            if any("clip" in e for e in num) else (),
            categorical_ops=() if all(op == CategoricalOp() for op in cat_ops) else cat_ops,
            function=_importable(d.get("function", "")),
        )

    def save(self, uri: str) -> None:
        # repr() of a float64 round-trips exactly through JSON, so load() gives bit-identical arrays.
        storage.write_json(uri, self.state(uri))

    @classmethod
    def load(cls, uri: str) -> "FittedPreprocessor":
        return cls.from_dict(storage.read_json(uri), uri)


def _beside(uri: str, name: str) -> str:
    return uri.rsplit("/", 1)[0] + "/" + name if "/" in uri else name


def _vocabularies(d: dict[str, Any], uri: str | None) -> tuple:
    cats = d["categorical"]
    if "vocab_file" not in d:
        return tuple(Vocabulary(e["vocab"]) for e in cats)
    ref = d["vocab_file"]
    if uri is None:
        raise ValueError(f"this fitted state keeps its vocabularies in {ref['name']!r} beside its JSON: load it with "
                         f"FittedPreprocessor.load(path) (or from_dict(d, path)) so the file can be found")
    if not any("vocab_parts" in e for e in cats):
        return vocab_file.read(_beside(uri, ref["name"]), [int(e["vocab_size"]) for e in cats], ref["digest"], uri)
    folder = _beside(uri, ref["name"])
    n = max(len(e.get("vocab_parts", ())) for e in cats)
    paths = [storage.join(folder, f"part-{q:05d}") for q in range(n)]
    if vocab_file.part_tag(paths[-1]) != ref["digest"]:
        raise DataError(f"'{uri}' keeps its vocabularies in the folder '{folder}', whose parts are missing or belong "
                        f"to another fit (digest {vocab_file.part_tag(paths[-1])!r}, expected {ref['digest']!r}): the ids "
                        f"would be wrong. Copy the folder saved with that JSON beside it, or fit again")
    parts = Parts(paths)
    return tuple(PartedVocabulary(e["name"], parts, e["vocab_parts"], e["vocab_digest"]) if "vocab_parts" in e
                 else Vocabulary() for e in cats)


def _importable(function: str) -> str:
    """A saved preprocessor that runs the user's function is refused where it cannot be imported (one
    paragraph, at load), never at the first request."""
    if function:
        user_function(function)
    return function


def _op_dict(op) -> dict[str, Any]:
    """A transform op as JSON (infinite clip bounds as null, tuples as lists)."""
    out = {}
    for k, v in op.__dict__.items():
        if isinstance(v, float) and not np.isfinite(v):
            v = None
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _op_of(kind, d: dict[str, Any] | None):
    if not d:
        return kind()
    d = dict(d)
    for k in ("clip_min", "clip_max"):
        if k in d and d[k] is None:
            d[k] = -np.inf if k == "clip_min" else np.inf
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


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
