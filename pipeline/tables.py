"""Lakehouse tables: a Delta Lake or Iceberg table is read as the table says, never as a folder.

A table's folder keeps the Parquet files of earlier versions beside the current ones (overwritten,
deleted and compacted rows stay on disk until a vacuum), so listing the folder trains on rows the table
no longer holds. Here the format's own library (deltalake, pyiceberg) names the files of one version of
the table, with their row counts and partition values; source.inspect reads exactly those files, and
the plan carries them, so every rank reads that one version however the table moves on during the run.

What the project does not apply (deletion vectors, Iceberg delete files, Delta column mapping, data
files that are not Parquet, a reader feature it does not know) is refused in one paragraph naming it:
reading the files without it would bring deleted rows back or misname columns, silently.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs

from . import storage
from .errors import DataError

_LEVELS_UP = 6  # how far above data.path a table root is looked for (a partition folder sits a few down)

# Delta reader features whose meaning this reader keeps: the files and partition values deltalake hands
# over are the whole story (a variant column is a struct of binaries: never a feature, refused by name
# where the config lists it). deletionVectors and columnMapping are checked table by table below.
_DELTA_READER_FEATURES = {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "typeWidening", "variantType",
                          "deletionVectors", "columnMapping"}


@dataclass(frozen=True)
class TableFile:
    path: str  # inside the table's filesystem (storage.filesystem(Snapshot.root)[0])
    rows: int | None  # the row count the table records for the file (None where it records none)
    partition: tuple[tuple[str, str | None], ...] = ()  # from the table's metadata, values as text


@dataclass(frozen=True)
class Snapshot:
    """One version of a table: the data files that make it up, and which version that is."""

    format: str  # "delta" or "iceberg"
    name: str  # the table root, or catalog.identifier
    root: str  # URI of the table's location: its files live on that filesystem
    version: str  # Delta version number, Iceberg snapshot id ("" for an Iceberg table with no snapshot)
    files: tuple[TableFile, ...]
    field_names: tuple[tuple[int, str], ...] = ()  # Iceberg: field id -> the column's name now (renames)

    def describe(self) -> str:
        what = "version" if self.format == "delta" else "snapshot"
        return f"{self.format} table {self.name} at {what} {self.version or '(none: empty table)'}, {len(self.files)} data files"

    @property
    def fingerprint(self) -> list:
        return [self.format, self.name, self.version]


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
        fmt = table_format(fs, above)
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
    if fmt == "delta":
        return _delta(uri, version)
    return _iceberg(uri, version, catalog)


def _needs(package: str, extra: str, what: str) -> DataError:
    return DataError(f"{what}; reading it needs the {package} package, which is not installed: "
                     f"pip install 'parquet-ray-pipeline[{extra}]' (or pip install {package})")


def _timestamp(version: str) -> dt.datetime | None:
    try:
        t = dt.datetime.fromisoformat(version)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def _bad_version(uri: str, version: str, what: str) -> DataError:
    return DataError(f"data.version = {version!r} is not {what} of the table '{uri}'; give a version that exists, an "
                     f"ISO timestamp (2026-01-31T12:00:00), or \"\" for the latest")


def _s3_options(uri: str) -> dict[str, str]:
    """deltalake's storage options for the S3 endpoint storage.py uses (deltalake reads the AWS_*
    credentials itself)."""
    endpoint = storage._s3_endpoint()
    if not uri.startswith("s3://") or not endpoint:
        return {}
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": str(endpoint.startswith("http://")).lower()}


def _delta(uri: str, version: str) -> Snapshot:
    try:
        from deltalake import DeltaTable
    except ImportError:
        raise _needs("deltalake", "delta", f"'{uri}' is a Delta Lake table (it has _delta_log/)") from None
    fs, root = storage.filesystem(uri)
    location = storage.to_uri(fs, root)
    try:
        if version and not version.lstrip("-").isdigit():
            when = _timestamp(version)
            if when is None:
                raise _bad_version(uri, version, "a version number or a timestamp")
            table = DeltaTable(location, storage_options=_s3_options(uri) or None)
            table.load_as_version(when)
        else:
            table = DeltaTable(location, version=int(version) if version else None,
                               storage_options=_s3_options(uri) or None)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - deltalake's errors are its own classes; one paragraph either way
        if version:
            raise _bad_version(uri, version, f"a version of ({type(e).__name__}: {e})") from None
        raise DataError(f"cannot read the Delta table '{uri}' ({type(e).__name__}: {e}); check data.path and that "
                        f"its _delta_log/ is readable") from None
    refuse = _delta_unsupported(table)
    if refuse:
        raise DataError(f"the Delta table '{uri}' (version {table.version()}) {refuse}")
    adds = pa.table(table.get_add_actions(flatten=True))
    cols = adds.column_names
    part_cols = [c for c in cols if c.startswith("partition.")]
    files = []
    for row in adds.select(["path", "num_records", *part_cols]).to_pylist():
        rel = row["path"]
        path = storage.filesystem(rel)[1] if "://" in rel else f"{root}/{unquote(rel)}"
        part = tuple((c[len("partition."):], None if row[c] is None else _text(row[c])) for c in part_cols)
        files.append(TableFile(path, row["num_records"], part))
    files.sort(key=lambda f: f.path)
    return Snapshot("delta", uri, location, str(table.version()), tuple(files))


def _text(v) -> str:
    return v.isoformat() if isinstance(v, (dt.date, dt.datetime)) else str(v)


def _delta_unsupported(table) -> str | None:
    """Why the files deltalake lists are not, by themselves, the table's rows; None when they are."""
    features = set(table.protocol().reader_features or ())
    unknown = sorted(features - _DELTA_READER_FEATURES)
    if unknown:
        return (f"uses the reader feature(s) {', '.join(unknown)}, which this pipeline does not apply; reading its "
                f"files without them could give rows or values the table does not have. Rewrite the table without "
                f"them, or export its current version to Parquet")
    mode = (table.metadata().configuration or {}).get("delta.columnMapping.mode", "none")
    if mode != "none":
        return (f"uses column mapping (delta.columnMapping.mode = '{mode}'): its Parquet files name columns by "
                f"physical names that differ from the table's. This pipeline reads files by column name and does "
                f"not apply the mapping; rewrite the table without column mapping, or export it to Parquet")
    if "deletionVectors" in features:
        try:
            deleted = sum(b.num_rows for b in pa.RecordBatchReader.from_stream(table.deletion_vectors()))
        except Exception as e:  # noqa: BLE001 - a deletion vector that cannot be read is refused the same way
            deleted, why = -1, f"{type(e).__name__}: {e}"
        if deleted:
            said = "files whose deletion vectors could not be read (" + why + ")" if deleted < 0 else \
                f"{deleted} data files with deletion vectors"
            return (f"has {said}: rows deleted by marking them, not by rewriting the file. This pipeline does not "
                    f"apply deletion vectors, and reading the files without them would bring the deleted rows "
                    f"back. Purge them (Spark: REORG TABLE ... APPLY (PURGE); or rewrite the table with "
                    f"delta.enableDeletionVectors = false), then read it again")
    return None


def _iceberg_metadata(fs: pafs.FileSystem, path: str) -> str:
    """The current metadata file of a table folder without a catalog: version-hint.text where the writer
    keeps one, else the metadata file with the highest version number (v12.metadata.json, 00012-<uuid>...)."""
    hint = f"{path}/metadata/version-hint.text"
    if storage.exists(fs, hint):
        with fs.open_input_stream(hint) as f:
            v = f.read().decode().strip()
        for name in (f"v{v}.metadata.json", f"{v}.metadata.json"):
            if storage.exists(fs, f"{path}/metadata/{name}"):
                return f"{path}/metadata/{name}"
    best = None
    for info in fs.get_file_info(pafs.FileSelector(f"{path}/metadata")):
        m = re.match(r"^v?(\d+)[-.].*metadata\.json$", info.base_name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), info.path)
    if best is None:
        raise DataError(f"'{path}/metadata' holds no versioned Iceberg metadata file (vN.metadata.json or "
                        f"NNNNN-<uuid>.metadata.json); point data.path at the table's root")
    return best[1]


def _iceberg_properties() -> dict[str, str]:
    endpoint = storage._s3_endpoint()
    return {"s3.endpoint": endpoint} if endpoint else {}


def _iceberg(uri: str, version: str, catalog: str) -> Snapshot:
    what = f"'{uri}' is an Iceberg table" + (f" in catalog '{catalog}'" if catalog else " (it has metadata/*.metadata.json)")
    try:
        from pyiceberg.manifest import DataFileContent, FileFormat
    except ImportError:
        raise _needs("pyiceberg", "iceberg", what) from None
    try:
        if catalog:
            from pyiceberg.catalog import load_catalog

            table = load_catalog(catalog).load_table(uri)
        else:
            from pyiceberg.table import StaticTable

            fs, path = storage.filesystem(uri)
            meta = storage.to_uri(fs, _iceberg_metadata(fs, path))
            table = StaticTable.from_metadata(meta if "://" in meta else f"file://{meta}", _iceberg_properties())
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyiceberg's and the catalog's own errors, as one paragraph
        how = (f"check the catalog's settings (~/.pyiceberg.yaml or PYICEBERG_CATALOG__{catalog.upper()}__* "
               f"variables) and the identifier" if catalog else "check data.path")
        raise DataError(f"cannot read the Iceberg table '{uri}' ({type(e).__name__}: {e}); {how}") from None
    snap = None
    if version:
        if version.lstrip("-").isdigit():
            snap = table.snapshot_by_id(int(version))
        elif (when := _timestamp(version)) is not None:
            snap = table.snapshot_as_of_timestamp(int(when.timestamp() * 1000))
        if snap is None:
            raise _bad_version(uri, version, "a snapshot id or a time with a snapshot")
    else:
        snap = table.current_snapshot()
    location = table.location()
    if "://" not in location:
        location = f"file://{location}"
    if snap is None:  # a table created and never written
        return Snapshot("iceberg", uri, location, "", ())
    files = []
    specs = table.specs()
    for task in table.scan(snapshot_id=snap.snapshot_id).plan_files():
        f = task.file
        if task.delete_files:
            kinds = sorted({"positional" if d.content == DataFileContent.POSITION_DELETES else "equality"
                            for d in task.delete_files})
            raise DataError(f"the Iceberg table '{uri}' (snapshot {snap.snapshot_id}) has {' and '.join(kinds)} delete "
                            f"files (merge-on-read deletes, e.g. on {f.file_path}), which this pipeline does not apply: "
                            f"reading the data files without them would bring deleted rows back. Rewrite the affected "
                            f"files (Spark: CALL system.rewrite_data_files or rewrite_position_delete_files with "
                            f"delete compaction), or delete with copy-on-write, then read it again")
        if f.file_format != FileFormat.PARQUET:
            raise DataError(f"the Iceberg table '{uri}' has a {f.file_format.name} data file ({f.file_path}); this "
                            f"pipeline reads Parquet data files only. Rewrite the table's files as Parquet")
        files.append(TableFile(storage.filesystem(f.file_path)[1], f.record_count,
                               _iceberg_partition(table, specs.get(f.spec_id), f.partition)))
    files.sort(key=lambda t: t.path)
    schema = table.schemas().get(snap.schema_id, table.schema()) if snap.schema_id is not None else table.schema()
    names = tuple((f.field_id, f.name) for f in schema.fields)
    return Snapshot("iceberg", uri, location, str(snap.snapshot_id), tuple(files), names)


def renamed(schema: pa.Schema, field_names: tuple[tuple[int, str], ...]) -> tuple[tuple[str, str], ...]:
    """(name in the file, name in the table) for each column an Iceberg table renamed after the file was
    written: Iceberg knows columns by field id (the Parquet field_id), not by name."""
    now = dict(field_names)
    out = []
    for f in schema:
        fid = (f.metadata or {}).get(b"PARQUET:field_id")
        if fid is not None and int(fid) in now and now[int(fid)] != f.name:
            out.append((f.name, now[int(fid)]))
    return tuple(out)


def _iceberg_partition(table, spec, record) -> tuple[tuple[str, str | None], ...]:
    """Identity partition values, by their source column's name (a transformed partition, such as
    day(ts) or bucket(16, id), is derived from a column the file holds)."""
    if spec is None or record is None:
        return ()
    from pyiceberg.transforms import IdentityTransform

    schema, out = table.schema(), []
    for i, field in enumerate(spec.fields):
        if isinstance(field.transform, IdentityTransform):
            v = record[i]
            out.append((schema.find_column_name(field.source_id), None if v is None else _text(v)))
    return tuple(out)

