"""The source: every shard listed, its footer read and checked against the config, before any heavy work.

`inspect` lists the shards (files.py), reads every footer in parallel and checks each file against the
config (schema.py): zero-byte files, wrong magic bytes, truncated or unreadable footers, missing columns,
wrong types and types that drift between shards. Bad files fail the run with one clear paragraph, or
(quality.on_bad_file = "quarantine") are set aside and accounted for.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .. import storage
from ..config import Config
from ..errors import DataError, NoUsableRows
from ..fit import transforms
from ..fit.columns import Columns, Target
from . import tables
from .files import BadFile, Fragment, Shard, _footer, list_shards
from .schema import _column_problem, _roles, _vector_dim, column_types, common_columns, infer_features


@dataclass(frozen=True)
class Source:
    """What validation found: the good shards (in a fixed order), the fragments to read, the bad files."""

    uri: str
    shards: tuple[Shard, ...]
    fragments: tuple[Fragment, ...]
    bad_files: tuple[BadFile, ...] = field(default_factory=tuple)
    columns: Columns = Columns()
    inferred: tuple[str, ...] | None = None  # features were inferred from the schema: the columns skipped
    table: tables.Snapshot | None = None  # a Delta or Iceberg table: the version whose files these are

    def conversions(self, stats: dict) -> list[str]:
        """How numbers float64 cannot hold exactly were turned into features, said once per column.
        stats: the fitted preprocessor's per-column statistics (their min and max)."""
        if not self.shards:
            return []
        schema, out = self.shards[0].schema, []
        for c, d in zip(self.columns.numeric, self.columns.dims):
            if d or c not in schema.names:
                continue
            t = schema.field(c).type
            t = t.value_type if pa.types.is_dictionary(t) else t
            s = stats.get("numeric", {}).get(c, {})
            big = max(abs(s.get("min") or 0), abs(s.get("max") or 0)) >= 2**53
            if pa.types.is_timestamp(t) or pa.types.is_duration(t):
                out.append(f"'{c}' ({t}) is its integer count of {t.unit} (since 1970 for a timestamp)")
            elif pa.types.is_date(t):
                out.append(f"'{c}' ({t}) is its count of {'days' if pa.types.is_date32(t) else 'ms'} since 1970")
            elif pa.types.is_decimal(t):
                out.append(f"'{c}' ({t}) is rounded to the nearest float64")
            elif pa.types.is_integer(t) and t.bit_width == 64 and big:
                out.append(f"'{c}' ({t}) holds integers beyond 2^53, rounded to the nearest float64 (a float32 "
                           f"feature keeps 24 bits of them in any case)")
        return out

    def describe_columns(self) -> str:
        """One line: which columns play which role (and, when inferred, which were skipped)."""
        c = self.columns
        dims = [f"{n}[{d}]" if d else n for n, d in zip(c.numeric, c.dims)]
        how = "inferred from the schema" if self.inferred is not None else "from the config"
        skipped = f"; skipped {', '.join(self.inferred)}" if self.inferred else ""
        return (f"features {how}: numeric {dims}, categorical {list(c.categorical)}{skipped}; targets "
                f"{[t.name for t in c.targets] or 'none'}" + (f"; weight '{c.weight}'" if c.weight else "")
                + (f"; passed through {list(c.passthrough)}" if c.passthrough else ""))

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def fingerprint(self) -> list:
        return [s.fingerprint for s in self.shards] + [[b.path, b.rows, b.reason] for b in self.bad_files]

    @property
    def where(self) -> str:
        """What was read, for the lines a job prints: the folder, or the table and its version."""
        return self.table.describe() if self.table else f"under {self.uri}"

    @property
    def quarantined_rows(self) -> int:
        return sum(b.rows or 0 for b in self.bad_files)


def inspect(cfg: Config, uri: str | None = None, table: tables.Snapshot | None = None,
            paths: list[str] | None = None) -> Source:
    """List shards, read every footer in parallel, check each file against the config. table / paths:
    read these files of the table (or of the folder) instead of the whole version (an increment,
    increments.py)."""
    uri = uri or cfg.data.path
    d = cfg.data
    fmt = None if table is not None or paths is not None else "iceberg" if d.catalog else tables.find(uri)
    table = table if table is not None else tables.snapshot(uri, fmt, d.version, d.catalog) if fmt else None
    if table is not None:
        listed = {f.path: f for f in table.files}
        paths = list(listed)
        if not paths:
            raise NoUsableRows(f"the {table.describe()}: it holds no rows. Write to the table, or pin a version that "
                               f"has rows (data.version)", "")
        uri = table.root
    else:
        if d.version and paths is None:
            raise DataError(f"data.version = {d.version!r} is set, but '{uri}' is a folder of Parquet files, not a Delta "
                            f"or Iceberg table, so it has no versions; leave data.version empty or point data.path at "
                            f"the table's root")
        listed, paths = {}, list_shards(uri) if paths is None else paths
    fs, root = storage.filesystem(uri)
    with ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
        found = list(pool.map(lambda p: _footer(fs, p, root, listed.get(p), table), paths))
    good = [s for s in found if isinstance(s, Shard)]
    bad = [b for b in found if isinstance(b, BadFile)]
    types = {s.path: column_types(s, cfg.preprocess.function) for s in good}
    inferred = not cfg.data.numeric and not cfg.data.categorical
    skipped: list[str] = []
    if inferred and good:
        common, partial = common_columns(types)
        numeric, categorical, skipped = infer_features(cfg, common)
        skipped += [p for p in partial if p.split(" (")[0] not in {*d.targets, d.weight, *d.exclude, *d.passthrough}]
    else:
        numeric, categorical = list(cfg.data.numeric), list(cfg.data.categorical)
    roles = _roles(cfg, (numeric, categorical))
    majority = {}
    for col, _ in roles:
        seen = Counter(t[col] for t in types.values() if col in t)
        majority[col] = seen.most_common(1)[0][0] if seen else "missing"
    shards = []
    for s in good:
        problem = _column_problem(s, cfg, roles, types[s.path], majority)
        if problem is None:
            shards.append(s)
        else:
            bad.append(BadFile(s.path, problem, s.rows))
    bad.sort(key=lambda b: b.path)
    if bad and cfg.quality.on_bad_file == "fail":
        first = bad[0]
        more = f" ({len(bad) - 1} more bad files are listed by `python -m pipeline validate`)" if len(bad) > 1 else ""
        raise DataError(f"'{first.path}': {first.reason}.{more} Rewrite or remove the file, or set "
                        f"quality.on_bad_file = \"quarantine\" to set bad files aside and train on the rest")
    if not shards:
        import json

        raise NoUsableRows(f"none of the {len(paths)} files under '{uri}' is usable: {list_reasons([b.manifest() for b in bad])}. "
                           f"Fix the data or data.path",
                           "".join(json.dumps(b.manifest(), sort_keys=True) + "\n" for b in bad))
    if not numeric and not categorical:
        raise DataError(f"no feature columns: data.numeric and data.categorical are empty and none could be inferred "
                        f"from '{shards[0].path}' (columns: {', '.join(types[shards[0].path])}); list them in the config")
    dims = tuple(_vector_dim(fs, shards[0], c) if types[shards[0].path][c] == "vector" else 0 for c in numeric)
    try:
        ops = transforms.resolve(cfg.preprocess, numeric, categorical, set(types[shards[0].path]))
    except ValueError as e:
        raise DataError(str(e)) from None
    columns = Columns(numeric=tuple(numeric), dims=dims, categorical=tuple(categorical),
                      numeric_ops=ops[0], categorical_ops=ops[1], crosses=ops[2], function=cfg.preprocess.function,
                      targets=tuple(Target(t, majority[t], cfg.data.kind_of(t)) for t in cfg.data.targets),
                      weight=cfg.data.weight or None, passthrough=tuple(cfg.data.passthrough),
                      label_values=cfg.quality.label_values)
    fragments = []
    offset = 0
    for s in shards:
        at = 0
        deleted = np.frombuffer(s.deleted, dtype=np.int64)
        for g, n in enumerate(s.row_group_rows):
            gone = deleted[(deleted >= at) & (deleted < at + n)] - at
            if n > len(gone):  # a row group the table deleted whole yields nothing: no fragment
                fragments.append(Fragment(s.path, g, offset, n, at, s.partition, s.renames, gone.tobytes()))
            offset += n
            at += n
    return Source(uri, tuple(shards), tuple(fragments), tuple(bad), columns,
                  tuple(skipped) if inferred else None, table)


def list_reasons(entries: list[dict], most: int = 5) -> str:
    """'file' (row group g): reason; ... for the first few manifest entries, and how many more."""
    shown = [f"'{e['file']}'" + (f" row group {e['row_group']}" if e.get("row_group") is not None else "")
             + f": {e['reason']}" for e in entries[:most]]
    more = f"; and {len(entries) - most} more" if len(entries) > most else ""
    return "; ".join(shown) + more
