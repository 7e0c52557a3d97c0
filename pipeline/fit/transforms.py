"""Per-column transforms as small pure pairs: what a batch contributes to the fit, and how a fitted
column is applied. No Ray, no torch; the same apply functions run in training and in serving.

Numeric columns go through, in this order: clip to given bounds, log1p (values below 0 clipped to 0
first, as the DLRM recipe does), then one fitted scaler: standardize (default), minmax, bucketize
(given boundaries, or quantile boundaries from the one fit pass's sketch) or none. A missing value
(null, NaN, inf) is filled in the scaler's input space with the mean (default), the median, zero or a
constant, and then scaled like any value; the missing indicator is unchanged.

Categorical columns: a vocabulary of the most frequent values (default), a stable hash into N
buckets (no fit), or both (vocabulary ids, then the values outside it hashed into N extra buckets);
crosses of two or more columns are hashed. The hash is 64-bit FNV-1a over the value's UTF-8 text (as
`columns.as_string` writes it: 3.0 and 3 are "3"), which is the same on every machine, Python and
numpy version: a hashed id is 1 + hash % N, 0 for null (a cross: 0 when any of its values is null).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .columns import as_string, decoded
from ..errors import DataError

SCALERS = ("standardize", "minmax", "bucketize", "none")
FILLS = ("mean", "median", "zero", "constant")
ENCODINGS = ("vocab", "hash", "vocab+hash")


@dataclass(frozen=True)
class NumericOp:
    clip_min: float = -math.inf
    clip_max: float = math.inf
    log1p: bool = False
    scale: str = "standardize"
    boundaries: tuple[float, ...] = ()  # bucketize: given boundaries (empty: quantiles fitted)
    buckets: int = 10  # bucketize without boundaries: this many quantile buckets
    fill: str = "mean"
    fill_value: float = 0.0  # fill = "constant"
    clip_quantiles: tuple[float, ...] = ()  # (low, high): the clip bounds are these quantiles, fitted in the pass

    @property
    def is_default(self) -> bool:
        return self == NumericOp()

    @property
    def needs_sketch(self) -> bool:
        return (self.scale == "bucketize" and not self.boundaries) or self.fill == "median" or bool(self.clip_quantiles)


@dataclass(frozen=True)
class CategoricalOp:
    encode: str = "vocab"
    buckets: int = 0  # hash buckets (hash), or buckets for the values outside the vocabulary (vocab+hash)
    max_size: int | None = None  # None: preprocess.vocab_max_size
    min_count: int | None = None  # None: preprocess.vocab_min_count
    cross: tuple[str, ...] = ()  # a hashed cross of these columns (encode "hash")

    @property
    def counted(self) -> bool:
        """The fit counts its values (a vocabulary); a hashed column needs no statistics."""
        return self.encode != "hash"


def prescale(op: NumericOp, v: np.ndarray, lo=None, hi=None) -> np.ndarray:
    """The values the scaler sees: clipped, then log1p; NaN where missing (inf included). lo / hi: the
    fitted clip bounds of clip_quantiles (per slot, broadcast over v's last axis). Without them an op with
    clip_quantiles gives the values as they are: its statistics are of the raw values, and fit_numeric
    carries them through the clip and log1p (see there)."""
    if op.clip_quantiles and lo is None:
        return v
    if lo is None:
        lo, hi = op.clip_min, op.clip_max
    clipped = op.clip_quantiles or op.clip_min > -math.inf or op.clip_max < math.inf
    if not clipped and not op.log1p:
        return v
    v = np.where(np.isfinite(v), v, np.nan)
    if clipped:
        v = np.clip(v, lo, hi)
    if op.log1p:
        v = np.log1p(np.maximum(v, 0.0))
    return v


# ---------------------------------------------------------------------------------------------
# A mergeable quantile sketch with a stated error (DDSketch's idea: logarithmic buckets)

SKETCH_ALPHA = 0.01  # every quantile it returns is within 1% (relative) of a value at that rank


@dataclass
class Sketch:
    """Counts of finite values in logarithmic buckets: bucket i of the positives holds (g^(i-1), g^i]
    with g = (1 + a) / (1 - a), so any value in it is within a relative a of the bucket's estimate.
    Merging adds counts, so partials from any number of tasks merge to the same sketch."""

    pos: dict[int, int]
    neg: dict[int, int]
    zeros: int = 0

    GAMMA = (1 + SKETCH_ALPHA) / (1 - SKETCH_ALPHA)

    @classmethod
    def of(cls, v: np.ndarray) -> "Sketch":
        v = v[np.isfinite(v)]
        out = cls({}, {}, int((v == 0).sum()))
        for sign, part in ((out.pos, v[v > 0]), (out.neg, -v[v < 0])):
            if part.size:
                keys, counts = np.unique(np.ceil(np.log(part) / math.log(cls.GAMMA)).astype(np.int64),
                                         return_counts=True)
                sign.update(zip(keys.tolist(), counts.tolist()))
        return out

    def merge(self, o: "Sketch") -> "Sketch":
        pos, neg = dict(self.pos), dict(self.neg)
        for mine, theirs in ((pos, o.pos), (neg, o.neg)):
            for k, c in theirs.items():
                mine[k] = mine.get(k, 0) + c
        return Sketch(pos, neg, self.zeros + o.zeros)

    @property
    def count(self) -> int:
        return sum(self.pos.values()) + sum(self.neg.values()) + self.zeros

    def quantiles(self, qs) -> list[float]:
        """The values at ranks q * (count - 1), each within SKETCH_ALPHA (relative) of the true one."""
        total = self.count
        if not total:
            return [0.0 for _ in qs]
        values, counts = self.points()
        cum = np.cumsum(counts)
        return [float(values[min(int(np.searchsorted(cum, q * (total - 1), side="right")), len(values) - 1)])
                for q in qs]

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(each bucket's estimate, its count), in value order."""
        g = self.GAMMA
        order = [(-2 * g ** k / (1 + g), c) for k, c in sorted(self.neg.items(), reverse=True)] + \
            ([(0.0, self.zeros)] if self.zeros else []) + \
            [(2 * g ** k / (1 + g), c) for k, c in sorted(self.pos.items())]
        return np.array([v for v, _ in order], np.float64), np.array([c for _, c in order], np.float64)

    def to_dict(self) -> dict:
        return {"pos": self.pos, "neg": self.neg, "zeros": self.zeros}


def quantile_boundaries(sketch: Sketch, buckets: int) -> tuple[float, ...]:
    """buckets - 1 inner boundaries at equal-count ranks, repeated values kept once."""
    qs = [i / buckets for i in range(1, buckets)]
    return tuple(sorted(set(sketch.quantiles(qs))))


# ---------------------------------------------------------------------------------------------
# Numeric apply


@dataclass(frozen=True)
class FittedNumeric:
    """One numeric feature slot: out = (x - shift) / scale, or its bucket index; `fill` is the output
    for a missing value."""

    shift: float
    scale: float
    fill: float
    boundaries: tuple[float, ...] = ()
    bucketize: bool = False
    clip: tuple[float, ...] = ()  # clip_quantiles: the fitted (low, high) bounds


def fit_numeric(op: NumericOp, count: int, mean: float, var: float, lo: float, hi: float,
                sketch: Sketch | None) -> FittedNumeric:
    """From one slot's merged statistics (of the prescaled values) to its fitted apply.

    clip_quantiles: the statistics are of the raw values; the bounds are the sketch's quantiles, and the
    scaler's moments, min/max, median and bucket boundaries are those of the clipped (and log1p'd)
    sketch: each value within the sketch's stated 1% (relative) of the exact one, since clip and log1p
    keep the order of values."""
    clip: tuple[float, ...] = ()
    if op.clip_quantiles:
        q_lo, q_hi = sketch.quantiles(op.clip_quantiles) if sketch is not None and sketch.count else (0.0, 0.0)
        clip = (float(q_lo), float(q_hi))

        def through(x):
            return prescale(op, np.asarray(x, np.float64), q_lo, q_hi)

        values, counts = sketch.points() if sketch is not None else (np.zeros(0), np.zeros(0))
        if counts.sum():
            t = through(values)
            mean = float((t * counts).sum() / counts.sum())
            var = float((((t - mean) ** 2) * counts).sum() / counts.sum())
        lo, hi = (float(through(lo)), float(through(hi))) if count else (lo, hi)
        sketch = _Through(sketch, through) if sketch is not None else None
    if op.fill == "mean":
        fill_in = mean
    elif op.fill == "median":
        fill_in = sketch.quantiles([0.5])[0] if sketch is not None and sketch.count else 0.0
    else:
        fill_in = 0.0 if op.fill == "zero" else op.fill_value
    if op.scale == "bucketize":
        bounds = op.boundaries or quantile_boundaries(sketch, op.buckets)
        return FittedNumeric(0.0, 1.0, float(np.searchsorted(bounds, fill_in, side="right")), tuple(bounds), True, clip)
    if op.scale == "standardize":
        shift, scale = mean, (float(np.sqrt(var)) if var > 0 else 1.0)
    elif op.scale == "minmax":
        shift, scale = (lo, hi - lo) if count and hi > lo else (lo if count else 0.0, 1.0)
    else:
        shift, scale = 0.0, 1.0
    return FittedNumeric(float(shift), float(scale), float((fill_in - shift) / scale), clip=clip)


@dataclass
class _Through:
    """A sketch's quantiles carried through a monotone function (clip, then log1p)."""

    sketch: Sketch
    fn: Any

    @property
    def count(self) -> int:
        return self.sketch.count

    def quantiles(self, qs) -> list[float]:
        return [float(x) for x in self.fn(self.sketch.quantiles(qs))]


def apply_numeric(op: NumericOp, fitted: list[FittedNumeric], v: np.ndarray) -> np.ndarray:
    """float64 [n, k] (NaN where missing) -> the transformed values, float64 [n, k]."""
    given = v
    if op.clip_quantiles:
        v = prescale(op, v, np.asarray([f.clip[0] for f in fitted]), np.asarray([f.clip[1] for f in fitted]))
    else:
        v = prescale(op, v)
    if fitted[0].bucketize:
        out = np.empty_like(v)
        for j, f in enumerate(fitted):
            col = v[:, j]
            out[:, j] = np.searchsorted(np.asarray(f.boundaries), col, side="right")
            out[~np.isfinite(col), j] = f.fill
        return out
    shift, scale = np.asarray([f.shift for f in fitted]), np.asarray([f.scale for f in fitted])
    if not (shift.any() or np.signbit(shift).any()) and (scale == 1.0).all():  # scale "none": x - (+0) / 1 is x
        z = v if v is not given else v.copy()
    else:
        z = v - shift
        z /= scale  # in place: no second [n, k] temporary
    bad = ~np.isfinite(z)
    if bad.any():
        fills = np.asarray([f.fill for f in fitted])
        z[bad] = np.broadcast_to(fills, z.shape)[bad]
    return z


# ---------------------------------------------------------------------------------------------
# Stable hashing (categorical hash buckets and crosses)

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_SEPARATOR = np.uint64(0x1F)  # between a cross's values: ("a", "bc") and ("ab", "c") differ


def fnv1a(col, seed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit FNV-1a of each value's UTF-8 text as uint64 [n], valid mask [n]), continuing from `seed`
    (a cross); vectorised over the rows, one step per byte position. A dictionary column is hashed
    once per dictionary entry."""
    if pa.types.is_dictionary(col.type) and seed is None:
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        h_dict, ok_dict = fnv1a(arr.dictionary)
        idx = arr.indices.fill_null(0).to_numpy(zero_copy_only=False)
        return h_dict[idx], arr.is_valid().to_numpy(zero_copy_only=False) & ok_dict[idx]
    arr = decoded(col)
    s = as_string(arr)
    n = len(s)
    valid = s.is_valid().to_numpy(zero_copy_only=False)
    offsets = np.frombuffer(s.buffers()[1], dtype=np.int32)[s.offset:s.offset + n + 1].astype(np.int64)
    data = np.frombuffer(s.buffers()[2], dtype=np.uint8) if s.buffers()[2] is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64) if seed is None else seed.astype(np.uint64, copy=True)
    if n and lengths[0] and (lengths == lengths[0]).all() and offsets[-1] - offsets[0] == n * lengths[0]:
        text = data[offsets[0]:offsets[-1]].reshape(n, -1)  # texts all as long (hashed ids): a byte column a step
        with np.errstate(over="ignore"):
            for pos in range(text.shape[1]):
                h ^= text[:, pos]
                h *= _FNV_PRIME
        return h, valid
    order = np.argsort(-lengths, kind="stable")  # longest first: the rows still going are a prefix
    sorted_len, sorted_start = lengths[order], starts[order]
    hs = h[order]
    with np.errstate(over="ignore"):
        for pos in range(int(sorted_len[0]) if n else 0):
            k = int(np.searchsorted(-sorted_len, -pos, side="left"))  # rows longer than pos
            hs[:k] ^= data[sorted_start[:k] + pos].astype(np.uint64)
            hs[:k] *= _FNV_PRIME
    h[order] = hs
    return h, valid


def hashed_ids(h: np.ndarray, valid: np.ndarray, buckets: int, first: int = 1) -> np.ndarray:
    """int32 ids first .. first + buckets - 1 from 64-bit hashes; 0 where not valid."""
    ids = (h % np.uint64(buckets)).astype(np.int64) + first
    return np.where(valid, ids, 0).astype(np.int32)


def cross_hash(table: pa.Table, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The FNV-1a of the crossed columns' texts joined by a separator byte; valid where none is null."""
    h, valid = fnv1a(table[names[0]])
    for name in names[1:]:
        with np.errstate(over="ignore"):
            h = (h ^ _SEPARATOR) * _FNV_PRIME
        h, ok = fnv1a(table[name], seed=h)
        valid &= ok
    return h, valid


# ---------------------------------------------------------------------------------------------
# From the config's per-column sections to one op per feature


_NUMERIC_KEYS = ("clip", "clip_quantiles", "log1p", "scale", "boundaries", "fill", "fill_value")
_CATEGORICAL_KEYS = ("encode", "max_size", "min_count")


def resolve(pre, numeric: list[str], categorical: list[str], names: set[str]):
    """(numeric ops, categorical ops, crosses) for the feature columns, from preprocess.numeric_transform /
    categorical_transform (defaults per role), then preprocess.columns (a section per column, or per
    group of columns with `columns = [...]`), then preprocess.crosses. names: every column the files
    have (a cross may use a column that is not a feature). Raises ValueError naming the section, the
    column and what is allowed."""
    per: dict[str, list[tuple[str, object]]] = {}
    for key, spec in pre.columns.items():
        for col in spec.columns or (key,):
            if col not in numeric and col not in categorical:
                raise ValueError(f"preprocess.columns.{key} names '{col}', which is not a feature column (numeric: "
                                 f"{numeric}, categorical: {categorical}); name a feature, or add the column to "
                                 f"data.numeric / data.categorical")
            per.setdefault(col, []).append((key, spec))

    def merged(default, col: str, role: str, wrong: tuple[str, ...]) -> dict:
        out: dict = {}
        for key, spec in [(f"{role}_transform", default), *((f"columns.{k}", v) for k, v in per.get(col, []))]:
            given = {k: v for k, v in spec.model_dump().items() if v is not None and k != "columns"}
            stray = [k for k in given if k in wrong]
            if stray:
                raise ValueError(f"preprocess.{key} sets {stray} for '{col}', a {role} column; those apply to "
                                 f"{'categorical' if role == 'numeric' else 'numeric'} columns only (a {role} column "
                                 f"takes {list(_NUMERIC_KEYS if role == 'numeric' else _CATEGORICAL_KEYS) + ['buckets']})")
            out.update(given)
        return out

    numeric_ops = []
    for col in numeric:
        s = merged(pre.numeric_transform, col, "numeric", _CATEGORICAL_KEYS)
        if "clip" in s and "clip_quantiles" in s:
            raise ValueError(f"'{col}' has both clip (bounds given) and clip_quantiles (bounds fitted); keep one")
        q = tuple(float(x) for x in s.pop("clip_quantiles", ()))
        if q and not (len(q) == 2 and 0.0 <= q[0] < q[1] <= 1.0):
            raise ValueError(f"clip_quantiles for '{col}' must be [low, high] with 0 <= low < high <= 1, got {list(q)}")
        lo, hi = s.pop("clip", (-math.inf, math.inf))
        op = NumericOp(clip_min=float(lo), clip_max=float(hi), clip_quantiles=q,
                       **{k: (tuple(v) if k == "boundaries" else v) for k, v in s.items()})
        if list(op.boundaries) != sorted(set(op.boundaries)):
            raise ValueError(f"bucketize boundaries for '{col}' must be increasing and distinct, got {list(op.boundaries)}")
        numeric_ops.append(op)
    categorical_ops = []
    for col in categorical:
        s = merged(pre.categorical_transform, col, "categorical", _NUMERIC_KEYS)
        op = CategoricalOp(**s)
        if op.encode != "vocab" and not op.buckets:
            raise ValueError(f"'{col}' is encoded as {op.encode!r} but has no hash buckets; set buckets = N in its "
                             f"preprocess.columns section (or preprocess.categorical_transform)")
        categorical_ops.append(op)
    crosses = []
    for cross in pre.crosses:
        missing = [c for c in cross.columns if c not in names]
        if missing:
            raise ValueError(f"preprocess.crosses {list(cross.columns)} names {missing}, which the files do not have; "
                             f"the columns are: {', '.join(sorted(names))}")
        crosses.append(CategoricalOp(encode="hash", buckets=cross.buckets, cross=tuple(cross.columns)))
    return tuple(numeric_ops), tuple(categorical_ops), tuple(crosses)


def cross_name(op: CategoricalOp) -> str:
    return "*".join(op.cross)


# ---------------------------------------------------------------------------------------------
# The user's own function: a vectorised pyarrow Table -> Table that adds or replaces columns


def user_function(path: str):
    """The function named 'package.module:function', imported; one paragraph when it cannot be."""
    import importlib

    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise DataError(f"preprocess.function = {path!r} cannot be imported here ({type(e).__name__}: {e}); it must be "
                        f"'package.module:function', importable in every process that reads or serves the data (the "
                        f"driver, each Ray node, the serving process): install its package there, or set PYTHONPATH "
                        f"(for `ray job submit`: the runtime env's working_dir or py_modules)") from None
    if not callable(fn):
        raise DataError(f"preprocess.function = {path!r} names a {type(fn).__name__}, not a function")
    return fn


def apply_function(path: str, table: pa.Table) -> pa.Table:
    """Run the user's function on a batch; it must give back a Table with as many rows."""
    out = user_function(path)(table)
    if not isinstance(out, pa.Table) or out.num_rows != table.num_rows:
        got = f"a Table of {out.num_rows} rows" if isinstance(out, pa.Table) else type(out).__name__
        raise DataError(f"preprocess.function = {path!r} returned {got} for a Table of {table.num_rows} rows; it must "
                        f"return a pyarrow Table with the same rows (adding or replacing columns)")
    return out
