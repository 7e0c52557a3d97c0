"""The fitted state: what one pass over the training rows decided for every column (numeric slots'
shift, scale, fill and boundaries; each categorical column's vocabulary; each target's kind and
classes), built from the merged partial statistics (stats.py) and the count shuffle (counts.py).
Applying it is apply.py, saving and loading it fitted_io.py; `preprocess.FittedPreprocessor` is this
state with both. No Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from . import counts as shuffle
from . import vocab as vocab_file
from .columns import Columns
from ..errors import DataError
from .stats import PartialStats, categorical_ops, numeric_ops, shuffle_columns
from .transforms import CategoricalOp, FittedNumeric, NumericOp, cross_name, fit_numeric
from .vocab import Vocabulary
from .vocab_parts import Parts, PartedVocabulary, as_vocabularies, column_digest

MAX_CLASSES = 2**24  # class ids travel as float32 in the packed rows: exact below 2**24


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


def coverage_lines(fitted: "FittedState", max_size: int, min_count: int) -> list[str]:
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
class FittedState:
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
    # Every category count seen (history.CountHistory), below the thresholds too: what prepare(since=...)
    # extends. None: a fit that did not keep them (on a Ray cluster); the first increment then recounts.
    history: Any = field(default=None, compare=False)

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

    def shared(self) -> "FittedState":
        """Under Ray: the vocabularies put in the object store once, so that every task and training worker
        this is pickled to gets references and maps its node's one copy (see vocab.py)."""
        for v in self.vocab:
            if len(v):
                v.share()
        return self

    def unshared(self) -> "FittedState":
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
                   shuffled: tuple | None = None) -> "FittedState":
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
