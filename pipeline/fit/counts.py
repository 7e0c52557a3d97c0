"""Category counts as a hash-partitioned shuffle: the fit's memory for categorical columns is spread
over P reducers, and the process that plans the fit receives sizes and small histograms only.

At click-through-rate scale a categorical column has hundreds of millions of distinct values (Criteo
1TB: 883M over its 26 columns), so no one process may hold every count. As in Spark's DLRM
preprocessing and NVTabular's `split_out`:

1. map (one task per group of row groups, `split`): the group's count table of every categorical
   column {value, hash, rows}, split by the value's 64-bit FNV-1a hash into P contiguous hash ranges;
2. reduce (one task per hash range, `reduce_counts`): the range's counts of every column merged, the
   frequency threshold applied; what goes back is the number of distinct values and rows, and a
   histogram {count: values with that count} of the values kept, never a value;
3. cut (`cuts`, where the fit is planned): from the histograms, the count at which the top
   `max_size` ends and, per range, the first id of every count it keeps;
4. finalize (one task per hash range, `finalize`): the range's part of every vocabulary (values,
   hashes, global ids, the hash index of vocab.py) and its coverage sums.

Ids are a pure function of the data and the settings, whatever P and the number of machines: values
in order of count (descending), then of hash, then of text, numbered from 1 (0 is unknown). Because
the hash ranges are contiguous and in hash order, a count's values are numbered range by range, so
each range numbers its own values from the histograms alone. The top `max_size` taken this way is
exactly the single-process top-K with ties broken by hash.

Without Ray the same functions run one after the other in the calling process (`in_process`), with
the same ids; its memory then grows with the data. No Ray and no torch in this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .vocab import build_index, partition_of, value_hashes

MAX_AUTO_PARTITIONS = 64
# "auto": one hash range per 4M rows of the source, 1 to 64. Each fit task returns one object per range,
# owned (with its lineage) by the process that plans the fit, so groups x P objects cost it memory:
# measured on 8M Criteo-shaped rows, P = 8 added 9 MiB to the driver beside P = 1, P = 128 158 MiB
# (the small objects Ray inlines into their owner). See bench_scale.py.
ROWS_PER_PARTITION = 4_000_000


def partitions_for(setting: int | str, rows: int) -> int:
    """P: preprocess.vocab_partitions, or for "auto" one per 4M rows (1 to 64). It sets how the counts
    and the vocabularies are laid out, never the ids."""
    if setting != "auto":
        return int(setting)
    return int(min(MAX_AUTO_PARTITIONS, max(1, rows // ROWS_PER_PARTITION)))


@dataclass(frozen=True)
class Column:
    """How one categorical feature (crosses included) is counted. counted: it gets a vocabulary of its
    values (keep: values with at least `min_count` rows, at most `max_size` of them); otherwise it is
    hashed and counted by its 64-bit hashes for its coverage line. buckets: its hash buckets (hash,
    vocab+hash), whose sharing by two values the coverage reports."""

    name: str
    counted: bool
    min_count: int = 1
    max_size: int = 0
    buckets: int = 0

    @property
    def buckets_of_rest(self) -> bool:
        """vocab+hash: the values the vocabulary leaves out are hashed into buckets."""
        return self.counted and self.buckets > 0


# ---------------------------------------------------------------------------------------------
# Map: split a group's count tables by hash range


def keyed(t: pa.Table, counted: bool) -> pa.Table:
    """A count table {v, n} (v: text, or a uint64 hash for a hashed column) as {h, n[, v]}."""
    if counted:
        v = t["v"].combine_chunks() if isinstance(t["v"], pa.ChunkedArray) else t["v"]
        return pa.table({"h": pa.array(value_hashes(v), pa.uint64()), "n": t["n"], "v": v})
    return pa.table({"h": t["v"].cast(pa.uint64()), "n": t["n"]})


def split(counts: dict[str, pa.Table], columns: Sequence[Column], partitions: int) -> list[dict[str, pa.Table]]:
    """One group's count tables {v, n} per column as P dicts {column: {h, n[, v]}}, dict q holding the
    values whose hash falls in range q."""
    out: list[dict[str, pa.Table]] = [{} for _ in range(partitions)]
    for c in columns:
        for p, t in enumerate(_ranges(keyed(counts[c.name], c.counted), partitions)):
            out[p][c.name] = t
    return out


# ---------------------------------------------------------------------------------------------
# Reduce: merge a hash range's counts


def _merged(tables: list[pa.Table], counted: bool) -> pa.Table:
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pa.table({"h": pa.array([], pa.uint64()), "n": pa.array([], pa.int64()),
                         **({"v": pa.array([], pa.string())} if counted else {})})
    t = pa.concat_tables(tables, promote_options="permissive")
    if counted:  # by text (two texts may share a hash)
        g = t.group_by("v", use_threads=False).aggregate([("n", "sum"), ("h", "min")])  # a task has one CPU
        return pa.table({"h": g["h_min"], "n": g["n_sum"], "v": g["v"]})
    g = t.group_by("h", use_threads=False).aggregate([("n", "sum")])
    return pa.table({"h": g["h"], "n": g["n_sum"]})


def _buckets(t: pa.Table, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """(values per bucket saturated at 2 as uint8 [B], rows per bucket int64 [B]) of a count table."""
    b = (t["h"].to_numpy() % np.uint64(buckets)).astype(np.int64)
    n = t["n"].to_numpy()
    return (np.minimum(np.bincount(b, minlength=buckets), 2).astype(np.uint8),
            np.bincount(b, weights=n, minlength=buckets).astype(np.int64))


def reduce_counts(parts: Sequence[dict[str, pa.Table]], columns: Sequence[Column]) -> tuple[dict, dict]:
    """(summary, merged) of one hash range, over every map's part of it. summary per column: distinct
    values, rows, and for a vocabulary the histogram of the counts it may keep (counts, values with
    that count), for a hashed column its buckets' occupancy; merged: what finalize needs (a
    vocabulary's values at or above the threshold; for vocab+hash every value)."""
    summary, merged = {}, {}
    for c in columns:
        summary[c.name], m = _reduced(_merged([p[c.name] for p in parts], c.counted), c)
        if m is not None:
            merged[c.name] = m
    return summary, merged


def _reduced(t: pa.Table, c: Column) -> tuple[dict, pa.Table | None]:
    """(summary, what finalize needs or None) of one column's merged count table {h, n[, v]}."""
    s: dict[str, Any] = {"distinct": t.num_rows, "rows": int(pc.sum(t["n"]).as_py() or 0)}
    merged = None
    if c.counted:
        kept = t.filter(pc.greater_equal(t["n"], c.min_count)) if c.min_count > 1 else t
        s["hist"] = np.unique(kept["n"].to_numpy(), return_counts=True)
        merged = t if c.buckets_of_rest else kept
    elif c.buckets:
        s["buckets"] = _buckets(t, c.buckets)
    return s, merged


# ---------------------------------------------------------------------------------------------
# Cut: the top-K cut-off and every range's first ids, from the histograms


def cuts(summaries: Sequence[dict], columns: Sequence[Column]) -> list[dict[str, dict]]:
    """Per hash range, per vocabulary column: {cut, take, counts, base}: values with more than `cut`
    rows are kept, and the first `take` (in hash order) of those with exactly `cut`; a kept value with
    n rows that is the j-th (from 0) of its range with n rows, in hash order, gets id 1 + base[n] + j."""
    out: list[dict[str, dict]] = [{} for _ in summaries]
    for c in columns:
        if not c.counted:
            continue
        hists = [s[c.name]["hist"] for s in summaries]
        counts = np.unique(np.concatenate([h[0] for h in hists])) if hists else np.zeros(0, np.int64)
        counts = counts[::-1]  # descending
        per = np.zeros((len(hists), len(counts)), np.int64)  # values of range q with counts[i] rows
        for q, (n, k) in enumerate(hists):
            per[q, len(counts) - 1 - np.searchsorted(counts[::-1], n)] = k
        total = per.sum(axis=0)
        above = np.concatenate([[0], np.cumsum(total)])  # values with more rows than counts[i]: above[i]
        limit = c.max_size
        if above[-1] <= limit:
            cut_i, cut, left = len(counts), 0, 0  # everything kept
        else:
            cut_i = int(np.searchsorted(above[1:], limit, side="left"))  # the first count where the top-K ends
            cut, left = int(counts[cut_i]), int(limit - above[cut_i])
        before = np.cumsum(per, axis=0) - per  # values of earlier ranges with counts[i] rows
        for q in range(len(hists)):
            take = int(np.clip(left - before[q, cut_i], 0, per[q, cut_i])) if cut_i < len(counts) else 0
            kept_counts = counts[:cut_i + 1] if cut_i < len(counts) else counts
            base = above[:len(kept_counts)] + before[q, :len(kept_counts)]
            out[q][c.name] = {"cut": cut, "take": take, "counts": kept_counts, "base": base}
    return out


# ---------------------------------------------------------------------------------------------
# Finalize: a range's part of every vocabulary


def finalize(merged: dict[str, pa.Table], cut: dict[str, dict], columns: Sequence[Column]) -> tuple[dict, dict]:
    """(summary, part) of one hash range. part per vocabulary column: (values in id order, their
    hashes, their ids int32, the hash index); summary: values kept, rows they cover, the part's digest
    and, vocab+hash, the buckets of the values left out."""
    summary, part = {}, {}
    for c in columns:
        if not c.counted:
            continue
        t, k = merged[c.name], cut[c.name]
        t = t.take(pa.array(_order(t)))
        n = t["n"].to_numpy()
        # position of each row within its count (rows sorted by count): j
        starts = np.flatnonzero(np.concatenate([[True], n[1:] != n[:-1]])) if len(n) else np.zeros(0, np.int64)
        j = np.arange(len(n)) - np.repeat(starts, np.diff(np.concatenate([starts, [len(n)]])))
        keep = ((n > k["cut"]) | ((n == k["cut"]) & (j < k["take"]))) & (n >= c.min_count)
        counts, base = k["counts"], k["base"]
        kept, nk, jk = t.filter(pa.array(keep)), n[keep], j[keep]
        at = len(counts) - 1 - np.searchsorted(counts[::-1], nk)  # the count's place in `counts` (descending)
        ids = (1 + base[at] + jk).astype(np.int32) if len(nk) else np.zeros(0, np.int32)
        values = kept["v"].combine_chunks() if isinstance(kept["v"], pa.ChunkedArray) else kept["v"]
        hashes = kept["h"].to_numpy().astype(np.uint64)
        part[c.name] = (values, hashes, ids, build_index(hashes))
        s: dict[str, Any] = {"kept": len(ids), "covered": int(nk.sum()), "digest": part_digest(hashes, ids)}
        if c.buckets_of_rest:
            s["buckets"] = _buckets(t.filter(pa.array(~keep)), c.buckets)
        summary[c.name] = s
    return summary, part


def _order(t: pa.Table) -> np.ndarray:
    """The rows of a count table {h, n, v} by count (descending), hash, then text: numpy's lexsort on the
    two numbers, the text compared only where two values share a count and a 64-bit hash (almost never)."""
    n, h = t["n"].to_numpy(), t["h"].to_numpy()
    order = np.lexsort((h, -n))
    hs, ns = h[order], n[order]
    same = np.flatnonzero((hs[1:] == hs[:-1]) & (ns[1:] == ns[:-1]))
    if same.size:
        v = t["v"]
        for start in np.unique(same):  # a run of values sharing count and hash: by text
            end = start + 1
            while end < len(order) and hs[end] == hs[start] and ns[end] == ns[start]:
                end += 1
            run = order[start:end]
            order[start:end] = run[np.argsort(np.array(v.take(pa.array(run)).to_pylist(), dtype=object))]
    return order


def part_digest(hashes: np.ndarray, ids: np.ndarray) -> str:
    d = hashlib.blake2b(digest_size=16)
    d.update(len(ids).to_bytes(8, "little"))
    d.update(memoryview(np.ascontiguousarray(hashes)).cast("B"))
    d.update(memoryview(np.ascontiguousarray(ids)).cast("B"))
    return d.hexdigest()


# ---------------------------------------------------------------------------------------------
# Coverage: what the vocabularies keep, from the summaries


def coverage(columns: Sequence[Column], first: Sequence[dict], second: Sequence[dict],
             nulls: dict[str, int]) -> dict[str, dict]:
    """Per column the fit's coverage line (preprocess.coverage_lines): distinct values, kept, the share of
    rows that map to unknown, or for hashed buckets the share of rows whose bucket two values share."""
    out = {}
    for c in columns:
        distinct = sum(s[c.name]["distinct"] for s in first)
        rows = sum(s[c.name]["rows"] for s in first)
        if not c.counted:
            out[c.name] = _bucket_share(c, [s[c.name].get("buckets") for s in first], rows) | {
                "hashed_into": c.buckets, "distinct": distinct, "nulls": nulls.get(c.name, 0)}
            continue
        covered = sum(s[c.name]["covered"] for s in second)
        e = {"distinct": distinct, "kept": sum(s[c.name]["kept"] for s in second), "nulls": nulls.get(c.name, 0),
             "unknown_share": (rows - covered) / rows if rows else 0.0}
        if c.buckets_of_rest:
            shared = _bucket_share(c, [s[c.name]["buckets"] for s in second], rows)["shared_bucket_share"]
            e.update(unknown_share=0.0, hashed_share=(rows - covered) / rows if rows else 0.0, hashed_into=c.buckets,
                     shared_bucket_share=shared)
        out[c.name] = e
    return out


def _bucket_share(c: Column, parts: list, rows: int) -> dict[str, float]:
    """The share of `rows` in buckets that two or more distinct values share, summed over the ranges."""
    parts = [p for p in parts if p is not None]
    if not parts or not rows:
        return {"shared_bucket_share": 0.0}
    occupied = np.zeros(c.buckets, np.int64)
    in_bucket = np.zeros(c.buckets, np.int64)
    for occ, n in parts:
        occupied += occ
        in_bucket += n
    return {"shared_bucket_share": float(in_bucket[occupied >= 2].sum() / rows)}


# ---------------------------------------------------------------------------------------------
# The whole shuffle in one process (no Ray): the same functions, the same ids


def in_process(categories: dict[str, list[pa.Table]], columns: Sequence[Column],
               partitions: int, threads: int | None = None, keep: bool = False) -> tuple:
    """(parts, first, second): parts[q] is range q's part of every vocabulary (finalize's part); first
    and second: reduce_counts's and finalize's summaries, per range. keep: a fourth item, every value's
    count of the vocabulary columns as range q's {column: {h, n, v}} (prepare(since=)'s history: the values
    below the threshold too, so every value is hashed).

    One process needs less than the cluster's map, reduce and finalize: each column's count tables are
    merged once (one group-by), so a range's slice of them is already its merged table (no second
    group-by), and with one range nothing is split. The columns are independent: `threads` of them at
    once (default: one per core; pyarrow and numpy release the GIL), each through the same functions
    as the cluster's reducers, so the ids are the same."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def column(c: Column) -> tuple[list, list, list]:
        from .columns import count_merge

        t = count_merge(categories.get(c.name, []))
        every: list = [None] * partitions
        if partitions == 1 and c.counted and not c.buckets_of_rest and c.min_count > 1 and not keep:
            # one range and a threshold: only the values kept are hashed (on Criteo-shaped data about one
            # in five); the summary is _reduced's
            s: dict[str, Any] = {"distinct": t.num_rows, "rows": int(pc.sum(t["n"]).as_py() or 0)}
            kept = keyed(t.filter(pc.greater_equal(t["n"], c.min_count)), True)
            s["hist"] = np.unique(kept["n"].to_numpy(), return_counts=True)
            first, merged = [s], [kept]
        else:
            t = keyed(t, c.counted)
            every = [t] if partitions == 1 else _ranges(t, partitions)
            first, merged = map(list, zip(*(_reduced(r, c) for r in every)))
        firsts = [{c.name: f} for f in first]
        second, parts = map(list, zip(*(finalize({c.name: m} if m is not None else {}, k, [c])
                                        for m, k in zip(merged, cuts(firsts, [c])))))
        return firsts, second, parts, every

    n = max(1, min(len(columns), threads or os.cpu_count() or 1))
    with ThreadPoolExecutor(n) as pool:
        done = list(pool.map(column, columns))
    first: list[dict] = [{} for _ in range(partitions)]
    second: list[dict] = [{} for _ in range(partitions)]
    parts: list[dict] = [{} for _ in range(partitions)]
    kept: list[dict] = [{} for _ in range(partitions)]
    for c, (f, s, p, every) in zip(columns, done):  # in column order, as reduce_counts and finalize build their dicts
        for q in range(partitions):
            first[q].update(f[q])
            second[q].update(s[q])
            parts[q].update(p[q])
            if keep and c.counted:
                kept[q][c.name] = every[q]
    return (parts, first, second, kept) if keep else (parts, first, second)


def _ranges(t: pa.Table, partitions: int) -> list[pa.Table]:
    """A keyed count table {h, n[, v]} cut into its P hash ranges (split's order: stable within a range)."""
    q = partition_of(t["h"].to_numpy(), partitions)
    t = t.take(pa.array(np.argsort(q, kind="stable")))
    ends = np.cumsum(np.bincount(q, minlength=partitions))
    return [t.slice(int(ends[p - 1]) if p else 0, int(ends[p]) - (int(ends[p - 1]) if p else 0))
            for p in range(partitions)]
