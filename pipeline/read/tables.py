"""Lakehouse tables: a Delta Lake or Iceberg table is read as the table says, never as a folder.

A table's folder keeps the Parquet files of earlier versions beside the current ones (overwritten,
deleted and compacted rows stay on disk until a vacuum), so listing the folder trains on rows the table
no longer holds. Here the format's own library (deltalake, pyiceberg) names the files of one version of
the table, with their row counts and partition values; source.inspect reads exactly those files, and
the plan carries them, so every rank reads that one version however the table moves on during the run.

The table, not the file, says what a row is:
- deletes: Delta deletion vectors and Iceberg position deletes (Parquet delete files, v3 deletion
  vectors in Puffin files), read through the format's library, become each file's deleted positions,
  applied to every row group as it is read (a deleted row is not a row of the table);
- columns: the table's schema names and types them. A file's columns are found by the table's column
  ids (Iceberg field ids; Delta column mapping's physical names or ids), or through Iceberg's name
  mapping for files written without ids; a column the table has and an older file lacks reads as null;
  an integer or float the table widened reads as the table's type;
- partition values are typed as the table's schema says.
What the project cannot apply (Iceberg equality deletes, data files that are not Parquet, a reader
feature it does not know) is refused in one paragraph naming it: reading the files without it would
bring deleted rows back or misname columns, silently.

This module finds a table and dispatches to its format: delta.py, iceberg.py; snapshot.py holds what
both give (Snapshot, TableFile) and their shared helpers.
"""

from __future__ import annotations

import pyarrow.fs as pafs

from .. import storage
from ..errors import DataError
from . import delta, iceberg
from .snapshot import Snapshot, TableFile, cannot_read, file_columns, guarded  # noqa: F401 - the read stage's table names

_LEVELS_UP = 6  # how far above data.path a table root is looked for (a partition folder sits a few down)


def table_format(fs: pafs.FileSystem, path: str) -> str | None:
    """'delta', 'iceberg' or 'hudi' when `path` is a table's root folder, else None."""
    if storage.exists(fs, f"{path}/_delta_log"):
        return "delta"
    if storage.exists(fs, f"{path}/.hoodie"):
        return "hudi"
    meta = f"{path}/metadata"
    if fs.get_file_info(meta).type == pafs.FileType.Directory:
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(meta))]
        if any(n.endswith(".metadata.json") for n in names):
            return "iceberg"
    return None


def find(uri: str) -> str | None:
    """The format of the table whose root is `uri` (None for plain Parquet). A path inside a table (its
    data/ folder, a partition folder) is refused, naming the root: its files are every version's."""
    with guarded(f"'{uri}'", "looking for a table there"):
        fs, path = storage.filesystem(uri)
        if fs.get_file_info(path).type != pafs.FileType.Directory:
            return None
        fmt = table_format(fs, path)
    if fmt == "hudi":
        raise DataError(f"'{uri}' is an Apache Hudi table (it has .hoodie/), which this pipeline does not read: its "
                        f"folder holds the files of earlier commits beside the current ones. Export the current "
                        f"snapshot to Parquet (or to a Delta or Iceberg table) and point data.path there")
    if fmt:
        return fmt
    above = path
    for _ in range(_LEVELS_UP):
        parent = above.rsplit("/", 1)[0]
        if not parent or parent == above or parent.endswith(":"):
            break
        above = parent
        try:
            fmt = table_format(fs, above)
        except OSError:  # a folder above that cannot be listed (a bucket's root without the right to list it)
            break
        if fmt:
            root = storage.to_uri(fs, above)
            raise DataError(f"'{uri}' is inside the {fmt} table at '{root}': its files there include rows the table "
                            f"has overwritten or deleted. Set data.path = '{root}' to read the table's current "
                            f"version (data.version pins another)")
    return None


def snapshot(uri: str, fmt: str, version: str = "", catalog: str = "") -> Snapshot:
    """The files of the table at `version` ("" the latest: a Delta version or an Iceberg snapshot id,
    or an ISO timestamp for the version current then). catalog: a pyiceberg catalog name, and `uri`
    is then the table's identifier (namespace.table)."""
    name = "Delta" if fmt == "delta" else "Iceberg"
    with guarded(f"the {name} table '{uri}'", "opening and planning it"):
        if fmt == "delta":
            return delta.snapshot(uri, version)
        return iceberg.snapshot(uri, version, catalog)
