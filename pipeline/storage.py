"""Locations are URIs on any pyarrow filesystem: local paths, s3://, gs://. Everything that reads or
writes goes through here.

s3:// takes its settings from the standard AWS variables: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN (or an instance role), AWS_REGION / AWS_DEFAULT_REGION, and for S3-compatible stores
(MinIO, Ceph, moto) AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, plus AWS_S3_ADDRESSING_STYLE=virtual if the
store wants virtual-hosted buckets. gs:// uses Google's default credentials. A URI's own query
(s3://bucket/x?endpoint_override=...&scheme=http) wins over the environment.

Paths inside a filesystem are pyarrow's: 'bucket/key' for object stores, absolute paths locally. On a
cluster the variables must be set on every node (for `ray job submit`: env_vars in the runtime env),
because Ray Data tasks and Ray Train workers open the same URIs.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from typing import Any

import pyarrow.fs as pafs


def _s3_endpoint() -> str | None:
    """The S3 endpoint named by the environment (service-specific variable first, as the AWS SDKs do)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a URI or a local path (relative paths become absolute)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        # file://data/t/x.parquet: a path relative to the writer's folder (duckdb, some Iceberg writers record
        # them so). pyiceberg reads it as data/t/x.parquet from the current folder; so does this, made absolute
        # here, where it is planned, so that workers started elsewhere read the same file.
        return pafs.LocalFileSystem(), os.path.abspath(urllib.parse.unquote(parts.netloc + parts.path))
    endpoint = _s3_endpoint()
    if parts.scheme == "s3" and endpoint and not parts.query:
        # Recent pyarrow reads AWS_ENDPOINT_URL(_S3) itself, but not every version does, and none reads
        # AWS_S3_ADDRESSING_STYLE: build the filesystem from the environment explicitly. No bucket-region
        # lookup either (S3-compatible stores have no regions to look up).
        virtual = os.environ.get("AWS_S3_ADDRESSING_STYLE", "").lower() == "virtual"
        fs = pafs.S3FileSystem(endpoint_override=endpoint, force_virtual_addressing=virtual)
        path = urllib.parse.unquote(parts.netloc + parts.path)
        return fs, path.rstrip("/")
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def to_uri(fs: pafs.FileSystem, path: str) -> str:
    """The inverse of filesystem(): a path inside `fs` (e.g. a Ray Train checkpoint path) as a URI."""
    if isinstance(fs, pafs.LocalFileSystem) or "://" in path:
        return path
    scheme = {"s3": "s3", "gcs": "gs"}.get(fs.type_name, fs.type_name)
    return f"{scheme}://{path.lstrip('/')}"


def ray_storage(uri: str) -> tuple[str, pafs.FileSystem | None]:
    """(storage_path, storage_filesystem) for ray.train.RunConfig.

    Local: an absolute path and None. Remote: the bucket-relative path and the filesystem built by
    filesystem(), so Ray Train's controller and workers write exactly where this module reads (same
    endpoint, addressing style and credentials; the filesystem is pickled to them) instead of resolving
    the URI again by themselves.
    """
    fs, path = filesystem(uri)
    return (path, None) if isinstance(fs, pafs.LocalFileSystem) else (path, fs)


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def list_files(fs: pafs.FileSystem, root: str) -> list[str]:
    """Every file under root, recursively, sorted (so discovery order is reproducible)."""
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File)


def write_text(uri: str, text: str) -> None:
    fs, path = filesystem(uri)
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(text.encode())


def read_text(uri: str) -> str:
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(uri: str) -> Any:
    return json.loads(read_text(uri))


def open_arrow_file(uri: str):
    """An Arrow IPC file's reader: memory-mapped when local (the pages are shared by every process of the
    machine that reads it), read whole otherwise. Raises OSError or pyarrow.ArrowInvalid."""
    import pyarrow as pa

    fs, path = filesystem(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        return pa.ipc.open_file(pa.memory_map(path))
    with fs.open_input_file(path) as f:
        return pa.ipc.open_file(pa.py_buffer(f.read()))
