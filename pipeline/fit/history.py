"""A fit that keeps its ids: every category count seen over a chain of increments, and the
vocabularies extended from them (`prepare(since=...)`).

Thresholds count over the whole history (a value seen once yesterday and once today passes
vocab_min_count = 2 today), so the fitted state keeps every counted column's counts, those below the
threshold too: `CountHistory`, laid out as the vocabularies are (counts.py's P hash ranges, one part
per range, {value, hash, rows} per column), in memory after a fit without Ray and as Arrow IPC files
beside the saved state (`counts-<digest>/part-<q>.arrow`), memory-mapped when loaded: no per-value
Python object, and one range at a time in memory while an increment is merged in.

Extending (`extend`), range by range: the history's counts plus the increment's; a value the previous
vocabulary kept keeps its id; the values that now pass the column's threshold and are new take the
next free ids, numbered among themselves as a fit numbers (count descending, then hash, then text:
counts.cuts/finalize over the new values only), up to vocab_max_size in all. Ids are never reused or
renumbered, so the kept set after any chain equals one fit's over all the rows (without the cap),
and only the order of the ids differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import counts
from .. import storage
from ..errors import DataError, PipelineError
from .stats import categorical_ops, numeric_ops, shuffle_columns
from .vocab import Vocabulary, build_index
from .vocab_parts import Parts, PartedVocabulary, column_digest

FORMAT = "pipeline.CountHistory/1"


class CountHistory:
    """Per hash range q: {column: Table {v, h, n}} of every value counted so far (parts in memory, or
    the paths of their files)."""

    __slots__ = ("sources", "columns", "rows", "_digest")

    def __init__(self, sources: Sequence, columns: Sequence[str], rows: int, digest: str | None = None):
        self.sources, self.columns, self.rows, self._digest = list(sources), tuple(columns), int(rows), digest

    @property
    def digest(self) -> str:
        """A digest of every count (names the saved folder): computed when first asked, not in the fit."""
        if self._digest is None:
            self._digest = _digest([self.part(q) for q in range(self.partitions)])
        return self._digest

    @property
    def partitions(self) -> int:
        return len(self.sources)

    def part(self, q: int) -> dict[str, pa.Table]:
        s = self.sources[q]
        return s if isinstance(s, dict) else _read(s)

    @property
    def values(self) -> int:
        """Distinct values kept, over every column (what the history costs: about 16 bytes + the text each)."""
        return sum(t.num_rows for q in range(self.partitions) for t in self.part(q).values())

    @classmethod
    def of(cls, categories: dict[str, list[pa.Table]], columns: Sequence[counts.Column], partitions: int,
           rows: int) -> tuple["CountHistory", dict[str, pa.Table]]:
        """The history of one fit's count tables, and each column's merged table {v, n} (handed back
        to the fit, so the values are merged once)."""
        from .columns import count_merge

        cols = [c for c in columns if c.counted]
        merged = {c.name: count_merge(categories.get(c.name, [])) for c in cols}
        # kept as split (each range sorted by hash at its first merge): the fit pays one split, no more
        parts = [{c: t.select(["v", "h", "n"]) for c, t in p.items()} for p in counts.split(merged, cols, partitions)]
        return cls(parts, [c.name for c in cols], rows), merged

    @classmethod
    def fit(cls, categories: dict[str, list[pa.Table]], columns: Sequence[counts.Column], partitions: int,
            rows: int) -> tuple[tuple, "CountHistory"]:
        """(shuffled, history): counts.in_process's shuffle of a fit without Ray (the same functions, so the
        same ids), keeping the vocabulary columns' split count tables as the history: the fit merges and
        splits its counts once, as it did before it kept them."""
        parts, first, second, kept = counts.in_process(categories, columns, partitions, keep=True)
        names = [c.name for c in columns if c.counted]
        return (parts, first, second), cls([{c: m[c].select(["v", "h", "n"]) for c in names} for m in kept], names,
                                           rows)

    def on_files(self, folder_uri: str) -> "CountHistory":
        """Every part written to folder_uri (once per digest) and read from there."""
        paths = [storage.join(folder_uri, f"part-{q:05d}.arrow") for q in range(self.partitions)]
        fs, _ = storage.filesystem(paths[-1])
        if not storage.exists(fs, storage.filesystem(paths[-1])[1]):
            for q, p in enumerate(paths):  # sorted by hash, so the next increment's merge searches them as read
                _write(p, {c: _by_hash(_norm(t)) for c, t in self.part(q).items()}, self.columns, self.digest)
        return CountHistory(paths, self.columns, self.rows, self.digest)

    def __reduce__(self):
        # Counts in memory are not pickled: a plan or fitted state sent to Ray tasks and training workers
        # must stay small, and they need no counts. On files (plan.save, fitted.save), their paths go.
        if all(isinstance(s, str) for s in self.sources):
            return CountHistory, (self.sources, self.columns, self.rows, self._digest)
        return CountHistory, ([], self.columns, self.rows, None)


def _digest(parts: Sequence[dict[str, pa.Table]]) -> str:
    d = hashlib.blake2b(digest_size=16)
    for p in parts:
        for c in sorted(p):
            d.update(c.encode())
            d.update(memoryview(np.ascontiguousarray(p[c]["h"].to_numpy())).cast("B"))
            d.update(memoryview(np.ascontiguousarray(p[c]["n"].to_numpy())).cast("B"))
    return d.hexdigest()


def _write(path: str, part: dict[str, pa.Table], names: Sequence[str], tag: str) -> None:
    fs, base = storage.filesystem(path)
    fs.create_dir(base.rsplit("/", 1)[0], recursive=True)
    text = pa.string() if sum(part[c]["v"].nbytes for c in names) < 2**31 else pa.large_string()
    schema = pa.schema([("v", text), ("h", pa.uint64()), ("n", pa.int64())],
                       metadata={"format": FORMAT, "digest": tag, "columns": ",".join(names)})
    try:
        with fs.open_output_stream(base + ".tmp") as out, pa.ipc.new_file(out, schema) as w:
            for c in names:
                t = part[c]
                w.write_batch(pa.record_batch([_col(t["v"]).cast(text), _col(t["h"]).cast(pa.uint64()),
                                               _col(t["n"]).cast(pa.int64())], schema=schema))
        fs.move(base + ".tmp", base)
    except OSError as e:
        raise PipelineError(f"cannot write the category counts '{path}' of the fitted state ({e}). Free space there "
                            f"or save elsewhere") from None


def _read(path: str) -> dict[str, pa.Table]:
    try:
        reader = storage.open_arrow_file(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise PipelineError(f"the category counts '{path}' cannot be read ({e}): copy the counts folder with the "
                            f"fitted state's JSON (they belong together), or fit again without since=") from None
    names = [n for n in (reader.schema.metadata or {}).get(b"columns", b"").decode().split(",") if n]
    return {c: pa.Table.from_batches([reader.get_batch(i)]) for i, c in enumerate(names)}


def _col(a):
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def to_state(h: CountHistory | None, uri: str) -> dict | None:
    """The history's entry in a saved state's JSON, its parts written beside `uri` (None where the state
    keeps none, or only their place: a state pickled to a Ray worker leaves its counts behind)."""
    if h is None or not h.partitions:
        return None
    name = f"counts-{h.digest}"
    h.on_files(uri.rsplit("/", 1)[0] + "/" + name if "/" in uri else name)
    return {"name": name, "digest": h.digest, "partitions": h.partitions, "columns": list(h.columns), "rows": h.rows}


def from_state(d: dict | None, uri: str | None) -> CountHistory | None:
    if not d or uri is None:
        return None
    folder = uri.rsplit("/", 1)[0] + "/" + d["name"] if "/" in uri else d["name"]
    return CountHistory([storage.join(folder, f"part-{q:05d}.arrow") for q in range(d["partitions"])], d["columns"],
                        d["rows"], d["digest"])


# ---------------------------------------------------------------------------------------------
# Extending a fitted state


def _norm(t: pa.Table) -> pa.Table:
    return pa.table({"v": _col(t["v"]).cast(pa.large_string()), "h": _col(t["h"]).cast(pa.uint64()),
                     "n": _col(t["n"]).cast(pa.int64())})


def _by_hash(t: pa.Table) -> pa.Table:
    h = t["h"].to_numpy()
    return t if not len(h) or bool(np.all(h[1:] >= h[:-1])) else t.take(pa.array(np.argsort(h, kind="stable")))


def _merge(old: pa.Table | None, inc: pa.Table) -> pa.Table:
    """A range's counts so far plus the increment's (each unique by value), sorted by hash (history parts
    are kept so): each increment value found by binary search on the hashes, its text compared, so the
    cost follows the increment's values, not a group-by over the whole history."""
    inc = _norm(inc)
    if old is None or not old.num_rows:
        return _by_hash(inc)
    old = _by_hash(_norm(old))
    oh, ih = old["h"].to_numpy(), inc["h"].to_numpy()
    pos = np.minimum(np.searchsorted(oh, ih), len(oh) - 1)
    hit = oh[pos] == ih
    if hit.any():
        rows = np.flatnonzero(hit)
        same = pc.equal(old["v"].take(pa.array(pos[rows])), inc["v"].take(pa.array(rows))).to_numpy(zero_copy_only=False)
        if not same.all() or len(np.unique(pos[rows])) != len(rows):  # two texts share a 64-bit hash: by text
            g = pa.concat_tables([old, inc]).group_by("v").aggregate([("n", "sum"), ("h", "min")])
            return _by_hash(pa.table({"v": g["v"], "h": g["h_min"], "n": g["n_sum"]}))
    n = old["n"].to_numpy().copy()
    n[pos[hit]] += inc["n"].to_numpy()[hit]
    both = pa.concat_tables([old.set_column(2, "n", pa.array(n)), inc.filter(pa.array(~hit))])
    return _by_hash(both)


def _previous_part(v, q: int, partitions: int) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray | None]:
    """(values, hashes, ids, hash index or None) of the previous vocabulary `v` whose hashes fall in range q."""
    if isinstance(v, PartedVocabulary) and v.partitions == partitions:
        if not v.sizes[q]:
            return pa.array([], pa.large_string()), np.zeros(0, np.uint64), np.zeros(0, np.int32), None
        values, hashes, ids, index = v.parts.part(q)[v.name]
        return values, np.asarray(hashes, np.uint64), np.asarray(ids, np.int32), index
    whole = v.whole() if isinstance(v, PartedVocabulary) else v
    h = np.asarray(whole.hashes, np.uint64)
    sel = counts.partition_of(h, partitions) == q
    return whole.values.filter(pa.array(sel)), h[sel], (np.flatnonzero(sel) + 1).astype(np.int32), None


def extend(prev, history: CountHistory, increment: dict[str, list[pa.Table]], cols, max_size: int, min_count: int,
           nulls: dict[str, int], rows: int):
    """(vocabularies, the new history, coverage per column) of `prev` (a fitted state) extended by the
    increment's count tables."""
    from .columns import count_merge

    columns = [c for c in shuffle_columns(cols, max_size, min_count) if c.counted]
    P = history.partitions
    inc = counts.split({c.name: count_merge(increment.get(c.name, [])) for c in columns}, columns, P) if columns \
        else [{} for _ in range(P)]
    by_name = dict(zip(prev.categorical, prev.vocab))
    new_hist, known, cands, summaries = [], [], [], []
    for q in range(P):
        old = history.part(q)
        merged_q, known_q, cand_q, summ_q = {}, {}, {}, {}
        for c in columns:
            t = _merge(old.get(c.name), inc[q][c.name])
            merged_q[c.name] = t
            values, hashes, ids, index = _previous_part(by_name[c.name], q, P)
            n = t["n"].to_numpy()
            # a kept value passed the threshold when it was kept, and counts only grow: look up those only
            passing = np.flatnonzero(n >= c.min_count)
            is_known = np.zeros(t.num_rows, bool)
            if len(values) and len(passing):
                is_known[passing] = Vocabulary(values, hashes, index).positions(
                    _col(t["v"]).take(pa.array(passing)), t["h"].to_numpy()[passing]) >= 0
            cand = t.filter(pa.array(~is_known & (n >= c.min_count)))
            known_q[c.name] = (values, hashes, ids, int(n[is_known].sum()), is_known)
            cand_q[c.name] = cand
            summ_q[c.name] = {"hist": np.unique(cand["n"].to_numpy(), return_counts=True),
                              "distinct": t.num_rows, "rows": int(n.sum())}
        new_hist.append(merged_q)
        known.append(known_q)
        cands.append(cand_q)
        summaries.append(summ_q)
    room = [counts.Column(c.name, True, c.min_count, max(0, c.max_size - len(by_name[c.name])), c.buckets)
            for c in columns]
    cut = counts.cuts(summaries, room) if columns else [{} for _ in range(P)]
    parts, kept, digests, coverage = [], {c.name: [] for c in columns}, {c.name: [] for c in columns}, {}
    covered = {c.name: 0 for c in columns}
    buckets = {c.name: (np.zeros(c.buckets, np.int64), np.zeros(c.buckets, np.int64)) for c in columns
               if c.buckets_of_rest}
    for q in range(P):
        summ, new_part = counts.finalize(cands[q], cut[q], room)
        part = {}
        for c in columns:
            values, hashes, ids, cov, is_known = known[q][c.name]
            nv, nh, nid, _ = new_part[c.name]
            if c.name in buckets:  # vocab+hash: the values left out share hash buckets
                t = new_hist[q][c.name]
                rest = ~is_known & ~np.isin(t["h"].to_numpy(), nh)
                b = (t["h"].to_numpy()[rest] % np.uint64(c.buckets)).astype(np.int64)
                buckets[c.name][0][:] += np.bincount(b, minlength=c.buckets)
                buckets[c.name][1][:] += np.bincount(b, weights=t["n"].to_numpy()[rest], minlength=c.buckets).astype(np.int64)
            nid = (nid.astype(np.int64) + len(by_name[c.name])).astype(np.int32)
            covered[c.name] += cov + summ[c.name]["covered"]
            allv = pa.concat_arrays([_col(values).cast(pa.large_string()), _col(nv).cast(pa.large_string())])
            if allv.nbytes < 2**31:
                allv = allv.cast(pa.string())
            allh = np.concatenate([hashes, nh.astype(np.uint64)])
            allid = np.concatenate([ids, nid]).astype(np.int32)
            part[c.name] = (allv, allh, allid, build_index(allh))
            kept[c.name].append(len(allid))
            digests[c.name].append(counts.part_digest(allh, allid))
        parts.append(part)
    shared = Parts(parts)
    vocab = []
    for name, v, op in zip(prev.categorical, prev.vocab, categorical_ops(prev)):
        if name in kept:
            vocab.append(PartedVocabulary(name, shared, kept[name], column_digest(P, digests[name])))
        else:
            vocab.append(v)
    for c in columns:
        distinct = sum(s[c.name]["distinct"] for s in summaries)
        total = sum(s[c.name]["rows"] for s in summaries)
        rest = (total - covered[c.name]) / total if total else 0.0
        coverage[c.name] = {"distinct": distinct, "kept": sum(kept[c.name]), "nulls": nulls.get(c.name, 0),
                            "unknown_share": rest}
        if c.name in buckets:  # as counts.coverage says it for a fit: the rest hashed, not unknown
            occupied, in_bucket = buckets[c.name]
            coverage[c.name].update(unknown_share=0.0, hashed_share=rest, hashed_into=c.buckets,
                                    shared_bucket_share=float(in_bucket[occupied >= 2].sum() / total) if total else 0.0)
    hist = CountHistory(new_hist, [c.name for c in columns], history.rows + rows)
    return tuple(vocab), hist, coverage


def recounted(prev, total, cols, p) -> CountHistory:
    """The history of a previous fit that kept none (the count shuffle's), from its rows counted again,
    laid out in its vocabularies' parts."""
    parts = max([v.partitions for v in prev.vocab if isinstance(v, PartedVocabulary)], default=1)
    return CountHistory.of(total.categories, shuffle_columns(cols, p.vocab_max_size, p.vocab_min_count), parts,
                           total.rows)[0]


def extended(prev, counts_then: CountHistory, total, cols, p, entry: dict):
    """The previous fitted state extended by an increment's merged statistics `total` (p: the preprocess
    settings; entry: the range, for the lineage)."""
    nulls = {c: prev.stats.get("categorical", {}).get(c, {}).get("nulls", 0) + total.category_nulls.get(c, 0)
             for c in prev.categorical}
    vocab, counts_now, coverage = extend(prev, counts_then, total.categories, cols, p.vocab_max_size,
                                         p.vocab_min_count, nulls, total.rows)
    stats = {**prev.stats, "categorical": {**prev.stats.get("categorical", {}), **coverage},
             "rows": prev.stats.get("rows", 0) + total.rows,
             "lineage": [*prev.stats.get("lineage", []), {**entry, "previous": lineage_digest(prev), "rows": total.rows}]}
    changes = {"vocab": vocab, "history": counts_now}
    if p.refit_numeric:
        got = refit_numeric(prev, total)
        changes.update(mean=got["mean"], std=got["std"])
        stats["numeric"] = got["numeric_stats"]
    return replace(prev, stats=stats, **changes)


def refit_numeric(prev, total) -> dict:
    """The previous numeric statistics merged with the increment's (preprocess.refit_numeric): the
    fields of the fitted state to replace. Only standardised columns (the default) carry what the merge
    needs (count, mean, variance per slot); other transforms are refused."""
    from .stats import NumericStats

    ops = numeric_ops(prev)
    odd = [c for c, op in zip(prev.numeric, ops) if not op.is_default]
    if odd:
        raise DataError(f"preprocess.refit_numeric = true, but numeric column '{odd[0]}' has its own transform "
                        f"({ops[prev.numeric.index(odd[0])]}), whose statistics (quantile sketches) the fitted state "
                        f"does not keep; leave refit_numeric false, or fit again without since=")
    mean, std, stats = list(prev.mean), list(prev.std), dict(prev.stats.get("numeric", {}))
    j = 0
    for c, d in zip(prev.numeric, prev.dims):
        k = max(d, 1)
        s = prev.stats.get("numeric", {}).get(c, {})
        before = int(s.get("count", 0)) // k
        for i, inc in enumerate(total.numeric.get(c, [NumericStats()] * k)):
            constant = s.get("min") is not None and s.get("min") == s.get("max")  # its scale 1 is no spread
            was = NumericStats(before, mean[j + i], 0.0 if constant else (std[j + i] ** 2) * before)
            m = was.merge(inc)
            mean[j + i], std[j + i] = float(m.mean), (float(np.sqrt(m.var)) if m.var > 0 else 1.0)
        got = total.numeric.get(c, [])
        stats[c] = {"count": int(s.get("count", 0)) + sum(n.count for n in got),
                    "null_rows": int(s.get("null_rows", 0)) + total.null_rows.get(c, 0),
                    "min": min([x for x in [s.get("min"), *(n.min for n in got if n.count)] if x is not None],
                               default=None),
                    "max": max([x for x in [s.get("max"), *(n.max for n in got if n.count)] if x is not None],
                               default=None)}
        j += k
    return {"mean": tuple(mean), "std": tuple(std), "numeric_stats": stats}


def lineage_digest(prev) -> str:
    """A digest of the previous fitted state (its JSON with its vocabularies' digest)."""
    import json

    d = prev.to_dict(vocab_file="-")
    d.pop("stats", None)
    return hashlib.blake2b(json.dumps(d, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def growth(now, previous) -> dict[str, tuple[int, int]]:
    """Per categorical column: (ids before, ids after), the unknown id 0 and hash buckets included, as
    `cardinalities` counts them (what an embedding table needs)."""
    before = dict(zip(previous.categorical, previous.cardinalities))
    return {c: (before.get(c, 0), n) for c, n in zip(now.categorical, now.cardinalities)}


__all__ = ["CountHistory", "extend", "extended", "recounted", "refit_numeric", "growth", "lineage_digest", "to_state",
           "from_state"]
