"""Column roles and the conversions every stage shares: the bottom floor, imported by source, quality,
preprocess and the readers (it imports none of them).

A `Columns` says what each configured column is for once the schema is known: numeric features
(scalars, or fixed-length lists of numbers such as embeddings, each list element one feature),
categorical features, targets (with the arrow type family they have in the files and the kind asked
for), and an optional per-row weight. It is built on the driver from the config and the footers
(source.inspect) and travels to every task, so all of them read and judge rows the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DataError

KINDS = ("binary", "multiclass", "regression")


def family(t: pa.DataType) -> str:
    """The type family that decides what a column can be used as."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if isinstance(t, pa.BaseExtensionType):  # arrow.uuid (Iceberg's uuid, Parquet's UUID): its storage's family
        return family(t.storage_type)
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"  # deltalake 1.x and polars write string_view
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t) or \
            pa.types.is_fixed_size_binary(t):
        return "binary"  # a categorical where it holds UTF-8 text (as_string); never inferred as a feature
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t):
        return "temporal"
    if is_list(t) and family(t.value_type) in ("int", "float", "bool"):
        return "vector"
    return str(t)


def is_list(t: pa.DataType) -> bool:
    """Any Arrow list type: list, large_list, fixed_size_list, list_view, large_list_view."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


NUMERIC_FAMILIES = {"bool", "int", "float", "temporal"}  # can be a number (a scalar feature, a target, a weight)


@dataclass(frozen=True)
class Target:
    name: str
    family: str  # in the files: bool, int, float or string
    kind: str  # auto (resolved after the fit pass), binary, multiclass or regression

    @property
    def counted(self) -> bool:
        """Fit counts its values (classes) rather than taking moments (regression)."""
        if self.kind == "auto":
            return self.family != "float"
        return self.kind != "regression"


@dataclass(frozen=True)
class Columns:
    numeric: tuple[str, ...] = ()
    dims: tuple[int, ...] = ()  # per numeric column: 0 for a scalar, d for a list of d numbers
    categorical: tuple[str, ...] = ()
    targets: tuple[Target, ...] = ()
    weight: str | None = None
    passthrough: tuple[str, ...] = ()  # carried unchanged beside each row, never features
    label_values: tuple[float, ...] = ()  # allowed target values; empty: any the kind allows
    # transforms.NumericOp per numeric column, transforms.CategoricalOp per categorical column (empty:
    # the defaults), and the hashed crosses (CategoricalOps with .cross), categorical features after them
    numeric_ops: tuple = ()
    categorical_ops: tuple = ()
    crosses: tuple = ()
    function: str = ""  # preprocess.function: run on every batch as read, before anything else

    @property
    def read(self) -> list[str]:
        """Every column a task reads (column pushdown)."""
        cols = [*self.numeric, *self.categorical, *(t.name for t in self.targets),
                *([self.weight] if self.weight else []), *self.passthrough, *(c for x in self.crosses for c in x.cross)]
        return list(dict.fromkeys(cols))  # a pass-through column may also be a feature or target

    @property
    def target_names(self) -> list[str]:
        return [t.name for t in self.targets]


def _combined(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()  # one chunk: no copy
    return col


def decoded(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """A dictionary column as its values (string categoricals are read as dictionaries, see
    row_groups.opened); any other column as it is."""
    return pc.dictionary_decode(col) if pa.types.is_dictionary(col.type) else col


def as_float64(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A scalar numeric column as float64 numpy, NaN for nulls.

    Numbers float64 cannot hold exactly (int64/uint64 beyond 2**53, decimals with many digits) are
    rounded to the nearest float64, which is what a float32 feature keeps of them anyway; timestamps,
    dates and durations become their integer count of the type's unit (e.g. microseconds since 1970)."""
    arr = decoded(_combined(col))
    if family(arr.type) == "temporal":
        arr = pc.cast(arr, pa.int64() if not pa.types.is_date32(arr.type) else pa.int32())
    if not pa.types.is_float64(arr.type):
        arr = pc.cast(arr, pa.float64(), safe=False)
    return arr.to_numpy(zero_copy_only=False)  # nulls -> NaN


def as_string(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    col = decoded(_combined(col))
    if pa.types.is_string(col.type):
        return col
    if is_uuid(col.type):
        return uuid_text(col)
    if pa.types.is_floating(col.type):  # 3.0 and 3 are one class; "3.0" would be another
        as_int = pc.cast(col, pa.int64(), safe=False)
        whole = pc.equal(pc.cast(as_int, col.type), col)
        col = pc.if_else(whole, pc.cast(as_int, pa.string()), pc.cast(col, pa.string()))
        return col
    if family(col.type) == "binary":
        try:
            return pc.cast(col, pa.string())  # checks the bytes are UTF-8
        except pa.ArrowInvalid:
            raise DataError("a binary column listed under data.categorical holds bytes that are not UTF-8 text, so "
                            "they cannot be vocabulary entries; decode or hash it upstream, or pass it through "
                            "(data.passthrough)") from None
    return pc.cast(col, pa.string())


def is_uuid(t: pa.DataType) -> bool:
    return isinstance(t, pa.BaseExtensionType) and t.extension_name == "arrow.uuid"


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_UUID_DIGITS = [i for i in range(36) if i not in (8, 13, 18, 23)]


def uuid_text(a: pa.Array) -> pa.Array:
    """A uuid column as its canonical text (8-4-4-4-12 lowercase hex, as str(uuid.UUID) and every engine print
    it): the vocabulary's values are what a user reads and serves, never 16 raw bytes. Vectorised."""
    s = a.storage
    n = len(s)
    raw = np.frombuffer(s.buffers()[1], np.uint8)[s.offset * 16:(s.offset + n) * 16].reshape(n, 16)
    out = np.full((n, 36), ord("-"), np.uint8)
    out[:, _UUID_DIGITS] = np.stack([_HEX[raw >> 4], _HEX[raw & 15]], axis=2).reshape(n, 32)
    text = pa.FixedSizeBinaryArray.from_buffers(pa.binary(36), n, [None, pa.py_buffer(out.tobytes())]).cast(pa.string())
    return pc.if_else(s.is_valid(), text, pa.scalar(None, pa.string())) if s.null_count else text


def category_ids(col: pa.ChunkedArray | pa.Array, vocab) -> np.ndarray:
    """int32 [n]: each value's id in `vocab` (a vocab.Vocabulary: position plus one), 0 for a null or a
    value not there. A dictionary column (how the reader hands string categoricals over, see
    source.opened) is looked up once per dictionary entry instead of once per row; the ids are the same."""
    def lookup(a: pa.Array) -> np.ndarray:
        return vocab.ids(as_string(a))

    arr = _combined(col)
    if not pa.types.is_dictionary(arr.type):
        return lookup(arr)
    ids = np.zeros(len(arr.dictionary) + 1, np.int32)  # the last slot: null
    ids[:-1] = lookup(arr.dictionary)
    idx = arr.indices
    return ids.take((pc.fill_null(idx, len(arr.dictionary)) if idx.null_count else idx).to_numpy(zero_copy_only=False))


def value_counts(col: pa.ChunkedArray | pa.Array, rows: np.ndarray | None = None) -> dict[str, int]:
    """{value as text (as_string): rows} for the non-null values (targets: a handful of classes)."""
    t = count_table(col, rows)
    if t.num_rows != pc.count_distinct(t["v"]).as_py():  # two values with one text (3 and 3.0): summed
        t = count_merge([t, t.slice(0, 0)])
    return dict(zip(t["v"].to_pylist(), t["n"].to_pylist()))


def count_table(col: pa.ChunkedArray | pa.Array, rows: np.ndarray | None = None) -> pa.Table:
    """The non-null values as text (as_string) with their row counts, as an Arrow table {v, n}: at
    CTR scale (millions of values a column) counts stay columnar, never a Python dict. rows: a boolean
    mask of the rows to count (None: every row), so a caller need not filter the table first.

    Counted before turned into text: a dictionary column by its indices, any other by its values
    (pyarrow's value_counts), and only the distinct values become text. A text may then appear twice
    (two dictionary entries with one text, or 3 and 3.0 in a float column), which the merge
    (count_merge) sums."""
    arr = _combined(col)
    if is_uuid(arr.type):  # no value_counts kernel for the extension type: its text, as the vocabulary keeps it
        arr = uuid_text(arr)
    if pa.types.is_dictionary(arr.type):
        size = len(arr.dictionary)
        idx = arr.indices
        idx = (pc.fill_null(idx, size) if idx.null_count else idx).to_numpy(zero_copy_only=False)
        counts = np.bincount(idx if rows is None else idx[rows], minlength=size + 1)[:size]  # slot `size`: null
        used = counts > 0
        values = as_string(arr.dictionary).filter(pa.array(used))
        t = pa.table({"v": values, "n": pa.array(counts[used], pa.int64())})
        return t.filter(pc.is_valid(t["v"])) if values.null_count else t
    if rows is not None:
        arr = arr.filter(pa.array(rows))
    vc = pc.value_counts(arr if pa.types.is_string(arr.type) else arr.drop_null())
    t = pa.table({"v": as_string(vc.field("values")), "n": pc.cast(vc.field("counts"), pa.int64())})
    return t.filter(pc.is_valid(t["v"])) if t["v"].null_count else t


def count_merge(parts: list[pa.Table]) -> pa.Table:
    """Count tables summed by value, in one Arrow group-by: {v, n}."""
    if not parts:
        return pa.table({"v": pa.array([], pa.string()), "n": pa.array([], pa.int64())})
    t = pa.concat_tables(parts)
    if len(parts) == 1 and pc.count_distinct(t["v"]).as_py() == t.num_rows:
        return t
    # One thread: the callers run columns (and fit groups) on threads of their own, and Arrow's threaded
    # group-by merges per-thread hash tables after (measured on Criteo-shaped counts: 2-3x the time).
    g = t.group_by("v", use_threads=False).aggregate([("n", "sum")])
    return pa.table({"v": g["v"], "n": g["n_sum"]})


def as_matrix(col: pa.ChunkedArray | pa.Array, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A list-of-numbers column as float64 [n, dim] (NaN rows where null), and a mask of rows whose
    list has another length than `dim` (those rows are NaN too)."""
    arr = _combined(col)
    n = len(arr)
    out = np.full((n, dim), np.nan)
    if pa.types.is_fixed_size_list(arr.type):
        lengths = np.full(n, arr.type.list_size)
    else:
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    wrong = valid & (lengths != dim)
    ok = valid & ~wrong
    if ok.any():
        values = as_float64(pc.list_flatten(arr.filter(pa.array(ok))))
        out[ok] = values.reshape(-1, dim)
    return out, wrong


def common_length(col: pa.ChunkedArray | pa.Array) -> int | None:
    """The most common length of a list column's non-null values (None when all are null)."""
    arr = _combined(col)
    if pa.types.is_fixed_size_list(arr.type):
        return arr.type.list_size
    lengths = pc.list_value_length(arr).drop_null()
    if len(lengths) == 0:
        return None
    vc = pc.value_counts(lengths)
    counts = vc.field("counts").to_numpy()
    return int(vc.field("values")[int(np.argmax(counts))].as_py())
