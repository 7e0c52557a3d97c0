"""Applying a fitted state to rows: the packed training layout (`pack`), the features alone, the
targets, and serving's `transform`. pyarrow and numpy only, no per-row Python; the same functions feed
training (inside Ray tasks or a torchrun process) and serving, so both give identical arrays. Each
takes the fitted state as `fp`; `preprocess.FittedPreprocessor` has them as methods.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .columns import as_float64, as_string, category_ids
from ..errors import DataError
from .fitted import FittedTarget, Transformed
from .stats import categorical_ops, feature_values, numeric_ops
from .transforms import CategoricalOp, apply_function, apply_numeric, cross_hash, fnv1a, hashed_ids
from .vocab import Vocabulary


def transform(fp, data: Any, *, with_target: bool | None = None) -> Transformed:
    """Transform a pyarrow Table / RecordBatch, a pandas DataFrame or a dict of columns; no Ray needed.

    with_target: None takes the targets (and weight) when their columns are present (serving data
    usually lacks them). A target value the fit never saw (an unseen class, a null, a binary target
    that is not 0/1) is an error naming the column and the value, never a silent 'unknown'."""
    table = _to_table(data)
    if fp.function:
        table = apply_function(fp.function, table)
    x, x_cat = features(fp, table)
    names = fp.target_names
    want = bool(names) and (with_target or (with_target is None and all(n in table.column_names for n in names)))
    y = w = None
    if want:
        y2 = target_matrix(fp, table, strict=True)
        y = y2[:, 0] if len(names) == 1 else y2
        if fp.weight and fp.weight in table.column_names:
            w = as_float64(table[fp.weight]).astype(np.float32)
    return Transformed(x, x_cat, y, w)


def pack(fp, table: pa.Table) -> np.ndarray:
    """float32 [n, width]: the training layout, one row per input row: standardised features, then
    category ids (int32 bit patterns in float32 slots), then targets, then the weight. A shuffled
    batch of such rows is one gather (see dataset.py). Built a column at a time in a column-major
    buffer, then turned into rows in one copy: writing each column straight into the rows would touch
    every row's cache line once per column."""
    return np.ascontiguousarray(pack_columns(fp, table).T)


def pack_columns(fp, table: pa.Table) -> np.ndarray:
    """float32 [width, n]: pack's rows column-major (a rank's reader selects its rows from it and
    writes them into its tensor, the one copy into row-major)."""
    f, c, t = fp.num_features, len(fp.categorical), len(fp.targets)
    columns = np.empty((fp.width, table.num_rows), dtype=np.float32)
    _features_into(fp, table, columns[:f], columns[f:f + c].view(np.int32))
    if t:
        columns[f + c:f + c + t] = target_matrix(fp, table).T
    if fp.weight:
        columns[f + c + t] = as_float64(table[fp.weight])
    return columns


def features(fp, table: pa.Table, x: np.ndarray | None = None,
             x_cat: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(x_num float32 [n, F], x_cat int32 [n, C]), written into x / x_cat when given (views are fine)."""
    n = table.num_rows
    xt = np.empty((fp.num_features, n), dtype=np.float32)
    ct = np.empty((len(fp.categorical), n), dtype=np.int32)
    _features_into(fp, table, xt, ct)
    x = np.empty((n, fp.num_features), dtype=np.float32) if x is None else x
    x_cat = np.empty((n, len(fp.categorical)), dtype=np.int32) if x_cat is None else x_cat
    x[...], x_cat[...] = xt.T, ct.T
    return x, x_cat


def _features_into(fp, table: pa.Table, xt: np.ndarray, ct: np.ndarray) -> None:
    """The features column-major: xt float32 [F, n], ct int32 [C, n]."""
    at = 0
    for i, (c, d, op) in enumerate(zip(fp.numeric, fp.dims, numeric_ops(fp))):
        v = feature_values(table, c, d)  # [n, k]; a scalar column is [n, 1], its transpose one row of xt
        k = v.shape[1]
        if op.is_default:  # standardize, fill with the mean
            z = v - np.asarray(fp.mean[at:at + k])
            z /= np.asarray(fp.std[at:at + k])  # in place: no second [n, k] temporary
            bad = ~np.isfinite(z)
            if bad.any():
                z[bad] = 0.0  # null/NaN/inf is filled with the fitted mean, which standardises to 0
        else:
            z = apply_numeric(op, fp.slots(i), v)
        xt[at:at + k] = z.T
        at += k
    for c in fp.indicators:
        xt[at] = (~np.isfinite(feature_values(table, c, fp.dims[fp.numeric.index(c)]))).any(axis=1)
        at += 1
    for j, (c, vocab, op) in enumerate(zip(fp.categorical, fp.vocab, categorical_ops(fp))):
        ct[j] = _category_ids(table, c, vocab, op)


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


def target_matrix(fp, table: pa.Table, *, strict: bool = False) -> np.ndarray:
    """float32 [n, T]: each target as it travels in the packed rows. NaN marks a value this fit
    cannot represent; strict raises instead (serving), naming the column and the value."""
    y = np.empty((table.num_rows, len(fp.targets)), dtype=np.float32)
    for j, t in enumerate(fp.targets):
        y[:, j] = _target_values(t, table[t.name])
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


def _target_values(t: FittedTarget, col) -> np.ndarray:
    if t.kind == "regression":
        v = (as_float64(col) - t.mean) / t.std
        return np.where(np.isfinite(v), v, np.nan)
    if t.kind == "binary" and t.classes == ("0", "1"):
        v = as_float64(col)
        return np.where((v == 0.0) | (v == 1.0), v, np.nan)
    idx = pc.index_in(as_string(col), value_set=pa.array(t.classes, type=pa.string()))
    return pc.fill_null(pc.cast(idx, pa.float64()), np.nan).to_numpy(zero_copy_only=False)


def inverse_target(fp, values: Any, name: str | None = None) -> np.ndarray:
    """Model outputs back in the data's terms: regression values in the target's own units (undoes
    standardisation); class ids (binary/multiclass) as the class values, as text."""
    t = fp.target(name)
    v = np.asarray(values)
    if t.kind == "regression":
        return v.astype(np.float64) * t.std + t.mean
    return np.asarray(t.classes, dtype=object)[v.astype(np.int64)]

# -- persistence --------------------------------------------------------------------------


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
