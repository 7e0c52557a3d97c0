"""Reading one row group: column pushdown, page checksums verified, decoded values checked against the
footer's statistics (a damaged page that still decodes), a table's deleted rows left out and its
columns found by their ids and typed as the table says.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import storage
from ..errors import DataError
from ..fit.columns import family
from .files import Fragment, Shard


class DamagedRowGroup(OSError):
    """A row group decoded without error to values its footer says it cannot hold."""


def statistics_problem(rg, table: pa.Table) -> str | None:
    """Check each decoded column chunk against the footer's statistics, where the writer stored them:
    the null count always, min and max for integers, floats and bools (strings are left alone: some
    writers store truncated bounds). A page whose bytes changed without a checksum to tell can still
    decode; its values then rarely keep the chunk's exact null count, minimum and maximum."""
    for j in range(rg.num_columns):
        chunk = rg.column(j)
        name = chunk.path_in_schema
        stats = chunk.statistics if chunk.is_stats_set else None
        if stats is None or name not in table.column_names:
            continue
        col = table[name]
        if stats.has_null_count and col.null_count != stats.null_count:
            return f"column '{name}': {col.null_count} nulls decoded, the footer says {stats.null_count}"
        t = col.type
        if not stats.has_min_max or not (pa.types.is_integer(t) or pa.types.is_boolean(t)
                                         or pa.types.is_float32(t) or pa.types.is_float64(t)):
            continue
        lo, hi = _min_max(col)
        if lo is None:
            continue  # only nulls or NaN decoded: the null count above already spoke
        if (lo, hi) != (stats.min, stats.max):
            return f"column '{name}': min {lo!r} and max {hi!r} decoded, the footer says {stats.min!r} and {stats.max!r}"
    return None


def _min_max(col: pa.ChunkedArray) -> tuple:
    """pyarrow's min_max of a column as Python values (None, None where every value is null). Floats by
    numpy's fmin / fmax, which skip NaN as pyarrow's does (all NaN gives NaN) at a tenth of the time:
    pyarrow's float kernel is not vectorised, a tenth of a rank's time on the demo's 12 float columns."""
    if not pa.types.is_floating(col.type) or pa.types.is_float16(col.type):
        mm = pc.min_max(col)
        return mm["min"].as_py(), mm["max"].as_py()
    if col.null_count == len(col):
        return None, None
    v = col.to_numpy()  # nulls as NaN, which fmin / fmax pass over
    return float(np.fmin.reduce(v)), float(np.fmax.reduce(v))


def indices_within(col: pa.ChunkedArray) -> None:
    """Raise ArrowInvalid where a dictionary column's index points outside its dictionary (what a damaged
    page can decode to). The indices' least and greatest only: a full validate() also checks the text of
    every dictionary entry, twice the time on click-through data, and a string column read without a
    dictionary is not checked that way either."""
    for chunk in col.chunks:
        if not len(chunk) or chunk.null_count == len(chunk):
            continue
        lo, hi = _min_max(chunk.indices)
        if lo < 0 or hi >= len(chunk.dictionary):
            raise pa.ArrowInvalid(f"dictionary index {lo if lo < 0 else hi} outside a dictionary of "
                                  f"{len(chunk.dictionary)} values")


@contextlib.contextmanager
def opened(uri: str, path: str, dictionary: tuple[str, ...] = ()):
    """The file as a ParquetFile (page checksums verified where the writer stored them), opened once
    for every row group a task reads from it; None when it cannot be opened, and each read then opens
    it itself and reports why for its own row group. dictionary: columns to read as dictionary arrays
    where the file stores them as strings (categoricals: each distinct value is then looked up once
    per row group, not once per row; see columns.category_ids)."""
    fs, _ = storage.filesystem(uri)
    try:
        f = fs.open_input_file(path)
        pf = pq.ParquetFile(f, page_checksum_verification=True)
        schema = pf.schema_arrow
        as_dict = [c for c in dictionary if c in schema.names and family(schema.field(c).type) == "string"]
        if as_dict:  # the same footer, read once
            pf = pq.ParquetFile(f, page_checksum_verification=True, metadata=pf.metadata, read_dictionary=as_dict)
    except (OSError, pa.ArrowException):
        yield None
        return
    with f:
        yield pf


def deep_check(uri: str, shard: Shard) -> Iterator[tuple[int, str | None]]:
    """(row group, problem or None) for every row group of the file: every page of every column
    decoded, with page checksums verified where stored, and checked against the footer's statistics."""
    with opened(uri, shard.path) as pf:
        for g in range(len(shard.row_group_rows)):
            if pf is None:
                yield g, "the file cannot be opened"
                continue
            try:
                table = pf.read_row_group(g)
                problem = statistics_problem(pf.metadata.row_group(g), table)
                yield g, (f"decoded values disagree with the footer's statistics ({problem})" if problem else None)
            except (OSError, pa.ArrowException) as e:
                yield g, f"cannot be decoded ({type(e).__name__}: {e})"


def in_file(part: Shard | Fragment, columns) -> list[str]:
    """The names in the file of those of `columns` it holds (a table's file may name them otherwise, or
    lack a column the table added later)."""
    if not part.renames:
        return list(columns)
    names = {t: f for f, t in part.renames}
    return [names[c] for c in columns if c in names]


def read_fragment(uri: str, frag: Fragment, columns: list[str] | None, pf: pq.ParquetFile | None = None,
                  schema: pa.Schema | None = None, defaults: tuple[tuple[str, Any], ...] = ()) -> pa.Table:
    """Read one row group, only the named columns (column pushdown; None: every column), with page
    checksums verified where the writer stored them, from `pf` (see opened) or the file; partition keys
    named in `columns` come from the table's metadata or the path. schema: a table's (source.py's Source.table):
    the columns are then the table's, found in the file by frag.renames, typed as the table says, null
    where the file predates them (or `defaults`' value); and the rows the table deleted are left out."""
    if pf is None:
        with opened(uri, frag.path) as pf:
            if pf is None:  # open it again without the guard, for the error itself
                fs, _ = storage.filesystem(uri)
                with fs.open_input_file(frag.path) as f:
                    pq.ParquetFile(f)
            return read_fragment(uri, frag, columns, pf, schema, defaults)
    part = dict(frag.partition)
    file_names = pf.schema_arrow.names
    to_table = dict(frag.renames) if schema is not None else {n: n for n in file_names}
    from_table = {t: f for f, t in to_table.items()}
    if columns is None:
        columns = list(schema.names) if schema is not None else list(dict.fromkeys([*file_names, *part]))
    table = pf.read_row_group(frag.row_group, columns=[from_table[c] for c in columns if c in from_table])
    for col in table.columns:
        if pa.types.is_dictionary(col.type):  # a damaged page can decode to indices past its dictionary
            indices_within(col)
    problem = statistics_problem(pf.metadata.row_group(frag.row_group), table)
    if problem:
        raise DamagedRowGroup(f"decoded values disagree with the footer's statistics ({problem})")
    keep = frag.keep()
    if keep is not None:
        table = table.filter(pa.array(keep))
    table = table.rename_columns([to_table[n] for n in table.column_names])
    if schema is None:
        for c in columns:
            if c not in table.column_names and c in part:
                table = table.append_column(c, pa.array([part[c]] * table.num_rows, type=pa.string()))
        return table.select(columns)
    out = {}
    for c in columns:
        want = schema.field(c).type
        if c in table.column_names:
            out[c] = conform(table[c], want, c, frag.path)
        elif c in part:
            out[c] = constant(part[c], want, table.num_rows)
        else:  # added to the table after this file was written
            out[c] = constant(dict(defaults).get(c), want, table.num_rows)
    return pa.table(out) if out else table.select([])


def constant(value: Any, type_: pa.DataType, n: int) -> pa.Array:
    """`value` n times, as `type_` (a table's partition value)."""
    if value is None:
        return pa.nulls(n, type_)
    try:
        scalar = pa.scalar(value, type=type_)
    except (pa.ArrowException, TypeError, ValueError):
        scalar = pa.scalar(value).cast(type_)  # e.g. an Iceberg date partition held as its day number
    return pa.repeat(scalar, n)


_NUMBERS = {"bool", "int", "float", "temporal"}


def conform(col: pa.ChunkedArray, want: pa.DataType, name: str, path: str) -> pa.ChunkedArray:
    """A file's column as the table's type, where the table widened it (int to long, float to double,
    decimal precision, a timestamp's unit); text, binary and lists are kept in the layout read (a
    dictionary, a view), which every reader here takes as the same values."""
    have = col.type
    if have == want or not (family(have) in _NUMBERS and family(want) in _NUMBERS):
        return col
    try:  # a timestamp read finer than the table's unit (INT96 as ns): the table's unit, as its reader does
        return col.cast(want, safe=not (pa.types.is_timestamp(have) and pa.types.is_timestamp(want)))
    except pa.ArrowException as e:
        raise DataError(f"column '{name}' in '{path}' is {have}, which cannot be read as the table's type {want} "
                        f"({e}); rewrite the file with the table's type") from None
