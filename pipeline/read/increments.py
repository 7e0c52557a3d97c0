"""Increments: the rows a source gained after a previous plan's version (`prepare(since=...)`).

An increment is a Source like any other (source.inspect over a chosen set of files), so the plan,
the shares, rank_data, resume and quarantine work on it unchanged. Which files, per format:

- Delta with the change data feed on (delta.enableChangeDataFeed): deltalake's `load_cdf` over
  (a, b], its `insert` and `update_postimage` rows. An update's post-image rows sit in rewritten
  files beside the rows the update left alone, so they cannot be named as positions of a data file:
  they are written once to `<table>/_pipeline_increments/cdf-<a>-<b>/` (a folder Delta treats as
  hidden, on the table's own storage, so every node reads it) and the increment is that folder.
- Delta without it: the files that commits in (a, b] added as new data (`dataChange` true), read as
  version b lists them (its deletion vectors applied); a compaction (OPTIMIZE, `dataChange` false)
  adds no row, and a file of the range it compacted away is read as it was written (compaction does
  not change rows); a DELETE adds none. An UPDATE, MERGE or overwrite cannot say which rows are new
  without the feed: refused.
- Iceberg: pyiceberg's `incremental_append_scan` over (a, b]: the data files of append snapshots
  with the delete files pyiceberg gives them; replace, overwrite and delete snapshots add no row
  (each is named in a note).
- A folder of Parquet files: the files no plan of the chain had. A file of the chain that vanished
  or changed (size, or its footer's row count) is refused: its rows were planned already.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from .. import storage
from . import iceberg as iceberg_format
from . import tables
from .snapshot import s3_options
from ..errors import DataError, PipelineError

_CDF_DIR = "_pipeline_increments"
_CDF_KEEP = ("insert", "update_postimage")
_FULL = "prepare the plan without since= (a full fit of the table as it is now)"


@dataclass(frozen=True)
class Range:
    """What an increment read: the rows `name` gained after version `after` up to version `upto`. A
    folder's versions count the plans of the chain (0: the full plan). known: a folder's files planned
    so far over the chain, (path, size, rows)."""

    format: str  # "delta", "iceberg" or "parquet"
    name: str
    after: str
    upto: str
    how: str = ""  # what was read (the change data feed, appended files, ...)
    known: tuple[tuple[str, int, int | None], ...] = ()
    notes: tuple[str, ...] = ()  # what added no row, columns left out
    next_id: int = 0  # the first global row id after the chain's rows: ids never repeat over a chain, and a folder's
    # rows keep the ids (so the validation hold-out) one plan over all its files gives them

    def describe(self) -> str:
        return f"rows added after version {self.after} up to version {self.upto}"

    def to_dict(self) -> dict:
        return {"format": self.format, "source": self.name, "after": self.after, "upto": self.upto, "how": self.how}


def start_of(plan) -> Range:
    """Where an increment after `plan` starts: its own range's end, or the version its table was read at."""
    inc = getattr(plan, "increment", None)
    if inc is not None:
        return inc
    src = plan.source
    ids = sum(s.num_rows for s in src.shards)
    if src.table is not None:
        return Range(src.table.format, src.table.name, src.table.version, src.table.version, next_id=ids)
    known = tuple((s.path, s.size_bytes, s.num_rows) for s in src.shards) + \
        tuple((b.path, _size(b.path, src.uri), b.rows) for b in src.bad_files)
    return Range("parquet", src.uri, "0", "0", known=known, next_id=ids)


def same_settings(now: dict, then: dict) -> None:
    """Refuse, naming them, the data/quality/preprocess settings (ingest.plan._fit_settings) that differ from
    the previous plan's: an extended fit's ids and thresholds mean something under its settings only."""
    now, then = {k: dict(v) for k, v in now.items()}, {k: dict(v) for k, v in then.items()}
    now["data"].pop("path", None), then["data"].pop("path", None)
    changed = [f"{sec}.{k} = {then[sec].get(k)!r} then, {v!r} now" for sec, body in now.items() for k, v in body.items()
               if then.get(sec, {}).get(k) != v]
    if changed:
        raise PipelineError(f"the previous plan was made with other settings ({'; '.join(changed[:4])}): an increment "
                            f"extends its fit, so its data, quality and preprocess settings must stay the same. Leave "
                            f"them out (since= takes the previous plan's), or {_FULL}")


def gained(cfg, prev) -> tuple[tables.Snapshot | None, list[str] | None, Range]:
    """What the source at cfg.data.path gained after the previous plan `prev`: (a table's files as a
    Snapshot, or None; the paths to read instead (a folder's new files, the change data feed's rows),
    or None; the range). Refused: another source, a column of the previous fit the table dropped."""
    from .files import list_shards

    start, uri = start_of(prev), cfg.data.path
    fmt = "iceberg" if cfg.data.catalog else tables.find(uri)
    other = same_source(start, uri, fmt)
    if other:
        raise PipelineError(f"{other}: since= must name a plan of the same table or folder. Pass that plan, or {_FULL}")
    table, paths = None, None
    with tables.guarded(f"the {fmt or 'Parquet'} source '{uri}'", f"planning what it gained after version {start.upto}"):
        if fmt == "delta":
            table, rng, paths = delta(uri, start, cfg.data.version)
        elif fmt == "iceberg":
            table, rng = iceberg(uri, start, cfg.data.version, cfg.data.catalog)
        else:
            paths, rng = folder(uri, start, list_shards)
    was, cols = _schema(prev.source), prev.source.columns
    if table is not None and was is not None:
        needed = [*cols.numeric, *cols.categorical, *(t.name for t in cols.targets), *([cols.weight] if cols.weight else [])]
        gone = [c for c in needed if c in was.names and c not in table.schema.names]
        if gone:
            raise DataError(f"column '{gone[0]}' of the previous fit is no longer in the {fmt} table '{uri}' (version "
                            f"{rng.upto}): an increment cannot fit or transform it. Add the column back, or {_FULL}")
        rng = _added(rng, [c for c in table.schema.names if c not in was.names], "were added to the table")
    return table, paths, rng


def placed(src, rng: Range, before) -> tuple:
    """The increment's Source with global row ids after the chain's, and its range with what it read
    (a folder's files, for the next increment; columns its new files add)."""
    src = replace(src, fragments=tuple(replace(f, row_start=f.row_start + rng.next_id) for f in src.fragments))
    rng = replace(rng, next_id=rng.next_id + sum(s.num_rows for s in src.shards))
    if src.table is None and rng.format == "parquet":
        known = tuple((s.path, s.size_bytes, s.num_rows) for s in src.shards) + \
            tuple((b.path, _size(b.path, src.uri), b.rows) for b in src.bad_files)
        was = _schema(before)
        rng = _added(replace(rng, known=rng.known + known),
                     [c for s in src.shards[:1] for c in s.schema.names if was is not None and c not in was.names],
                     "are new in the added files")
    return src, rng


def _schema(src) -> pa.Schema | None:
    return src.table.schema if src.table is not None else src.shards[0].schema if src.shards else None


def _added(rng: Range, added: list[str], how: str) -> Range:
    if not added:
        return rng
    return replace(rng, notes=(*rng.notes, f"column(s) {', '.join(added)} {how} since the previous fit: not features "
                                           f"until a full refit (prepare without since=)"))


def same_source(start: Range, uri: str, fmt: str | None) -> str | None:
    """Why `uri` is not the source the previous plan read, or None."""
    here = fmt or "parquet"
    mine = uri if fmt == "iceberg" and "://" not in uri and not uri.startswith("/") else _norm(uri)
    theirs = start.name if start.format == "iceberg" and "://" not in start.name and not start.name.startswith("/") \
        else _norm(start.name)
    if here != start.format or mine != theirs:
        return f"the previous plan read the {start.format} source '{start.name}', this call reads the {here} source '{uri}'"
    return None


def _norm(uri: str) -> str:
    return os.path.abspath(uri).rstrip("/") if storage.is_local(uri) else uri.rstrip("/")


def _size(path: str, uri: str) -> int:
    fs, _ = storage.filesystem(uri)
    try:
        return fs.get_file_info(path).size or 0
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# Delta


def delta(uri: str, start: Range, version: str) -> tuple[tables.Snapshot, Range, list[str] | None]:
    """(the files of the increment as a Snapshot, its range, None) or, read through the change data
    feed, (version b, its range, the paths of the materialised rows' folder)."""
    snap = tables.snapshot(uri, "delta", version)
    a, b = int(start.upto), int(snap.version)
    if b < a:
        raise DataError(f"the Delta table '{uri}' is read at version {b}, before the previous plan's version {a}: "
                        f"an increment reads forward. Leave data.version empty (the latest) or set it to {a} or later")
    rng = Range("delta", start.name, str(a), str(b), next_id=start.next_id)
    if b == a:
        return replace(snap, files=()), replace(rng, how="nothing new"), None
    from deltalake import DeltaTable

    table = DeltaTable(snap.root, version=b, storage_options=s3_options(uri) or None)
    if (table.metadata().configuration or {}).get("delta.enableChangeDataFeed", "").lower() == "true":
        folder, rows = _materialise_cdf(uri, table, snap, a, b)
        return replace(snap, files=()), replace(rng, how=f"the change data feed ({rows:,} rows)"), folder if rows else None
    fs, root = storage.filesystem(uri)
    new, compacted, tainted, notes = {}, {}, set(), []
    for v in range(a + 1, b + 1):
        op, adds, removes, quiet, quiet_adds = _commit(fs, root, uri, v, a)
        gone = {p for p in removes} & (set(new) | tainted)
        if quiet:  # a compaction: files in, files out, no row changed
            for p in quiet:
                if p in new:
                    compacted[p] = new[p]
            if set(quiet) & (set(new) | tainted):
                tainted |= set(quiet_adds)
            if not removes:
                notes.append(f"version {v} ({op}) rewrote files without changing rows: no row added")
                continue
        if op == "DELETE" or (removes and not adds):
            if gone - set(adds):
                raise DataError(f"version {v} of the Delta table '{uri}' ({op}) deleted rows that versions after {a} "
                                f"had added, and without the change data feed the rows left cannot be told apart. "
                                f"Turn the feed on (ALTER TABLE ... SET TBLPROPERTIES (delta.enableChangeDataFeed = "
                                f"true)) or {_FULL}")
            notes.append(f"version {v} ({op}) adds no row")
            continue
        if removes:
            raise DataError(f"version {v} of the Delta table '{uri}' is an {op} (it rewrote data files), and without "
                            f"the change data feed an increment cannot say which of the rewritten rows are new. Turn "
                            f"the feed on (delta.enableChangeDataFeed = true, then increments read load_cdf's inserted "
                            f"and updated rows) or {_FULL}")
        new.update(adds)
    live = {f.path: f for f in snap.files}
    files = []
    for p, add in sorted(new.items()):
        if p in live:
            files.append(live[p])
        elif p in compacted:
            if not storage.exists(fs, p):
                raise DataError(f"the Delta table '{uri}' no longer has the data file '{p}' that version {add[0]} "
                                f"added (compacted since, then vacuumed): the rows added after version {a} cannot be "
                                f"read. {_FULL[0].upper() + _FULL[1:]}")
            files.append(tables.TableFile(p, add[1], _typed(add[2], snap.schema)))
        else:
            raise DataError(f"the data file '{p}' that version {add[0]} of the Delta table '{uri}' added is not in "
                            f"version {b}; {_FULL}")
    return replace(snap, files=tuple(files)), replace(rng, how=f"{len(files)} appended files", notes=tuple(notes)), None


def _commit(fs, root: str, uri: str, v: int, a: int):
    """(operation, {path: (version, rows, partition values)} added as new data, paths removed as data
    changes, paths removed and added without a data change) of commit v."""
    path = f"{root}/_delta_log/{v:020d}.json"
    try:
        with fs.open_input_stream(path) as f:
            lines = f.read().decode().splitlines()
    except (FileNotFoundError, OSError):
        raise DataError(f"the Delta table '{uri}' no longer has the commit of version {v} ({path}; its log was cleaned "
                        f"up), so the rows added after version {a} cannot be listed. {_FULL[0].upper() + _FULL[1:]}"
                        ) from None
    op, adds, removes, quiet, quiet_adds = "WRITE", {}, [], [], []
    for line in lines:
        if not line.strip():
            continue
        act = json.loads(line)
        if "commitInfo" in act:
            op = act["commitInfo"].get("operation", op)
            if op == "WRITE" and str((act["commitInfo"].get("operationParameters") or {}).get("mode", "")).lower() \
                    == "overwrite":
                op = "WRITE (overwrite)"
        elif "add" in act:
            add = act["add"]
            if add.get("dataChange", True):
                p = _abs(root, add["path"])
                stats = json.loads(add.get("stats") or "{}")
                adds[p] = (v, stats.get("numRecords"), tuple((add.get("partitionValues") or {}).items()))
            else:
                quiet_adds.append(_abs(root, add["path"]))
        elif "remove" in act:
            rem = act["remove"]
            (removes if rem.get("dataChange", True) else quiet).append(_abs(root, rem["path"]))
    return op, adds, removes, quiet, quiet_adds


def _abs(root: str, rel: str) -> str:
    return storage.filesystem(rel)[1] if "://" in rel else f"{root}/{unquote(rel)}"


def _typed(values, schema: pa.Schema | None) -> tuple:
    out = []
    for k, v in values:
        t = schema.field(k).type if schema is not None and k in schema.names else pa.string()
        out.append((k, None if v is None else pa.scalar(v).cast(t).as_py()))
    return tuple(out)


def _materialise_cdf(uri: str, table, snap: tables.Snapshot, a: int, b: int) -> tuple[list[str], int]:
    """load_cdf's inserted and post-update rows of (a, b] as Parquet files under the table's hidden
    _pipeline_increments/ folder (written once; a folder already there is reused)."""
    import pyarrow.compute as pc

    fs, root = storage.filesystem(snap.root)
    folder = f"{root}/{_CDF_DIR}/cdf-{a}-{b}"
    done = f"{folder}/part-00000.parquet"
    if storage.exists(fs, done):
        return [done], pq.read_metadata(done, filesystem=fs).num_rows
    try:
        reader = table.load_cdf(starting_version=a + 1, ending_version=b)
        got = pa.table(pa.RecordBatchReader.from_stream(reader))
    except Exception as e:  # noqa: BLE001 - deltalake's own errors, as one paragraph
        raise DataError(f"the change data feed of the Delta table '{uri}' cannot be read for versions {a + 1} to {b} "
                        f"({type(e).__name__}: {e}); the feed must be on for every commit after version {a} (and its "
                        f"_change_data files kept). {_FULL[0].upper() + _FULL[1:]}") from None
    views = {pa.string_view(): pa.large_string(), pa.binary_view(): pa.large_binary()}  # deltalake reads views,
    got = got.cast(pa.schema([f.with_type(views.get(f.type, f.type)) for f in got.schema]))  # few kernels take them
    got = got.filter(pc.is_in(got["_change_type"], pa.array(_CDF_KEEP)))
    got = got.sort_by([("_commit_version", "ascending")]).select([n for n in snap.schema.names if n in got.column_names])
    try:
        fs.create_dir(folder, recursive=True)
        tmp = f"{done}.{os.getpid()}.tmp"
        with fs.open_output_stream(tmp) as out:
            pq.write_table(got, out, row_group_size=1 << 17)
        fs.move(tmp, done)
    except OSError as e:
        raise DataError(f"cannot write the change data feed's rows of the Delta table '{uri}' to '{folder}' ({e}): an "
                        f"increment read through the feed is kept there so every node reads the same rows. Make the "
                        f"table's folder writable, or {_FULL}") from None
    return [done], got.num_rows


# ---------------------------------------------------------------------------------------------
# Iceberg


def iceberg(uri: str, start: Range, version: str, catalog: str) -> tuple[tables.Snapshot, Range]:
    """The data files pyiceberg's incremental_append_scan plans over (a, b], with their deletes."""
    snap = tables.snapshot(uri, "iceberg", version, catalog)
    a, b = start.upto, snap.version
    rng = Range("iceberg", start.name, a, b, next_id=start.next_id)
    if a == b:
        return replace(snap, files=()), replace(rng, how="nothing new")
    table = _iceberg_table(uri, catalog)
    if table.metadata.snapshot_by_id(int(a)) is None and not _has_child_of(table, int(a), int(b)):
        raise DataError(f"the Iceberg table '{uri}' no longer has snapshot {a}, the previous plan's (expired, or another "
                        f"table's), so what was added after it cannot be told. {_FULL[0].upper() + _FULL[1:]}")
    try:
        scan = table.incremental_append_scan(from_snapshot_id_exclusive=int(a), to_snapshot_id_inclusive=int(b))
        tasks = list(scan.plan_files())
    except ValueError as e:
        raise DataError(f"the Iceberg table '{uri}' cannot list what was appended after snapshot {a} up to {b} ({e}). "
                        f"{_FULL[0].upper() + _FULL[1:]}") from None
    deletes, specs = iceberg_format.Deletes(uri, int(b), table.io), table.specs()
    schema = table.schema()
    files = tuple(sorted((tables.TableFile(storage.filesystem(t.file.file_path)[1], t.file.record_count,
                                           iceberg_format.partition_values(schema, specs.get(t.file.spec_id), t.file.partition),
                                           deletes.of(t.file.file_path, t.delete_files)) for t in tasks),
                         key=lambda f: f.path))
    notes = tuple(f"snapshot {s.snapshot_id} ({s.summary.operation.value}) adds no row: an increment reads append "
                  f"snapshots only (pyiceberg's incremental_append_scan)" for s in _between(table, int(a), int(b))
                  if s.summary is not None and s.summary.operation.value != "append")
    return replace(snap, files=files), replace(rng, how=f"{len(files)} appended files", notes=notes)


def _iceberg_table(uri: str, catalog: str):
    if catalog:
        from pyiceberg.catalog import load_catalog

        return load_catalog(catalog).load_table(uri)
    from pyiceberg.table import StaticTable

    fs, path = storage.filesystem(uri)
    meta = storage.to_uri(fs, iceberg_format.metadata_file(fs, path))
    return StaticTable.from_metadata(meta if "://" in meta else f"file://{meta}", iceberg_format.properties())


def _between(table, a: int, b: int) -> list:
    out, s = [], table.metadata.snapshot_by_id(b)
    while s is not None and s.snapshot_id != a:
        out.append(s)
        s = table.metadata.snapshot_by_id(s.parent_snapshot_id) if s.parent_snapshot_id is not None else None
    return out[::-1]


def _has_child_of(table, a: int, b: int) -> bool:
    return any(s.parent_snapshot_id == a for s in _between(table, a, b))


# ---------------------------------------------------------------------------------------------
# A folder of Parquet files


def folder(uri: str, start: Range, list_shards) -> tuple[list[str], Range]:
    """The files under `uri` that no plan of the chain had; a file of the chain that vanished or changed
    is refused."""
    fs, _ = storage.filesystem(uri)
    paths = list_shards(uri)
    here = set(paths)

    def changed(k):
        path, size, rows = k
        if path not in here:
            return f"'{path}' was planned by the previous plan and is gone"
        info = fs.get_file_info(path)
        if info.size != size:
            return f"'{path}' was planned with {size:,} bytes and now has {info.size:,}"
        if rows is not None:
            try:
                now = pq.read_metadata(path, filesystem=fs).num_rows
            except (OSError, pa.ArrowException):
                now = None
            if now != rows:
                return f"'{path}' was planned with {rows:,} rows and its footer now says {now}"
        return None

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(start.known)))) as pool:
        bad = [w for w in pool.map(changed, start.known) if w]
    if bad:
        raise DataError(f"{bad[0]}{f' ({len(bad) - 1} more files changed)' if len(bad) > 1 else ''}: an increment of a "
                        f"folder reads only files added since, so rows rewritten in place or removed would be trained "
                        f"on twice or kept. Restore the file and add new rows as new files, or {_FULL}")
    known = {k[0] for k in start.known}
    new = [p for p in paths if p not in known]
    upto = str(int(start.upto) + 1) if new else start.upto
    return new, Range("parquet", start.name, start.upto, upto, how=f"{len(new)} new files", known=start.known,
                      next_id=start.next_id)
