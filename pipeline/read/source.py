"""Shard discovery and footer checks, before any heavy work.

`inspect` lists the shards, reads every footer in parallel and checks each file against the config:
zero-byte files, wrong magic bytes, truncated or unreadable footers, missing columns, wrong types and
types that drift between shards. Bad files fail the run with one clear paragraph, or (quality.on_bad_file
= "quarantine") are set aside and accounted for.

The unit of distributed work is a `Fragment`: one row group of one file, with its global row offset.
Knowing every row's global id up front (from the footers alone) is what makes row accounting exact
and the split across ranks a pure function of the data layout.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import storage
from . import tables
from ..fit import transforms
from ..fit.columns import KINDS, NUMERIC_FAMILIES, Columns, Target, common_length, family
from ..config import Config
from ..errors import DataError, NoUsableRows

_SKIP_PREFIXES = ("_", ".")  # _SUCCESS, _metadata, _common_metadata, .crc files, hidden files
_MAGIC = b"PAR1"
_ENCRYPTED_MAGIC = b"PARE"
_NEEDS_KEYS = ("reading it needs its decryption keys (pyarrow.parquet.encryption: a KMS client and the key ids), "
               "which this pipeline does not take; decrypt it upstream, or set quality.on_bad_file = \"quarantine\" "
               "to train on the other files")
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


@dataclass(frozen=True)
class Fragment:
    """One row group of one Parquet file, and where its rows start (globally and in the file)."""

    path: str
    row_group: int
    row_start: int
    num_rows: int
    file_row_start: int = 0
    partition: tuple[tuple[str, Any], ...] = ()  # Spark/Hive key=value directories (text), or a table's values
    renames: tuple[tuple[str, str], ...] = ()  # a table's file: (name in the file, the table's column), every one
    deleted: bytes = b""  # positions (int64) in this row group of rows the table has deleted

    @property
    def live_rows(self) -> int:
        """The rows of the table in this row group: its rows less those the table deleted."""
        return self.num_rows - len(self.deleted) // 8

    def keep(self) -> np.ndarray | None:
        """The row group's keep-mask, or None when the table deleted none of its rows."""
        if not self.deleted:
            return None
        mask = np.ones(self.num_rows, dtype=bool)
        mask[np.frombuffer(self.deleted, dtype=np.int64)] = False
        return mask

    def row_ids(self) -> np.ndarray:
        """Global ids of the rows it yields (a deleted row's id is never used)."""
        ids = np.arange(self.row_start, self.row_start + self.num_rows)
        keep = self.keep()
        return ids if keep is None else ids[keep]


@dataclass(frozen=True)
class Shard:
    path: str
    num_rows: int
    row_group_rows: tuple[int, ...]
    size_bytes: int
    schema: pa.Schema
    partition: tuple[tuple[str, str | None], ...] = ()
    mtime_ns: int | None = None
    footer_bytes: int = 0
    renames: tuple[tuple[str, str], ...] = ()  # a table's file: (name in the file, the table's column); schema is
    # then the table's, and a table column no pair names reads as null
    deleted: bytes = b""  # positions (int64) of the file's rows the table has deleted

    @property
    def rows(self) -> int:
        """The rows of the table in this file (its rows less those the table deleted)."""
        return self.num_rows - len(self.deleted) // 8

    @property
    def fingerprint(self) -> list:
        """What a saved fit checks to know the file is the one it fitted (see prepare's fit_from, ingest/plan.py's load_fit)."""
        return [self.path, self.size_bytes, self.mtime_ns, self.num_rows, list(self.row_group_rows), self.footer_bytes]


@dataclass(frozen=True)
class BadFile:
    path: str
    reason: str
    rows: int | None  # None where the footer could not be read

    def manifest(self) -> dict:
        return {"file": self.path, "row_group": None, "rows": self.rows, "reason": self.reason}


@dataclass(frozen=True)
class Source:
    """What validation found: the good shards (in a fixed order), the fragments to read, the bad files."""

    uri: str
    shards: tuple[Shard, ...]
    fragments: tuple[Fragment, ...]
    bad_files: tuple[BadFile, ...] = field(default_factory=tuple)
    columns: Columns = Columns()
    inferred: tuple[str, ...] | None = None  # features were inferred from the schema: the columns skipped
    table: tables.Snapshot | None = None  # a Delta or Iceberg table: the version whose files these are

    def conversions(self, stats: dict) -> list[str]:
        """How numbers float64 cannot hold exactly were turned into features, said once per column.
        stats: the fitted preprocessor's per-column statistics (their min and max)."""
        if not self.shards:
            return []
        schema, out = self.shards[0].schema, []
        for c, d in zip(self.columns.numeric, self.columns.dims):
            if d or c not in schema.names:
                continue
            t = schema.field(c).type
            t = t.value_type if pa.types.is_dictionary(t) else t
            s = stats.get("numeric", {}).get(c, {})
            big = max(abs(s.get("min") or 0), abs(s.get("max") or 0)) >= 2**53
            if pa.types.is_timestamp(t) or pa.types.is_duration(t):
                out.append(f"'{c}' ({t}) is its integer count of {t.unit} (since 1970 for a timestamp)")
            elif pa.types.is_date(t):
                out.append(f"'{c}' ({t}) is its count of {'days' if pa.types.is_date32(t) else 'ms'} since 1970")
            elif pa.types.is_decimal(t):
                out.append(f"'{c}' ({t}) is rounded to the nearest float64")
            elif pa.types.is_integer(t) and t.bit_width == 64 and big:
                out.append(f"'{c}' ({t}) holds integers beyond 2^53, rounded to the nearest float64 (a float32 "
                           f"feature keeps 24 bits of them in any case)")
        return out

    def describe_columns(self) -> str:
        """One line: which columns play which role (and, when inferred, which were skipped)."""
        c = self.columns
        dims = [f"{n}[{d}]" if d else n for n, d in zip(c.numeric, c.dims)]
        how = "inferred from the schema" if self.inferred is not None else "from the config"
        skipped = f"; skipped {', '.join(self.inferred)}" if self.inferred else ""
        return (f"features {how}: numeric {dims}, categorical {list(c.categorical)}{skipped}; targets "
                f"{[t.name for t in c.targets] or 'none'}" + (f"; weight '{c.weight}'" if c.weight else "")
                + (f"; passed through {list(c.passthrough)}" if c.passthrough else ""))

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def fingerprint(self) -> list:
        return [s.fingerprint for s in self.shards] + [[b.path, b.rows, b.reason] for b in self.bad_files]

    @property
    def where(self) -> str:
        """What was read, for the lines a job prints: the folder, or the table and its version."""
        return self.table.describe() if self.table else f"under {self.uri}"

    @property
    def quarantined_rows(self) -> int:
        return sum(b.rows or 0 for b in self.bad_files)


def list_shards(uri: str) -> list[str]:
    """Every Parquet file under `uri`, sorted, skipping markers and hidden files."""
    fs, root = storage.filesystem(uri)
    info = fs.get_file_info(root)
    if info.type.name == "NotFound":
        raise DataError(f"data path '{uri}' does not exist; set data.path to a directory of Parquet files "
                        f"(or run `python -m pipeline generate` to write the demo dataset there)")
    if info.type.name == "File":
        return [root]
    paths = [p for p in storage.list_files(fs, root)
             if not any(part.startswith(_SKIP_PREFIXES) for part in p[len(root):].split("/") if part)
             and not p.endswith((".tmp", ".crc"))]
    if not paths:
        raise DataError(f"no Parquet files under '{uri}'; point data.path at a directory holding *.parquet shards")
    return paths


def partition_of(path: str, root: str) -> tuple[tuple[str, str | None], ...]:
    """key=value directories between root and the file (Spark/Hive layout), values URL-decoded."""
    parts = path[len(root):].strip("/").split("/")[:-1]
    out = []
    for part in parts:
        if "=" in part:
            k, v = part.split("=", 1)
            v = unquote(v)
            out.append((unquote(k), None if v == _HIVE_NULL else v))
    return tuple(out)


def _footer(fs, path: str, root: str, listed: tables.TableFile | None = None,
            snap: tables.Snapshot | None = None) -> Shard | BadFile:
    """The file's footer as a Shard, or why it cannot be used. listed: the file as the table `snap`
    lists it (its partition values, deletes and row count come from the table's metadata, and its
    columns are the table's, found in the file by the table's ids or names)."""
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            if size == 0:
                return BadFile(path, "file is empty (0 bytes)", 0)
            head = f.read_at(4, 0)
            tail = f.read_at(4, size - 4) if size >= 8 else b""
            if _ENCRYPTED_MAGIC in (head, tail):
                return BadFile(path, f"encrypted Parquet file (encrypted footer, magic {_ENCRYPTED_MAGIC!r}): {_NEEDS_KEYS}", None)
            if head != _MAGIC:
                return BadFile(path, f"not a Parquet file (starts with {head!r}, Parquet starts with {_MAGIC!r})", None)
            if tail != _MAGIC:
                return BadFile(path, f"truncated: {size} bytes and no Parquet footer at the end (ends with {tail!r})", None)
            md = pq.ParquetFile(f).metadata
            schema = md.schema.to_arrow_schema()
    except FileNotFoundError:
        if listed is None:
            raise
        return BadFile(path, "listed by the table's version but missing (removed by a vacuum, or by hand, while that "
                             "version is still read?)", None if listed.rows is None else listed.rows - listed.deleted_rows)
    except (OSError, pa.ArrowException) as e:
        if "encrypt" in str(e).lower() or "decrypt" in str(e).lower():
            return BadFile(path, f"encrypted Parquet file ({e}): {_NEEDS_KEYS}", None)
        return BadFile(path, f"unreadable Parquet footer ({e})", None)
    if listed is not None and listed.rows is not None and listed.rows != md.num_rows:
        return BadFile(path, f"holds {md.num_rows} rows but the table records {listed.rows} for it (the file was "
                             f"replaced behind the table's back)", listed.rows - listed.deleted_rows)
    groups = tuple(md.row_group(g).num_rows for g in range(md.num_row_groups))
    try:
        mtime = fs.get_file_info(path).mtime_ns
    except (OSError, pa.ArrowException):
        mtime = None
    if listed is None or snap is None:
        return Shard(path, md.num_rows, groups, size, schema, partition_of(path, root), mtime, md.serialized_size)
    try:
        renames = tables.file_columns(snap, schema)
    except DataError as e:
        return BadFile(path, str(e), md.num_rows - listed.deleted_rows)
    return Shard(path, md.num_rows, groups, size, snap.schema, listed.partition, mtime, md.serialized_size, renames,
                 listed.deleted)


def column_types(shard: Shard, function: str = "") -> dict[str, str]:
    """Type family of every column, partition keys (strings) included; with preprocess.function, of
    the columns it gives back (it is run on the file's schema, no rows)."""
    out = {name: family(shard.schema.field(name).type) for name in shard.schema.names}
    for k, _ in shard.partition:
        out.setdefault(k, "string")
    if function:
        empty = shard.schema.empty_table()
        for k, _ in shard.partition:
            if k not in empty.column_names:
                empty = empty.append_column(k, pa.array([], pa.string()))
        after = transforms.apply_function(function, empty)
        out = {name: family(after.schema.field(name).type) for name in after.schema.names}
    return out


_TARGET_FAMILIES = {"bool", "int", "float", "string"}


def _roles(cfg: Config, features: tuple[list[str], list[str]]) -> list[tuple[str, str]]:
    d = cfg.data
    return [*((c, "numeric") for c in features[0]), *((c, "categorical") for c in features[1]),
            *((t, "label") for t in d.targets), *(((d.weight, "weight"),) if d.weight else ()),
            *((c, "passthrough") for c in d.passthrough)]


def _column_problem(shard: Shard, cfg: Config, roles, types: dict[str, str], majority: dict[str, str]) -> str | None:
    for col, role in roles:
        if col not in types:
            return (f"column '{col}' (data.{role}) is missing; the file has: {', '.join(sorted(types))}. "
                    f"Fix data.{role} or the file")
        fam = types[col]
        if role == "numeric" and fam not in NUMERIC_FAMILIES | {"vector"}:
            fix = "list it under data.categorical" if fam == "string" else "cast it to a number upstream"
            return f"column '{col}' is {fam}, config says numeric (a number or a list of numbers); {fix}"
        if role == "weight" and fam not in NUMERIC_FAMILIES - {"temporal"}:
            return f"column '{col}' is {fam}, data.weight must be a number; cast it upstream or name another column"
        if role == "label":
            kind = cfg.data.kind_of(col)
            if fam not in _TARGET_FAMILIES:
                return (f"target column '{col}' is {fam}; a target must be a bool, an integer, a float or a string "
                        f"(allowed kinds: {', '.join(KINDS)}); cast it upstream or pick another data.label")
            if fam == "string" and kind in ("binary", "regression"):
                return (f"target column '{col}' holds strings, data.target_kind says {kind}; set data.target_kind = "
                        f"\"multiclass\" (or \"auto\") or cast the column upstream")
        if role == "categorical" and fam not in {"bool", "int", "float", "string", "binary"}:
            return f"column '{col}' is {fam}, config says categorical (string, integer or bool); cast it upstream"
        # Numbers may widen between shards (int8 here, float64 there); a target's values are the same
        # either way (3 and 3.0 are one class), a category's are not ('3' vs '3.0').
        widen = {"int", "bool", "float"} if role == "label" else {"int", "bool"}
        if role in ("categorical", "label") and fam != majority[col] and not (fam in widen and majority[col] in widen):
            # '3' and 3.0 would become different categories: refuse rather than split a vocabulary silently.
            return (f"column '{col}' is {fam} here but {majority[col]} in most shards (type drift); "
                    f"write it with one type in every shard")
    return None


def infer_features(cfg: Config, types: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(numeric, categorical, skipped) from the column types: numbers and lists of numbers are numeric;
    strings, dictionaries and bools categorical; the rest skipped. Targets, the weight and data.exclude
    are never features."""
    d = cfg.data
    taken = {*d.targets, d.weight, *d.exclude, *d.passthrough}
    numeric, categorical, skipped = [], [], []
    for name, fam in types.items():
        if name in taken:
            continue
        if fam in {"int", "float", "temporal", "vector"}:
            numeric.append(name)
        elif fam in {"string", "bool"}:
            categorical.append(name)
        else:
            skipped.append(f"{name} ({fam})")
    return numeric, categorical, skipped


def common_columns(types: dict[str, dict[str, str]]) -> tuple[dict[str, str], list[str]]:
    """The columns every file has, each with its most common type family (in first-seen order), and
    the columns only some files have, named with their count of files: features are inferred from
    all files' schemas together, never from the first file alone."""
    files: Counter = Counter()
    fams: dict[str, Counter] = {}
    for t in types.values():
        for name, fam in t.items():
            files[name] += 1
            fams.setdefault(name, Counter())[fam] += 1
    n = len(types)
    common = {name: c.most_common(1)[0][0] for name, c in fams.items() if files[name] == n}
    partial = [f"{name} (in {files[name]} of {n} files)" for name in fams if files[name] < n]
    return common, partial


def _vector_dim(fs, shard: Shard, col: str) -> int:
    """The length of a list column's values: from the schema (fixed-size list) or, for a plain list,
    the most common length in the first row group that has a non-null value."""
    t = shard.schema.field(col).type
    if pa.types.is_fixed_size_list(t):
        return t.list_size
    name = in_file(shard, [col])
    with fs.open_input_file(shard.path) as f:
        pf = pq.ParquetFile(f)
        for g in range(pf.metadata.num_row_groups if name else 0):
            dim = common_length(pf.read_row_group(g, columns=name)[0])
            if dim is not None:
                return dim
    raise DataError(f"numeric column '{col}' in '{shard.path}' is a list column with no non-null value, so its "
                    f"length is unknown; fill it upstream or remove it from data.numeric")


def inspect(cfg: Config, uri: str | None = None, table: tables.Snapshot | None = None,
            paths: list[str] | None = None) -> Source:
    """List shards, read every footer in parallel, check each file against the config. table / paths:
    read these files of the table (or of the folder) instead of the whole version (an increment,
    increments.py)."""
    uri = uri or cfg.data.path
    d = cfg.data
    fmt = None if table is not None or paths is not None else "iceberg" if d.catalog else tables.find(uri)
    table = table if table is not None else tables.snapshot(uri, fmt, d.version, d.catalog) if fmt else None
    if table is not None:
        listed = {f.path: f for f in table.files}
        paths = list(listed)
        if not paths:
            raise NoUsableRows(f"the {table.describe()}: it holds no rows. Write to the table, or pin a version that "
                               f"has rows (data.version)", "")
        uri = table.root
    else:
        if d.version and paths is None:
            raise DataError(f"data.version = {d.version!r} is set, but '{uri}' is a folder of Parquet files, not a Delta "
                            f"or Iceberg table, so it has no versions; leave data.version empty or point data.path at "
                            f"the table's root")
        listed, paths = {}, list_shards(uri) if paths is None else paths
    fs, root = storage.filesystem(uri)
    with ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
        found = list(pool.map(lambda p: _footer(fs, p, root, listed.get(p), table), paths))
    good = [s for s in found if isinstance(s, Shard)]
    bad = [b for b in found if isinstance(b, BadFile)]
    types = {s.path: column_types(s, cfg.preprocess.function) for s in good}
    inferred = not cfg.data.numeric and not cfg.data.categorical
    skipped: list[str] = []
    if inferred and good:
        common, partial = common_columns(types)
        numeric, categorical, skipped = infer_features(cfg, common)
        skipped += [p for p in partial if p.split(" (")[0] not in {*d.targets, d.weight, *d.exclude, *d.passthrough}]
    else:
        numeric, categorical = list(cfg.data.numeric), list(cfg.data.categorical)
    roles = _roles(cfg, (numeric, categorical))
    majority = {}
    for col, _ in roles:
        seen = Counter(t[col] for t in types.values() if col in t)
        majority[col] = seen.most_common(1)[0][0] if seen else "missing"
    shards = []
    for s in good:
        problem = _column_problem(s, cfg, roles, types[s.path], majority)
        if problem is None:
            shards.append(s)
        else:
            bad.append(BadFile(s.path, problem, s.rows))
    bad.sort(key=lambda b: b.path)
    if bad and cfg.quality.on_bad_file == "fail":
        first = bad[0]
        more = f" ({len(bad) - 1} more bad files are listed by `python -m pipeline validate`)" if len(bad) > 1 else ""
        raise DataError(f"'{first.path}': {first.reason}.{more} Rewrite or remove the file, or set "
                        f"quality.on_bad_file = \"quarantine\" to set bad files aside and train on the rest")
    if not shards:
        import json

        raise NoUsableRows(f"none of the {len(paths)} files under '{uri}' is usable: {list_reasons([b.manifest() for b in bad])}. "
                           f"Fix the data or data.path",
                           "".join(json.dumps(b.manifest(), sort_keys=True) + "\n" for b in bad))
    if not numeric and not categorical:
        raise DataError(f"no feature columns: data.numeric and data.categorical are empty and none could be inferred "
                        f"from '{shards[0].path}' (columns: {', '.join(types[shards[0].path])}); list them in the config")
    dims = tuple(_vector_dim(fs, shards[0], c) if types[shards[0].path][c] == "vector" else 0 for c in numeric)
    try:
        ops = transforms.resolve(cfg.preprocess, numeric, categorical, set(types[shards[0].path]))
    except ValueError as e:
        raise DataError(str(e)) from None
    columns = Columns(numeric=tuple(numeric), dims=dims, categorical=tuple(categorical),
                      numeric_ops=ops[0], categorical_ops=ops[1], crosses=ops[2], function=cfg.preprocess.function,
                      targets=tuple(Target(t, majority[t], cfg.data.kind_of(t)) for t in cfg.data.targets),
                      weight=cfg.data.weight or None, passthrough=tuple(cfg.data.passthrough),
                      label_values=cfg.quality.label_values)
    fragments = []
    offset = 0
    for s in shards:
        at = 0
        deleted = np.frombuffer(s.deleted, dtype=np.int64)
        for g, n in enumerate(s.row_group_rows):
            gone = deleted[(deleted >= at) & (deleted < at + n)] - at
            if n > len(gone):  # a row group the table deleted whole yields nothing: no fragment
                fragments.append(Fragment(s.path, g, offset, n, at, s.partition, s.renames, gone.tobytes()))
            offset += n
            at += n
    return Source(uri, tuple(shards), tuple(fragments), tuple(bad), columns,
                  tuple(skipped) if inferred else None, table)


def list_reasons(entries: list[dict], most: int = 5) -> str:
    """'file' (row group g): reason; ... for the first few manifest entries, and how many more."""
    shown = [f"'{e['file']}'" + (f" row group {e['row_group']}" if e.get("row_group") is not None else "")
             + f": {e['reason']}" for e in entries[:most]]
    more = f"; and {len(entries) - most} more" if len(entries) > most else ""
    return "; ".join(shown) + more


class DamagedRowGroup(OSError):
    """A row group decoded without error to values its footer says it cannot hold."""


def statistics_problem(rg, table: pa.Table) -> str | None:
    """Check each decoded column chunk against the footer's statistics, where the writer stored them:
    the null count always, min and max for integers, floats and bools (strings are left alone: some
    writers store truncated bounds). A page whose bytes changed without a checksum to tell can still
    decode; its values then rarely keep the chunk's exact null count, minimum and maximum."""
    for j in range(rg.num_columns):
        chunk = rg.column(j)
        name = chunk.path_in_schema
        stats = chunk.statistics if chunk.is_stats_set else None
        if stats is None or name not in table.column_names:
            continue
        col = table[name]
        if stats.has_null_count and col.null_count != stats.null_count:
            return f"column '{name}': {col.null_count} nulls decoded, the footer says {stats.null_count}"
        t = col.type
        if not stats.has_min_max or not (pa.types.is_integer(t) or pa.types.is_boolean(t)
                                         or pa.types.is_float32(t) or pa.types.is_float64(t)):
            continue
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo is None:
            continue  # only nulls or NaN decoded: the null count above already spoke
        if (lo, hi) != (stats.min, stats.max):
            return f"column '{name}': min {lo!r} and max {hi!r} decoded, the footer says {stats.min!r} and {stats.max!r}"
    return None


@contextlib.contextmanager
def opened(uri: str, path: str, dictionary: tuple[str, ...] = ()):
    """The file as a ParquetFile (page checksums verified where the writer stored them), opened once
    for every row group a task reads from it; None when it cannot be opened, and each read then opens
    it itself and reports why for its own row group. dictionary: columns to read as dictionary arrays
    where the file stores them as strings (categoricals: each distinct value is then looked up once
    per row group, not once per row; see columns.category_ids)."""
    fs, _ = storage.filesystem(uri)
    try:
        f = fs.open_input_file(path)
        pf = pq.ParquetFile(f, page_checksum_verification=True)
        schema = pf.schema_arrow
        as_dict = [c for c in dictionary if c in schema.names and family(schema.field(c).type) == "string"]
        if as_dict:  # the same footer, read once
            pf = pq.ParquetFile(f, page_checksum_verification=True, metadata=pf.metadata, read_dictionary=as_dict)
    except (OSError, pa.ArrowException):
        yield None
        return
    with f:
        yield pf


def deep_check(uri: str, shard: Shard) -> Iterator[tuple[int, str | None]]:
    """(row group, problem or None) for every row group of the file: every page of every column
    decoded, with page checksums verified where stored, and checked against the footer's statistics."""
    with opened(uri, shard.path) as pf:
        for g in range(len(shard.row_group_rows)):
            if pf is None:
                yield g, "the file cannot be opened"
                continue
            try:
                table = pf.read_row_group(g)
                problem = statistics_problem(pf.metadata.row_group(g), table)
                yield g, (f"decoded values disagree with the footer's statistics ({problem})" if problem else None)
            except (OSError, pa.ArrowException) as e:
                yield g, f"cannot be decoded ({type(e).__name__}: {e})"


def in_file(part: Shard | Fragment, columns) -> list[str]:
    """The names in the file of those of `columns` it holds (a table's file may name them otherwise, or
    lack a column the table added later)."""
    if not part.renames:
        return list(columns)
    names = {t: f for f, t in part.renames}
    return [names[c] for c in columns if c in names]


def read_fragment(uri: str, frag: Fragment, columns: list[str] | None, pf: pq.ParquetFile | None = None,
                  schema: pa.Schema | None = None, defaults: tuple[tuple[str, Any], ...] = ()) -> pa.Table:
    """Read one row group, only the named columns (column pushdown; None: every column), with page
    checksums verified where the writer stored them, from `pf` (see opened) or the file; partition keys
    named in `columns` come from the table's metadata or the path. schema: a table's (source.Source.table):
    the columns are then the table's, found in the file by frag.renames, typed as the table says, null
    where the file predates them (or `defaults`' value); and the rows the table deleted are left out."""
    if pf is None:
        with opened(uri, frag.path) as pf:
            if pf is None:  # open it again without the guard, for the error itself
                fs, _ = storage.filesystem(uri)
                with fs.open_input_file(frag.path) as f:
                    pq.ParquetFile(f)
            return read_fragment(uri, frag, columns, pf, schema, defaults)
    part = dict(frag.partition)
    file_names = pf.schema_arrow.names
    to_table = dict(frag.renames) if schema is not None else {n: n for n in file_names}
    from_table = {t: f for f, t in to_table.items()}
    if columns is None:
        columns = list(schema.names) if schema is not None else list(dict.fromkeys([*file_names, *part]))
    table = pf.read_row_group(frag.row_group, columns=[from_table[c] for c in columns if c in from_table])
    for col in table.columns:
        if pa.types.is_dictionary(col.type):  # a damaged page can decode to indices past its dictionary
            col.validate(full=True)
    problem = statistics_problem(pf.metadata.row_group(frag.row_group), table)
    if problem:
        raise DamagedRowGroup(f"decoded values disagree with the footer's statistics ({problem})")
    keep = frag.keep()
    if keep is not None:
        table = table.filter(pa.array(keep))
    table = table.rename_columns([to_table[n] for n in table.column_names])
    if schema is None:
        for c in columns:
            if c not in table.column_names and c in part:
                table = table.append_column(c, pa.array([part[c]] * table.num_rows, type=pa.string()))
        return table.select(columns)
    out = {}
    for c in columns:
        want = schema.field(c).type
        if c in table.column_names:
            out[c] = conform(table[c], want, c, frag.path)
        elif c in part:
            out[c] = constant(part[c], want, table.num_rows)
        else:  # added to the table after this file was written
            out[c] = constant(dict(defaults).get(c), want, table.num_rows)
    return pa.table(out) if out else table.select([])


def constant(value: Any, type_: pa.DataType, n: int) -> pa.Array:
    """`value` n times, as `type_` (a table's partition value)."""
    if value is None:
        return pa.nulls(n, type_)
    try:
        scalar = pa.scalar(value, type=type_)
    except (pa.ArrowException, TypeError, ValueError):
        scalar = pa.scalar(value).cast(type_)  # e.g. an Iceberg date partition held as its day number
    return pa.repeat(scalar, n)


_NUMBERS = {"bool", "int", "float", "temporal"}


def conform(col: pa.ChunkedArray, want: pa.DataType, name: str, path: str) -> pa.ChunkedArray:
    """A file's column as the table's type, where the table widened it (int to long, float to double,
    decimal precision, a timestamp's unit); text, binary and lists are kept in the layout read (a
    dictionary, a view), which every reader here takes as the same values."""
    have = col.type
    if have == want or not (family(have) in _NUMBERS and family(want) in _NUMBERS):
        return col
    try:  # a timestamp read finer than the table's unit (INT96 as ns): the table's unit, as its reader does
        return col.cast(want, safe=not (pa.types.is_timestamp(have) and pa.types.is_timestamp(want)))
    except pa.ArrowException as e:
        raise DataError(f"column '{name}' in '{path}' is {have}, which cannot be read as the table's type {want} "
                        f"({e}); rewrite the file with the table's type") from None
