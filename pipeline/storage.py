"""Locations are URIs on any pyarrow filesystem: local paths, s3:// (AWS_* variables, including
AWS_ENDPOINT_URL for S3-compatible stores), gs://. Everything that reads or writes goes through here."""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow.fs as pafs


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a URI or a local path (relative paths become absolute)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


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
