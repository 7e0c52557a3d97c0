"""Iceberg merge-on-read deletes written the way Spark, Trino and Flink write them, for the tests and the
deletes benchmark (pyiceberg writes no delete files: it deletes copy-on-write)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_delete_snapshot(table, deletes: dict[str, list[int]], *, puffin: bool) -> str:
    """Commit deletes ({data file path: positions}) as a new snapshot, the way Spark, Trino and Flink do under
    write.delete.mode = merge-on-read: one Parquet position delete file (format v2), or one deletion vector
    per data file in a Puffin file (v3). pyiceberg writes neither, so the manifest, manifest list and
    metadata are written here with its lower-level API, as duckdb-iceberg's fixture script does. Returns
    the new metadata file."""
    from pyiceberg.avro.file import AvroOutputFile
    from pyiceberg.manifest import (DataFile, DataFileContent, FileFormat, ManifestContent, ManifestEntry,
                                    ManifestEntryStatus, ManifestListWriter, ManifestListWriterV2, ManifestWriterV2)
    from pyiceberg.partitioning import PartitionSpec
    from pyiceberg.typedef import Record

    version = 3 if puffin else 2
    base = table.current_snapshot()
    root = Path(table.location().removeprefix("file://"))
    snapshot_id, seq = base.snapshot_id + 1, base.sequence_number + 1
    if puffin:
        from pyroaring import BitMap

        blobs, meta, at = [], [], 4
        for data_file, positions in deletes.items():
            body = b"\xD1\xD3\x39\x64" + struct.pack("<q", 1) + struct.pack("<i", 0) + BitMap(positions).serialize()
            blobs.append(struct.pack(">I", len(body)) + body + struct.pack(">I", zlib.crc32(body)))
            meta.append({"type": "deletion-vector-v1", "fields": [2147483645], "snapshot-id": snapshot_id,
                         "sequence-number": seq, "offset": at, "length": len(blobs[-1]),
                         "properties": {"referenced-data-file": data_file, "cardinality": str(len(positions))}})
            at += len(blobs[-1])
        footer = json.dumps({"blobs": meta}).encode()
        payload = b"PFA1" + b"".join(blobs) + b"PFA1" + footer + struct.pack("<i", len(footer)) + b"\0\0\0\0" + b"PFA1"
        path = root / "data" / "deletes.puffin"
        path.write_bytes(payload)
        files = [(len(p), FileFormat.PUFFIN, len(payload), dict(referenced_data_file=f, content_offset=m["offset"],
                                                                 content_size_in_bytes=m["length"]))
                 for (f, p), m in zip(deletes.items(), meta)]
    else:
        path = root / "data" / "position-deletes.parquet"
        schema = pa.schema([pa.field("file_path", pa.string(), False, {b"PARQUET:field_id": b"2147483546"}),
                            pa.field("pos", pa.int64(), False, {b"PARQUET:field_id": b"2147483545"})])
        paths = [f for f, p in sorted(deletes.items()) for _ in p]
        pos = [q for _, p in sorted(deletes.items()) for q in sorted(p)]
        pq.write_table(pa.table({"file_path": paths, "pos": pos}, schema), str(path))
        files = [(len(pos), FileFormat.PARQUET, path.stat().st_size, {})]

    class DeleteManifestWriter(ManifestWriterV2):
        @property
        def version(self):
            return version

        def content(self):
            return ManifestContent.DELETES

        @property
        def _meta(self):
            return {**super()._meta, "content": "deletes"}

        def new_writer(self):
            s = self._with_partition(self.version)
            return AvroOutputFile(output_file=self._output_file, file_schema=s, record_schema=s,
                                  schema_name="manifest_entry", metadata=self._meta)

    manifest_path = root / "metadata" / f"deletes-{snapshot_id}-m0.avro"
    with DeleteManifestWriter(spec=PartitionSpec(spec_id=0), schema=table.schema(),
                              output_file=table.io.new_output(str(manifest_path)), snapshot_id=snapshot_id,
                              avro_compression="gzip") as writer:
        for count, fmt, size, extra in files:
            writer.add_entry(ManifestEntry.from_args(
                status=ManifestEntryStatus.ADDED, snapshot_id=snapshot_id, sequence_number=seq, file_sequence_number=seq,
                data_file=DataFile.from_args(_table_format_version=version, content=DataFileContent.POSITION_DELETES,
                                             file_path=str(path), file_format=fmt, partition=Record(), record_count=count,
                                             file_size_in_bytes=size, spec_id=0, **extra)))

    class ListWriter(ManifestListWriterV2):
        def __init__(self, output_file):
            ManifestListWriter.__init__(self, format_version=version, output_file=output_file, meta={
                "snapshot-id": str(snapshot_id), "parent-snapshot-id": str(base.snapshot_id),
                "sequence-number": str(seq), "format-version": str(version), "avro.codec": "gzip"})
            self._commit_snapshot_id, self._sequence_number = snapshot_id, seq

    list_path = root / "metadata" / f"snap-{snapshot_id}.avro"
    with ListWriter(table.io.new_output(str(list_path))) as w:
        w.add_manifests([*base.manifests(io=table.io), writer.to_manifest_file()])
    meta = json.loads(Path(table.metadata_location.removeprefix("file://")).read_text())
    when = base.timestamp_ms + 1
    meta.update({"format-version": version, "current-snapshot-id": snapshot_id, "last-sequence-number": seq,
                 "last-updated-ms": when, "refs": {"main": {"snapshot-id": snapshot_id, "type": "branch"}}})
    if puffin:
        meta["next-row-id"] = sum(f.record_count for f in table.scan().plan_files() for f in [f.file])
    meta["snapshots"].append({"sequence-number": seq, "snapshot-id": snapshot_id, "parent-snapshot-id": base.snapshot_id,
                              "timestamp-ms": when, "manifest-list": str(list_path), "schema-id": table.schema().schema_id,
                              "summary": {"operation": "delete", "added-delete-files": "1"}})
    meta["snapshot-log"].append({"snapshot-id": snapshot_id, "timestamp-ms": when})
    out = root / "metadata" / "99999-deletes.metadata.json"
    out.write_text(json.dumps(meta))
    return str(out)
