"""An Iceberg table through pyiceberg (a catalog, or a metadata file): one snapshot's data files, its
position deletes and deletion vectors, its schema with field ids or the name mapping, and partition
values typed by the schema; equality deletes refused by name.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from .. import storage
from ..errors import DataError
from .snapshot import Snapshot, TableFile, bad_version, needs, package_version, plain, timestamp


def metadata_file(fs: pafs.FileSystem, path: str) -> str:
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


def properties() -> dict[str, str]:
    endpoint = storage._s3_endpoint()
    return {"s3.endpoint": endpoint} if endpoint else {}


def snapshot(uri: str, version: str, catalog: str) -> Snapshot:
    what = f"'{uri}' is an Iceberg table" + (f" in catalog '{catalog}'" if catalog else " (it has metadata/*.metadata.json)")
    try:
        from pyiceberg.manifest import FileFormat
    except ImportError:
        raise needs("pyiceberg", "iceberg", what) from None
    try:
        if catalog:
            from pyiceberg.catalog import load_catalog

            table = load_catalog(catalog).load_table(uri)
        else:
            from pyiceberg.table import StaticTable

            fs, path = storage.filesystem(uri)
            meta = storage.to_uri(fs, metadata_file(fs, path))
            table = StaticTable.from_metadata(meta if "://" in meta else f"file://{meta}", properties())
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
        elif (when := timestamp(version)) is not None:
            snap = table.snapshot_as_of_timestamp(int(when.timestamp() * 1000))
        if snap is None:
            raise bad_version(uri, version, "a snapshot id or a time with a snapshot")
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
    files, deletes = [], Deletes(uri, snap.snapshot_id, table.io)
    specs = table.specs()
    for task in _plan_files(uri, table, snap.snapshot_id):
        f = task.file
        if f.file_format != FileFormat.PARQUET:
            raise DataError(f"the Iceberg table '{uri}' has a {f.file_format.name} data file ({f.file_path}); this "
                            f"pipeline reads Parquet data files only. Rewrite the table's files as Parquet")
        path = storage.filesystem(f.file_path)[1]
        files.append(TableFile(path, f.record_count, partition_values(schema, specs.get(f.spec_id), f.partition),
                               deletes.of(f.file_path, task.delete_files)))
    files.sort(key=lambda t: t.path)
    arrow = plain(schema.as_arrow())
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


class Deletes:
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
            from pyiceberg.io.pyarrow import (
                _read_deletes,  # pyiceberg's own reader of position deletes and DVs
            )

            return _read_deletes(self.io, delete_file)
        except Exception as e:  # noqa: BLE001 - pyiceberg's errors, as one paragraph
            raise DataError(f"the Iceberg table '{self.uri}' (snapshot {self.snapshot_id}) has a delete file that "
                            f"cannot be read ({delete_file.file_path}: {type(e).__name__}: {e}); reading the data "
                            f"files without it would bring deleted rows back. Check that the file is readable "
                            f"(pyiceberg {package_version('pyiceberg')} reads Parquet position deletes and Puffin deletion "
                            f"vectors)") from None


def partition_values(schema, spec, record) -> tuple[tuple[str, Any], ...]:
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
