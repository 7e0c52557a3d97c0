"""A Delta Lake table through deltalake: one version's files, partition values and deletion vectors,
its schema with column mapping; reader features it does not keep refused by name.
"""

from __future__ import annotations

from urllib.parse import unquote

import pyarrow as pa

from .. import storage
from ..errors import DataError
from .snapshot import Snapshot, TableFile, bad_version, deleted_positions, needs, plain, s3_options, timestamp

# Delta reader features whose meaning this reader keeps: deltalake lists the files, partition values and
# deletion vectors, and the table's schema names and types the columns (column mapping, type widening). A
# variant column is a struct of binaries: never a feature, refused by name where the config lists it.
READER_FEATURES = {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "typeWidening", "typeWidening-preview",
                   "variantType", "variantType-preview", "deletionVectors", "columnMapping"}


def snapshot(uri: str, version: str) -> Snapshot:
    try:
        from deltalake import DeltaTable
    except ImportError:
        raise needs("deltalake", "delta", f"'{uri}' is a Delta Lake table (it has _delta_log/)") from None
    fs, root = storage.filesystem(uri)
    location = storage.to_uri(fs, root)
    try:
        if version and not version.lstrip("-").isdigit():
            when = timestamp(version)
            if when is None:
                raise bad_version(uri, version, "a version number or a timestamp")
            table = DeltaTable(location, storage_options=s3_options(uri) or None)
            table.load_as_version(when)
        else:
            table = DeltaTable(location, version=int(version) if version else None,
                               storage_options=s3_options(uri) or None)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - deltalake's errors are its own classes; one paragraph either way
        if version:
            raise bad_version(uri, version, f"a version of ({type(e).__name__}: {e})") from None
        raise DataError(f"cannot read the Delta table '{uri}' ({type(e).__name__}: {e}); check data.path and that "
                        f"its _delta_log/ is readable") from None
    refuse = unsupported(table)
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
    deleted = _deletion_vectors(uri, table) if "deletionVectors" in set(table.protocol().reader_features or ()) \
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
    return Snapshot("delta", uri, location, str(table.version()), tuple(files), plain(schema), ids, physical)


def _deletion_vectors(uri: str, table) -> dict[str, bytes]:
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
                out[unquote(path) if f.startswith("file:") else path] = deleted_positions(flat[offsets[i]:offsets[i + 1]])
        return out
    except Exception as e:  # noqa: BLE001 - deltalake's own error, said as one paragraph
        raise DataError(f"the Delta table '{uri}' (version {table.version()}) has deletion vectors that deltalake "
                        f"cannot read ({type(e).__name__}: {e}); reading its files without them would bring deleted "
                        f"rows back. Check that the table's deletion vector files are readable, or purge them "
                        f"(Spark: REORG TABLE ... APPLY (PURGE))") from None


def unsupported(table) -> str | None:
    """Why the files, deletion vectors and schema deltalake hands over are not the table's rows; None
    when they are."""
    features = set(table.protocol().reader_features or ())
    unknown = sorted(features - READER_FEATURES)
    if unknown:
        return (f"uses the reader feature(s) {', '.join(unknown)}, which this pipeline does not apply; reading its "
                f"files without them could give rows or values the table does not have. Rewrite the table without "
                f"them, or export its current version to Parquet")
    return None
