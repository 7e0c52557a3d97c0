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
    nulls: int = 0  # null, NaN or inf

    @classmethod
    def of(cls, values: np.ndarray) -> "NumericStats":
        """values: float64, NaN where the input was null; only finite values count (inf is a bad value)."""
        ok = values[np.isfinite(values)]
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
    """Transformed arrays: float32 features, int32 category ids (0 = unknown or null), float32 label."""

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
            z[~np.isfinite(z)] = 0.0  # null/NaN/inf is filled with the fitted mean, which standardises to 0
            x[:, j] = z
        for k, c in enumerate(self.indicators):
            x[:, len(self.numeric) + k] = ~np.isfinite(_as_float64(table[c]))
        x_cat = np.empty((n, len(self.categorical)), dtype=np.int32)
        for j, (c, vocab) in enumerate(zip(self.categorical, self.vocab)):
            idx = pc.index_in(_as_string(table[c]), value_set=pa.array(vocab, type=pa.string()))
            x_cat[:, j] = pc.fill_null(idx, -1).to_numpy(zero_copy_only=False) + 1
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

    items = [{"fragment": pickle.dumps(f)} for f in source.fragments]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    # Records in fragment order: the float64 merge of partial statistics is then the same every run.
    ds.context.execution_options.preserve_order = True
    return ds


def _fragments(batch: pa.Table):
    for blob in batch.column("fragment").to_pylist():
        yield pickle.loads(blob)


def _read(uri: str, frag, columns: list[str], cfg) -> pa.Table | dict:
    """The fragment's table, or (quality.on_bad_file = quarantine) a manifest entry saying why not."""
    from .errors import DataError
    from .source import read_fragment

    try:
        return read_fragment(uri, frag, columns)
    except (OSError, pa.ArrowException) as e:
        rows = f"rows {frag.file_row_start}-{frag.file_row_start + frag.num_rows - 1}"
        if cfg.quality.on_bad_file == "fail":
            raise DataError(f"cannot decode row group {frag.row_group} ({rows}) of '{frag.path}': {e}. The file is "
                            f"damaged behind a readable footer: rewrite it, or set quality.on_bad_file = "
                            f"\"quarantine\" to set damaged row groups aside") from None
        return {"file": frag.path, "row_group": frag.row_group, "row_start": frag.file_row_start,
                "rows": frag.num_rows, "reason": f"cannot decode row group ({type(e).__name__}: {e})"}


def fit(source, cfg):
    """One distributed pass over the data: partial statistics merged on the driver, plus the row
    accounting. Returns (FittedPreprocessor, Accounting)."""
    from .errors import DataError
    from .quality import Accounting, screen

    numeric, categorical, label = list(cfg.data.numeric), list(cfg.data.categorical), cfg.data.label
    columns = [*numeric, *categorical, label]
    uri = source.uri

    def fit_fragments(batch: pa.Table) -> dict[str, np.ndarray]:
        out = []
        for f in _fragments(batch):
            try:
                table = _read(uri, f, columns, cfg)
                if isinstance(table, dict):
                    out.append(pickle.dumps((f.row_start, f.num_rows, None, {}, table)))
                    continue
                kept, dropped = screen(table, f, cfg)
                out.append(pickle.dumps((f.row_start, f.num_rows, partial_stats(kept, numeric, categorical, label),
                                         dropped, None)))
            except DataError as e:
                # Returned, not raised: Ray would wrap it in layers of task errors and print a traceback.
                out.append(pickle.dumps((f.row_start, str(e))))
        return {"partial": np.array(out, dtype=object)}

    rows = fragments_dataset(source).map_batches(fit_fragments, batch_format="pyarrow", batch_size=1).take_all()
    total = PartialStats()
    acct = Accounting()
    acct.add_bad_files(source.bad_files)
    records = [pickle.loads(r["partial"]) for r in rows]
    errors = sorted(r for r in records if len(r) == 2)
    if errors:
        raise DataError(errors[0][1])
    for row_start, n, part, dropped, quarantine in records:
        acct.merge_fragment(row_start, n, part.rows if part else 0, dropped, quarantine)
        if part is not None:
            total = total.merge(part)
    acct.quarantined.sort(key=lambda e: (e["file"], e["row_group"] if e["row_group"] is not None else -1))
    if total.rows == 0:
        raise DataError(f"no usable rows under '{source.uri}': {acct.summary()}; fix the data or the quality policy")
    p = cfg.preprocess
    fitted = FittedPreprocessor.from_stats(total, numeric, categorical, label, max_size=p.vocab_max_size,
                                           min_count=p.vocab_min_count, missing_indicator=p.missing_indicator)
    return fitted, acct


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of what a fragment yields after the quality screen (its kept rows, in order)."""

    fragment: Any  # source.Fragment
    lo: int
    hi: int


def rank_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank r's contiguous share [lo, hi) of n rows: sizes differ by at most one, none is skipped."""
    return n * rank // world, n * (rank + 1) // world


def plan_shares(source, accounting, world: int, whole: bool = False) -> list[list[Piece]]:
    """Which rows each rank owns, as pieces of fragments: rank r gets positions [r*N/W, (r+1)*N/W) of
    the N rows the fit pass counted as usable, in global row order (whole=True: every rank gets all N).
    A pure function of the data and W, so the assignment is reproducible; a fragment that straddles
    two ranks is read by both, each keeping its own slice."""
    used = [(f, accounting.used_by_fragment.get(f.row_start, 0)) for f in source.fragments]
    used = [(f, u) for f, u in used if u > 0]
    n = sum(u for _, u in used)
    bounds = [(0, n)] * world if whole else [rank_bounds(n, world, r) for r in range(world)]
    shares: list[list[Piece]] = []
    for lo, hi in bounds:
        pieces, at = [], 0
        for f, u in used:
            a, b = max(lo, at), min(hi, at + u)
            if a < b:
                pieces.append(Piece(f, a - at, b - at))
            at += u
        shares.append(pieces)
    return shares


def transform_pieces(source, fitted: FittedPreprocessor, cfg, pieces: list[Piece], node_id: str | None = None,
                     node_cpus: int = 1):
    """Lazy Ray Dataset of the transformed rows of `pieces`, in order: row_id, x_num [F] float32, x_cat [C]
    int32, y float32, and `local` (True where the row was transformed on node_id).

    With node_id, the read-and-transform tasks prefer that node, up to `node_cpus` at a time (the CPUs
    it has beside its training workers), so their output lands in the object store of the node that
    trains on it and the rank reads its rows without crossing the network. A task the node cannot
    take at once (busy, or gone) runs elsewhere rather than waiting."""
    import ray

    from .errors import DataError
    from .quality import screen

    columns = [*fitted.numeric, *fitted.categorical, fitted.label]
    uri = source.uri
    f_, c_ = fitted.num_features, len(fitted.categorical)

    def read_transform(batch: pa.Table) -> dict[str, np.ndarray]:
        outs, ids = [], []
        for blob in batch.column("piece").to_pylist():
            p = pickle.loads(blob)
            f = p.fragment
            table = _read(uri, f, columns, cfg)
            if isinstance(table, dict):  # readable during fit, not now: the data changed under the run
                raise DataError(f"'{f.path}' row group {f.row_group} could be read during fit but not now "
                                f"({table['reason']}); do not modify data.path while a run is in progress")
            table = table.append_column("__row_id", pa.array(np.arange(f.row_start, f.row_start + f.num_rows)))
            kept, _ = screen(table, f, cfg)
            if kept.num_rows < p.hi:
                raise DataError(f"'{f.path}' row group {f.row_group} yields {kept.num_rows:,} usable rows now but "
                                f"{p.hi:,} or more during fit; do not modify data.path while a run is in progress")
            kept = kept.slice(p.lo, p.hi - p.lo)
            outs.append(fitted.transform(kept, with_label=True))
            ids.append(kept["__row_id"].to_numpy())
        here = node_id is not None and ray.get_runtime_context().get_node_id() == node_id
        if not ids:
            return {"row_id": np.empty(0, np.int64), "x_num": np.empty((0, f_), np.float32),
                    "x_cat": np.empty((0, c_), np.int32), "y": np.empty(0, np.float32), "local": np.empty(0, bool)}
        row_id = np.concatenate(ids)
        return {"row_id": row_id,
                "x_num": np.concatenate([o.x_num for o in outs]),
                "x_cat": np.concatenate([o.x_cat for o in outs]),
                "y": np.concatenate([o.y for o in outs]),
                "local": np.full(len(row_id), here)}

    items = [{"piece": pickle.dumps(p)} for p in pieces]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds.context.execution_options.preserve_order = True  # blocks in piece order (rows are sorted later anyway)
    if node_id is None:
        return ds.map_batches(read_transform, batch_format="pyarrow", batch_size=1)
    import warnings

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # soft=True alone makes a task wait for the node however long it stays busy (a training worker may
    # hold its last CPU); _spill_on_unavailable (the flag Ray Serve uses for the same purpose) lets
    # such a task run elsewhere. Passed as a raw remote arg (deprecated in Ray Data 2.60 in favour of
    # label selectors, which cannot express this fallback); keep that warning out of the job's output.
    affinity = NodeAffinitySchedulingStrategy(node_id=node_id, soft=True, _spill_on_unavailable=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return ds.map_batches(read_transform, batch_format="pyarrow", batch_size=1, concurrency=max(1, node_cpus),
                              scheduling_strategy=affinity)


def transform_dataset(source, fitted: FittedPreprocessor, cfg, accounting):
    """Lazy Ray Dataset of every usable row, transformed (see transform_pieces), in global row order."""
    return transform_pieces(source, fitted, cfg, plan_shares(source, accounting, 1)[0])
