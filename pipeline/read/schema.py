"""Checking the shards' schemas against the config: each file's column types, the roles the config gives
them, features inferred from the schema where the config names none, and the columns every shard shares.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import Config
from ..errors import DataError
from ..fit import transforms
from ..fit.columns import KINDS, NUMERIC_FAMILIES, common_length, family
from .files import Shard
from .row_groups import in_file


def column_types(shard: Shard, function: str = "") -> dict[str, str]:
    """Type family of every column, partition keys (strings) included; with preprocess.function, of
    the columns it gives back (it is run on the file's schema, no rows)."""
    out = {name: family(shard.schema.field(name).type) for name in shard.schema.names}
    for k, _ in shard.partition:
        out.setdefault(k, "string")
    if function:
        empty = shard.schema.empty_table()
        for k, _ in shard.partition:
            if k not in empty.column_names:
                empty = empty.append_column(k, pa.array([], pa.string()))
        after = transforms.apply_function(function, empty)
        out = {name: family(after.schema.field(name).type) for name in after.schema.names}
    return out


_TARGET_FAMILIES = {"bool", "int", "float", "string"}


def _roles(cfg: Config, features: tuple[list[str], list[str]]) -> list[tuple[str, str]]:
    d = cfg.data
    return [*((c, "numeric") for c in features[0]), *((c, "categorical") for c in features[1]),
            *((t, "label") for t in d.targets), *(((d.weight, "weight"),) if d.weight else ()),
            *((c, "passthrough") for c in d.passthrough)]


def _column_problem(shard: Shard, cfg: Config, roles, types: dict[str, str], majority: dict[str, str]) -> str | None:
    for col, role in roles:
        if col not in types:
            return (f"column '{col}' (data.{role}) is missing; the file has: {', '.join(sorted(types))}. "
                    f"Fix data.{role} or the file")
        fam = types[col]
        if role == "numeric" and fam not in NUMERIC_FAMILIES | {"vector"}:
            fix = "list it under data.categorical" if fam == "string" else "cast it to a number upstream"
            return f"column '{col}' is {fam}, config says numeric (a number or a list of numbers); {fix}"
        if role == "weight" and fam not in NUMERIC_FAMILIES - {"temporal"}:
            return f"column '{col}' is {fam}, data.weight must be a number; cast it upstream or name another column"
        if role == "label":
            kind = cfg.data.kind_of(col)
            if fam not in _TARGET_FAMILIES:
                return (f"target column '{col}' is {fam}; a target must be a bool, an integer, a float or a string "
                        f"(allowed kinds: {', '.join(KINDS)}); cast it upstream or pick another data.label")
            if fam == "string" and kind in ("binary", "regression"):
                return (f"target column '{col}' holds strings, data.target_kind says {kind}; set data.target_kind = "
                        f"\"multiclass\" (or \"auto\") or cast the column upstream")
        if role == "categorical" and fam not in {"bool", "int", "float", "string", "binary"}:
            return f"column '{col}' is {fam}, config says categorical (string, integer or bool); cast it upstream"
        # Numbers may widen between shards (int8 here, float64 there); a target's values are the same
        # either way (3 and 3.0 are one class), a category's are not ('3' vs '3.0').
        widen = {"int", "bool", "float"} if role == "label" else {"int", "bool"}
        if role in ("categorical", "label") and fam != majority[col] and not (fam in widen and majority[col] in widen):
            # '3' and 3.0 would become different categories: refuse rather than split a vocabulary silently.
            return (f"column '{col}' is {fam} here but {majority[col]} in most shards (type drift); "
                    f"write it with one type in every shard")
    return None


def infer_features(cfg: Config, types: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(numeric, categorical, skipped) from the column types: numbers and lists of numbers are numeric;
    strings, dictionaries and bools categorical; the rest skipped. Targets, the weight and data.exclude
    are never features."""
    d = cfg.data
    taken = {*d.targets, d.weight, *d.exclude, *d.passthrough}
    numeric, categorical, skipped = [], [], []
    for name, fam in types.items():
        if name in taken:
            continue
        if fam in {"int", "float", "temporal", "vector"}:
            numeric.append(name)
        elif fam in {"string", "bool"}:
            categorical.append(name)
        else:
            skipped.append(f"{name} ({fam})")
    return numeric, categorical, skipped


def common_columns(types: dict[str, dict[str, str]]) -> tuple[dict[str, str], list[str]]:
    """The columns every file has, each with its most common type family (in first-seen order), and
    the columns only some files have, named with their count of files: features are inferred from
    all files' schemas together, never from the first file alone."""
    files: Counter = Counter()
    fams: dict[str, Counter] = {}
    for t in types.values():
        for name, fam in t.items():
            files[name] += 1
            fams.setdefault(name, Counter())[fam] += 1
    n = len(types)
    common = {name: c.most_common(1)[0][0] for name, c in fams.items() if files[name] == n}
    partial = [f"{name} (in {files[name]} of {n} files)" for name in fams if files[name] < n]
    return common, partial


def _vector_dim(fs, shard: Shard, col: str) -> int:
    """The length of a list column's values: from the schema (fixed-size list) or, for a plain list,
    the most common length in the first row group that has a non-null value."""
    t = shard.schema.field(col).type
    if pa.types.is_fixed_size_list(t):
        return t.list_size
    name = in_file(shard, [col])
    with fs.open_input_file(shard.path) as f:
        pf = pq.ParquetFile(f)
        for g in range(pf.metadata.num_row_groups if name else 0):
            dim = common_length(pf.read_row_group(g, columns=name)[0])
            if dim is not None:
                return dim
    raise DataError(f"numeric column '{col}' in '{shard.path}' is a list column with no non-null value, so its "
                    f"length is unknown; fill it upstream or remove it from data.numeric")
