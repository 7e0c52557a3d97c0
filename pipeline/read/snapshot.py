"""What reading a table gives the rest of the read stage: a Snapshot (one version of the table: its files
with their row counts, deleted positions and partition values, its schema and defaults), and the helpers
both formats share (errors in one paragraph, S3 options, the table's column ids in a file).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .. import storage
from ..errors import DataError, PipelineError

_FIELD_ID = b"PARQUET:field_id"


@dataclass(frozen=True)
class TableFile:
    path: str  # inside the table's filesystem (storage.filesystem(Snapshot.root)[0])
    rows: int | None  # the row count the table records for the file (None where it records none)
    partition: tuple[tuple[str, Any], ...] = ()  # from the table's metadata, typed as its schema says
    deleted: bytes = b""  # positions (int64, sorted, unique) of the file's rows that the table has deleted

    @property
    def deleted_rows(self) -> int:
        return len(self.deleted) // 8


@dataclass(frozen=True)
class Snapshot:
    """One version of a table: the data files that make it up, and which version that is."""

    format: str  # "delta" or "iceberg"
    name: str  # the table root, or catalog.identifier
    root: str  # URI of the table's location: its files live on that filesystem
    version: str  # Delta version number, Iceberg snapshot id ("" for an Iceberg table with no snapshot)
    files: tuple[TableFile, ...]
    schema: pa.Schema | None = None  # the table's columns, names and types as its own reader returns them
    ids: tuple[tuple[int, str], ...] = ()  # a file column's field id -> the table's column (Iceberg; Delta id mode)
    physical: tuple[tuple[str, str], ...] = ()  # a file column's name -> the table's column, for files without
    # ids (Delta column mapping's physical names; Iceberg's name mapping); () : the table's names themselves
    defaults: tuple[tuple[str, Any], ...] = ()  # a column's value in files written before it was added (Iceberg
    # v3 initial-default; null where none)

    def describe(self) -> str:
        what = "version" if self.format == "delta" else "snapshot"
        return f"{self.format} table {self.name} at {what} {self.version or '(none: empty table)'}, {len(self.files)} data files"

    @property
    def fingerprint(self) -> list:
        return [self.format, self.name, self.version]


@contextlib.contextmanager
def guarded(what: str, step: str):
    """Any exception the table libraries (deltalake, pyiceberg, a catalog) or pyarrow's filesystems raise
    inside, as one paragraph naming `what`, the step, the file or object it could not read and the
    cause: their errors are their own classes (TypeError from a metadata parser, OSError from a bucket's
    region lookup, FileNotFoundError for a manifest list), never a traceback for the user."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as e:  # noqa: BLE001 - the libraries' own errors, as one paragraph
        raise DataError(cannot_read(what, step, e)) from None


def cannot_read(what: str, step: str, e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= 400 else text[:400] + " ..."
    obj = getattr(e, "filename", None)
    said = f" '{obj}'" if obj and str(obj) not in text else ""
    if isinstance(e, FileNotFoundError) or "No such file" in text or "Failed to open local file" in text:
        fix = ("A file its metadata names is missing (removed by hand or by an expire/vacuum, copied without it, or "
               "recorded relative to another folder than this one): restore it, run from the folder its locations are "
               "relative to, or pin a version whose files exist (data.version)")
    elif isinstance(e, OSError):
        fix = ("The storage it names could not be reached or read: check that the bucket or host exists and is "
               "reachable from here, and the credentials and endpoint (AWS_* variables, AWS_ENDPOINT_URL)")
    else:
        fix = ("Its metadata is not what the format's library can parse (it cannot read this table either): check it "
               "with the format's own tools, repair or rewrite the table, or export it to Parquet")
    return f"cannot read {what} while {step}: {type(e).__name__}{said}: {text}. {fix}"


def needs(package: str, extra: str, what: str) -> DataError:
    return DataError(f"{what}; reading it needs the {package} package, which is not installed: "
                     f"pip install 'parquet-ray-pipeline[{extra}]' (or pip install {package})")


def timestamp(version: str) -> dt.datetime | None:
    try:
        t = dt.datetime.fromisoformat(version)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def bad_version(uri: str, version: str, what: str) -> DataError:
    return DataError(f"data.version = {version!r} is not {what} of the table '{uri}'; give a version that exists, an "
                     f"ISO timestamp (2026-01-31T12:00:00), or \"\" for the latest")


def s3_options(uri: str) -> dict[str, str]:
    """deltalake's storage options for the S3 endpoint storage.py uses (deltalake reads the AWS_*
    credentials itself)."""
    endpoint = storage._s3_endpoint()
    if not uri.startswith("s3://") or not endpoint:
        return {}
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": str(endpoint.startswith("http://")).lower()}


def plain(schema: pa.Schema) -> pa.Schema:
    """The table's schema without the format's field metadata (physical names, ids): names and types."""
    return pa.schema([f.remove_metadata() for f in schema])


def deleted_positions(keep: np.ndarray) -> bytes:
    return np.flatnonzero(~keep).astype(np.int64).tobytes()


def package_version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def file_columns(snap: Snapshot, schema: pa.Schema) -> tuple[tuple[str, str], ...]:
    """(name in the file, the table's column) for every column of a data file that is a column of the
    table now. By field id where the table knows its columns by id and the file carries them (a column
    renamed after the file was written keeps its id; a column dropped and added again gets a new one),
    else by the table's physical names or name mapping, else by name. A table column that no pair names
    is not in the file (added after it was written): it reads as null."""
    names = set(snap.schema.names) if snap.schema is not None else set()
    by_id = dict(snap.ids)
    if by_id and all(_FIELD_ID in (f.metadata or {}) for f in schema):
        pairs = ((f.name, by_id.get(int(f.metadata[_FIELD_ID]))) for f in schema)
    elif snap.format == "iceberg" and not snap.physical:
        raise DataError("the file has no Parquet field ids and the Iceberg table has no name mapping "
                        "(schema.name-mapping.default), so which column is which cannot be known (pyiceberg refuses "
                        "it too). Set the table's name mapping (pyiceberg: table.update_schema()... or "
                        "create_mapping_from_schema; Spark: CALL system.add_files sets it), or rewrite the file")
    else:
        physical = dict(snap.physical) if snap.physical else {n: n for n in names}
        pairs = ((f.name, physical.get(f.name)) for f in schema)
    return tuple((a, b) for a, b in pairs if b is not None and b in names)
