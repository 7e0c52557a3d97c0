"""Shard discovery and footer checks, before any heavy work.

The unit of distributed work is a `Fragment`: one row group of one file, with its global row offset.
Knowing every row's global id up front (from the footers alone) is what makes row accounting exact
and the split across ranks a pure function of the data layout.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from . import storage
from .config import Config
from .errors import DataError

_SKIP_PREFIXES = ("_", ".")  # _SUCCESS, _metadata, _common_metadata, .crc files, hidden files


@dataclass(frozen=True)
class Fragment:
    """One row group of one Parquet file, and where its rows start in the global row order."""

    path: str
    row_group: int
    row_start: int
    num_rows: int


@dataclass(frozen=True)
class Shard:
    path: str
    num_rows: int
    row_group_rows: tuple[int, ...]
    size_bytes: int
    schema: pa.Schema


@dataclass(frozen=True)
class Source:
    """What validation found: the shards (in a fixed order) and the fragments to read."""

    uri: str
    shards: tuple[Shard, ...]
    fragments: tuple[Fragment, ...]

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.shards)


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
             and not p.endswith(".tmp")]
    if not paths:
        raise DataError(f"no Parquet files under '{uri}'; point data.path at a directory holding *.parquet shards")
    return paths


def _footer(fs, path: str) -> Shard:
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            md = pq.ParquetFile(f).metadata
            schema = md.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read the Parquet footer of '{path}': {e}; the file is damaged or not Parquet, "
                        f"rewrite it or remove it from data.path") from None
    groups = tuple(md.row_group(g).num_rows for g in range(md.num_row_groups))
    return Shard(path, md.num_rows, groups, size, schema)


def _check_columns(shard: Shard, cfg: Config) -> None:
    names = set(shard.schema.names)
    d = cfg.data
    for col, kind in [*((c, "numeric") for c in d.numeric), *((c, "categorical") for c in d.categorical),
                      (d.label, "label")]:
        if col not in names:
            raise DataError(f"column '{col}' (data.{kind if kind != 'label' else 'label'}) is missing from "
                            f"'{shard.path}', which has: {', '.join(shard.schema.names)}; fix data.{kind} or the file")
        t = shard.schema.field(col).type
        if kind in ("numeric", "label") and not (pa.types.is_integer(t) or pa.types.is_floating(t)
                                                  or pa.types.is_boolean(t) or pa.types.is_decimal(t)):
            fix = "cast it upstream or list it under data.categorical" if kind == "numeric" else "cast it to int or bool upstream"
            raise DataError(f"column '{col}' in '{shard.path}' is {t}, config says {kind} (a number); {fix}")


def inspect(cfg: Config, uri: str | None = None) -> Source:
    """List shards, read every footer in parallel and check each file's columns against the config."""
    uri = uri or cfg.data.path
    paths = list_shards(uri)
    fs, _ = storage.filesystem(uri)
    with ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
        shards = list(pool.map(lambda p: _footer(fs, p), paths))
    for s in shards:
        _check_columns(s, cfg)
    fragments = []
    offset = 0
    for s in shards:
        for g, n in enumerate(s.row_group_rows):
            if n:
                fragments.append(Fragment(s.path, g, offset, n))
            offset += n
    return Source(uri, tuple(shards), tuple(fragments))


def read_fragment(uri: str, frag: Fragment, columns: list[str]) -> pa.Table:
    """Read one row group, only the named columns (column pushdown)."""
    fs, _ = storage.filesystem(uri)
    with fs.open_input_file(frag.path) as f:
        return pq.ParquetFile(f).read_row_group(frag.row_group, columns=columns)
