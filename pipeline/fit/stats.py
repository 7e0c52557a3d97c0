"""Partial statistics of the fit and their merge: what one batch of rows adds (count, mean and M2 in
float64, min, max and nulls per numeric feature slot; category counts; class counts or moments per
target), merged in fragment order with the parallel-variance formula (Chan et al.), so the result is
the same whether Ray tasks or one process computed the partials. The category counts then go through
the partitioned shuffle of counts.py. No Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import counts as shuffle
from .columns import Columns, as_float64, as_matrix, count_merge, count_table, value_counts
from .transforms import CategoricalOp, NumericOp, Sketch, cross_hash, cross_name, fnv1a, prescale


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


class CountTables:
    """Category count tables gathered from partial statistics as threads finish them, merged (one
    group-by per column, every _MERGE_EVERY tables) by the thread that brings the last one, so the
    merging overlaps the other threads' reading instead of running after them in one thread (merge_fit
    merges the statistics in fragment order; counts can be summed in any order)."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._tables: dict[str, list[pa.Table]] = {}  # per column: tables as they came
        self._merged: dict[str, list[pa.Table]] = {}  # per column: merges of _MERGE_EVERY of them (never merged
        # again here: a merge of every table so far each time would go over the first ones again and again)

    def take(self, parts) -> None:
        """Move the count tables out of these PartialStats (None entries are skipped) into here."""
        for s in parts:
            if s is None:
                continue
            for c, tables in list(s.categories.items()):
                self._add(c, tables)
            s.categories.clear()

    def _add(self, c: str, tables: list[pa.Table]) -> None:
        with self._lock:
            have = self._tables.setdefault(c, [])
            have += tables
            if len(have) < _MERGE_EVERY:
                return
            self._tables[c] = []
        merged = count_merge(have)  # outside the lock: the other columns and threads go on
        with self._lock:
            self._merged.setdefault(c, []).append(merged)
            if len(self._merged[c]) >= _MERGE_EVERY:  # (beyond 64 x 64 fragments)
                self._tables[c].append(count_merge(self._merged.pop(c)))

    def give(self, s: PartialStats) -> None:
        """Hand the tables gathered to one PartialStats (the merge of the rest then adds none); the last
        merge is counts.in_process's, one group-by per column."""
        for c in self._tables.keys() | self._merged.keys():
            s.categories[c] = self._merged.get(c, []) + self._tables.get(c, []) + s.categories.get(c, [])
        self._tables, self._merged = {}, {}


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


def partial_stats(table: pa.Table, cols: Columns, rows: np.ndarray | None = None) -> PartialStats:
    """A batch's statistics, of the values each column's scaler sees (after its clip and log1p). rows: a
    boolean mask of the rows to take (None: all): each column is read out of the batch once and masked
    as numbers, instead of the whole batch filtered first."""
    if rows is not None and (cols.crosses or cols.dims and any(cols.dims)):
        table, rows = table.filter(pa.array(rows)), None  # (crosses and list columns: the plain way)
    s = PartialStats(rows=table.num_rows if rows is None else int(np.count_nonzero(rows)))

    def taken(v: np.ndarray) -> np.ndarray:
        return v if rows is None else v[rows]

    left_out = None if rows is None else pa.array(np.flatnonzero(~rows))

    def nulls(col) -> int:  # a column's nulls in the rows taken: its nulls less those in the (few) rows left out
        if rows is None or not col.null_count:
            return col.null_count
        return col.null_count - col.take(left_out).null_count

    for c, d, op in zip(cols.numeric, cols.dims, numeric_ops(cols)):
        if d:
            v = prescale(op, feature_values(table, c, d))
            s.numeric[c] = [NumericStats.of(v[:, j]) for j in range(v.shape[1])]
            s.null_rows[c] = int((~np.isfinite(v)).any(axis=1).sum())
            slots = [v[:, j] for j in range(v.shape[1])]
        elif not needs_moments(op) and pa.types.is_integer(table[c].type):
            s.numeric[c] = [integer_bounds(table[c], op, rows)]
            s.null_rows[c] = s.numeric[c][0].nulls
            continue
        else:
            v = prescale(op, taken(as_float64(table[c])))
            s.numeric[c] = [NumericStats.of(v)]
            s.null_rows[c] = s.numeric[c][0].nulls
            slots = [v]
        if op.needs_sketch:
            s.sketches[c] = [Sketch.of(x) for x in slots]
    for c, op in zip(cols.categorical, categorical_ops(cols)):
        # a hashed column is counted by its 64-bit hashes, for its coverage line only (which rows share a bucket)
        if op.counted:
            s.categories[c] = [count_table(table[c], rows)]
        else:
            h, ok = fnv1a(table[c])
            s.categories[c] = [hash_counts(taken(h), taken(ok))]
        s.category_nulls[c] = nulls(table[c])
    for x in cols.crosses:
        h, ok = cross_hash(table, x.cross)
        s.categories[cross_name(x)] = [hash_counts(h, ok)]
        s.category_nulls[cross_name(x)] = int((~ok).sum())
    for t in cols.targets:
        if t.counted:
            s.target_counts[t.name] = value_counts(table[t.name], rows)
        else:
            s.target_moments[t.name] = NumericStats.of(taken(as_float64(table[t.name])))
    return s


def needs_moments(op: NumericOp) -> bool:
    """The op's fitted apply uses the mean or the variance of the values (standardize, a mean fill), or a
    sketch; the others need the count, least and greatest alone (integer_bounds)."""
    return op.scale == "standardize" or op.fill == "mean" or op.needs_sketch


def integer_bounds(col: pa.ChunkedArray, op: NumericOp, rows: np.ndarray | None = None) -> NumericStats:
    """NumericStats of an integer column whose transform needs no moments (scale none or minmax, a fill
    other than the mean: needs_moments): its count, nulls, least and greatest, taken from the integers
    in one pass, the bounds then prescaled. The same figures as NumericStats.of(prescale(values)) where
    they matter: an integer is never NaN or infinite, clip and log1p never make a finite value infinite
    and keep the order of values, so the least value prescaled is the least of the values prescaled. The
    mean and M2 stay 0 (fit_numeric reads them for standardize and a mean fill only)."""
    if rows is not None:
        col = col.filter(pa.array(rows))
    nulls = col.null_count
    s = NumericStats(count=len(col) - nulls, nulls=nulls)
    if s.count:
        mm = pc.min_max(col)
        lo, hi = prescale(op, np.array([mm["min"].as_py(), mm["max"].as_py()], np.float64))
        s.min, s.max = float(lo), float(hi)
    return s


def hash_counts(h: np.ndarray, valid: np.ndarray) -> pa.Table:
    """Rows per distinct 64-bit hash {v: uint64, n}: how a hashed column is counted."""
    values, n = np.unique(h[valid], return_counts=True)
    return pa.table({"v": pa.array(values, pa.uint64()), "n": pa.array(n, pa.int64())})
