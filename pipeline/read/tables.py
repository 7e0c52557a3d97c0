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
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from .. import storage
from ..errors import DataError, PipelineError

_LEVELS_UP = 6  # how far above data.path a table root is looked for (a partition folder sits a few down)

# Delta reader features whose meaning this reader keeps: deltalake lists the files, partition values and
# deletion vectors, and the table's schema names and types the columns (column mapping, type widening). A
# variant column is a struct of binaries: never a feature, refused by name where the config lists it.
_DELTA_READER_FEATURES = {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "typeWidening", "typeWidening-preview",
                          "variantType", "variantType-preview", "deletionVectors", "columnMapping"}
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
            return _delta(uri, version)
        return _iceberg(uri, version, catalog)


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
    schema = pa.schema(table.schema().to_arrow())
    config = table.metadata().configuration or {}
    mode = config.get("delta.columnMapping.mode", "none")
    physical, ids = (), ()
    if mode != "none":  # the files name columns by physical names (and ids in id mode), never by the table's
        meta = [(f.name, f.metadata or {}) for f in schema]
        physical = tuple((m[b"delta.columnMapping.physicalName"].decode(), n) for n, m in meta
                         if b"delta.columnMapping.physicalName" in m)
        if mode == "id":
            ids = tuple((int(m[b"delta.columnMapping.id"]), n) for n, m in meta if b"delta.columnMapping.id" in m)
    deleted = _delta_deletion_vectors(uri, table) if "deletionVectors" in set(table.protocol().reader_features or ()) \
        else {}
    adds = pa.table(table.get_add_actions(flatten=True))
    cols = adds.column_names
    part_cols = [c for c in cols if c.startswith("partition.")]
    files = []
    for row in adds.select(["path", "num_records", *part_cols]).to_pylist():
        rel = row["path"]
        path = storage.filesystem(rel)[1] if "://" in rel else f"{root}/{unquote(rel)}"
        part = tuple((c[len("partition."):], row[c]) for c in part_cols)
        files.append(TableFile(path, row["num_records"], part, deleted.get(path, b"")))
    files.sort(key=lambda f: f.path)
    stray = sorted(set(deleted) - {f.path for f in files})
    if stray:  # a deletion vector applied to no file would bring its deleted rows back, silently
        raise DataError(f"the Delta table '{uri}' (version {table.version()}) has a deletion vector for '{stray[0]}', "
                        f"which is not among the data files deltalake lists ({len(files)} files, e.g. "
                        f"'{files[0].path if files else ''}'); the deleted rows cannot be matched to a file. Report it "
                        f"with the table's _delta_log, or purge the deletion vectors (Spark: REORG TABLE ... APPLY "
                        f"(PURGE))")
    return Snapshot("delta", uri, location, str(table.version()), tuple(files), _plain(schema), ids, physical)


def _plain(schema: pa.Schema) -> pa.Schema:
    """The table's schema without the format's field metadata (physical names, ids): names and types."""
    return pa.schema([f.remove_metadata() for f in schema])


def _positions(keep: np.ndarray) -> bytes:
    return np.flatnonzero(~keep).astype(np.int64).tobytes()


def _delta_deletion_vectors(uri: str, table) -> dict[str, bytes]:
    """The deleted positions of every data file that has a deletion vector, by path, from deltalake's
    own reading of them (a keep-mask per file)."""
    try:
        reader = pa.RecordBatchReader.from_stream(table.deletion_vectors())
        out = {}
        for b in reader:
            lists = b.column("selection_vector")
            flat = lists.flatten().to_numpy(zero_copy_only=False)
            offsets = lists.offsets.to_numpy()
            for i, f in enumerate(b.column("filepath").to_pylist()):
                path = storage.filesystem(f)[1]
                out[unquote(path) if f.startswith("file:") else path] = _positions(flat[offsets[i]:offsets[i + 1]])
        return out
    except Exception as e:  # noqa: BLE001 - deltalake's own error, said as one paragraph
        raise DataError(f"the Delta table '{uri}' (version {table.version()}) has deletion vectors that deltalake "
                        f"cannot read ({type(e).__name__}: {e}); reading its files without them would bring deleted "
                        f"rows back. Check that the table's deletion vector files are readable, or purge them "
                        f"(Spark: REORG TABLE ... APPLY (PURGE))") from None


def _delta_unsupported(table) -> str | None:
    """Why the files, deletion vectors and schema deltalake hands over are not the table's rows; None
    when they are."""
    features = set(table.protocol().reader_features or ())
    unknown = sorted(features - _DELTA_READER_FEATURES)
    if unknown:
        return (f"uses the reader feature(s) {', '.join(unknown)}, which this pipeline does not apply; reading its "
                f"files without them could give rows or values the table does not have. Rewrite the table without "
                f"them, or export its current version to Parquet")
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
    best, unnumbered = None, []
    for info in fs.get_file_info(pafs.FileSelector(f"{path}/metadata")):
        m = re.match(r"^v?(\d+)[-.].*metadata\.json$", info.base_name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), info.path)
        elif not m and info.base_name.endswith(".metadata.json") and not info.base_name.startswith("."):
            unnumbered.append(info.path)
    if best is None and len(unnumbered) == 1:  # one metadata file, named by hand (vfinal.metadata.json): that one
        return unnumbered[0]
    if best is None:
        which = f" (it holds {', '.join(sorted(p.rsplit('/', 1)[1] for p in unnumbered))}, none numbered)" \
            if unnumbered else ""
        raise DataError(f"'{path}/metadata' holds no versioned Iceberg metadata file (vN.metadata.json or "
                        f"NNNNN-<uuid>.metadata.json){which}, so which is current cannot be known; write its version "
                        f"into metadata/version-hint.text, or read it through its catalog (data.catalog)")
    return best[1]


def _iceberg_properties() -> dict[str, str]:
    endpoint = storage._s3_endpoint()
    return {"s3.endpoint": endpoint} if endpoint else {}


def _iceberg(uri: str, version: str, catalog: str) -> Snapshot:
    what = f"'{uri}' is an Iceberg table" + (f" in catalog '{catalog}'" if catalog else " (it has metadata/*.metadata.json)")
    try:
        from pyiceberg.manifest import FileFormat
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
    if "://" not in location:  # a local path (some writers record it relative to where they ran)
        location = f"file://{storage.filesystem(location)[1]}"
    if snap is None:  # a table created and never written
        return Snapshot("iceberg", uri, location, "", ())
    # The schema a scan reads with, as pyiceberg's: the table's current schema for its current state (a column
    # renamed, dropped or added since the last write counts), the snapshot's own for a pinned version. Its field
    # ids alone say which column of a file is which: a column dropped and added again under its old name has a
    # new id that no older file holds, so it reads as null there, never as the dropped column's values.
    schema = table.schema()
    if version and snap.schema_id is not None:
        schema = table.schemas().get(snap.schema_id, schema)
    files, deletes = [], _IcebergDeletes(uri, snap.snapshot_id, table.io)
    specs = table.specs()
    for task in _plan_files(uri, table, snap.snapshot_id):
        f = task.file
        if f.file_format != FileFormat.PARQUET:
            raise DataError(f"the Iceberg table '{uri}' has a {f.file_format.name} data file ({f.file_path}); this "
                            f"pipeline reads Parquet data files only. Rewrite the table's files as Parquet")
        path = storage.filesystem(f.file_path)[1]
        files.append(TableFile(path, f.record_count, _iceberg_partition(schema, specs.get(f.spec_id), f.partition),
                               deletes.of(f.file_path, task.delete_files)))
    files.sort(key=lambda t: t.path)
    arrow = _plain(schema.as_arrow())
    ids = tuple((f.field_id, f.name) for f in schema.fields)
    mapping = table.metadata.name_mapping()  # schema.name-mapping.default: for files written without ids
    physical = ()
    if mapping is not None:
        now = dict(ids)
        physical = tuple((name, now[m.field_id]) for m in mapping for name in m.names if m.field_id in now)
    defaults = tuple((f.name, f.initial_default) for f in schema.fields if getattr(f, "initial_default", None) is not None)
    return Snapshot("iceberg", uri, location, str(snap.snapshot_id), tuple(files), arrow, ids, physical, defaults)


def _plan_files(uri: str, table, snapshot_id: int) -> list:
    """pyiceberg's scan plan: each data file with the delete files that apply to it."""
    try:
        return list(table.scan(snapshot_id=snapshot_id).plan_files())
    except ValueError as e:
        if "equality" not in str(e).lower():
            raise
        raise DataError(_EQUALITY.format(uri=uri, snapshot=snapshot_id, which="") + f" (pyiceberg: {e})") from None


_EQUALITY = ("the Iceberg table '{uri}' (snapshot {snapshot}) has equality delete files{which} (merge-on-read deletes "
             "by value, as Flink and some Spark jobs write them), which neither this pipeline nor pyiceberg applies: "
             "reading the data files without them would bring deleted rows back. Rewrite the affected files "
             "(Spark: CALL system.rewrite_data_files, or rewrite_position_delete_files), or delete with "
             "copy-on-write, then read it again")


class _IcebergDeletes:
    """Merge-on-read deletes of one snapshot: each position delete file (Parquet, or a v3 deletion vector
    in a Puffin file) read once, through pyiceberg's own reader, and kept by the data file it names.
    Equality deletes are refused: they delete by value, and the values are not applied here."""

    def __init__(self, uri: str, snapshot_id: int, io):
        self.uri, self.snapshot_id, self.io = uri, snapshot_id, io
        self.read: dict[str, dict[str, pa.ChunkedArray]] = {}

    def of(self, data_file: str, delete_files) -> bytes:
        if not delete_files:
            return b""
        from pyiceberg.manifest import DataFileContent

        equality = [d.file_path for d in delete_files if d.content == DataFileContent.EQUALITY_DELETES]
        if equality:
            raise DataError(_EQUALITY.format(uri=self.uri, snapshot=self.snapshot_id,
                                             which=f" (e.g. {equality[0]}, on {data_file})"))
        chunks = []
        for d in delete_files:
            if d.file_path not in self.read:
                self.read[d.file_path] = self._read(d)
            if data_file in self.read[d.file_path]:
                chunks.append(self.read[d.file_path][data_file])
        if not chunks:
            return b""
        pos = np.unique(np.concatenate([c.to_numpy() for c in chunks]).astype(np.int64))
        return pos.tobytes()

    def _read(self, delete_file) -> dict[str, pa.ChunkedArray]:
        try:
            from pyiceberg.io.pyarrow import _read_deletes  # pyiceberg's own reader of position deletes and DVs

            return _read_deletes(self.io, delete_file)
        except Exception as e:  # noqa: BLE001 - pyiceberg's errors, as one paragraph
            raise DataError(f"the Iceberg table '{self.uri}' (snapshot {self.snapshot_id}) has a delete file that "
                            f"cannot be read ({delete_file.file_path}: {type(e).__name__}: {e}); reading the data "
                            f"files without it would bring deleted rows back. Check that the file is readable "
                            f"(pyiceberg {_version('pyiceberg')} reads Parquet position deletes and Puffin deletion "
                            f"vectors)") from None


def _version(package: str) -> str:
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


def _iceberg_partition(schema, spec, record) -> tuple[tuple[str, Any], ...]:
    """Identity partition values, by their source column's name, typed as the table's schema says (a
    file imported with add_files may lack the column; a transformed partition, such as day(ts) or
    bucket(16, id), is derived from a column the file holds)."""
    if spec is None or record is None:
        return ()
    from pyiceberg.transforms import IdentityTransform

    out = []
    names = {f.field_id: f.name for f in schema.fields}
    for i, field in enumerate(spec.fields):
        if isinstance(field.transform, IdentityTransform) and field.source_id in names:  # a dropped column: not read
            out.append((names[field.source_id], record[i]))
    return tuple(out)
