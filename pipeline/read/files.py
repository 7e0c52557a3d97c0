"""Listing a folder's Parquet files and reading their footers: the shards, their row groups as
Fragments (one row group of one file, with its global row offset), and the files set aside.

Knowing every row's global id up front (from the footers alone) is what makes row accounting exact
and the split across ranks a pure function of the data layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import storage
from ..errors import DataError
from . import tables

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
