"""What one task does to one fragment: the same functions run inside Ray Data tasks (ray_side) and
in a plain process (local_side), so both paths give the same statistics, rows and accounting.

No Ray and no torch here: pyarrow and numpy on one row group at a time.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..fit.columns import Columns, decoded
from ..errors import DataError
from ..feed.plan import Piece, holdout_mask
from ..fit.preprocess import FittedPreprocessor, PartialStats, partial_stats
from ..read.quality import Accounting, screen
from ..read.files import Fragment
from ..read.row_groups import DamagedRowGroup, in_file, opened, read_fragment
from ..read.source import Source
from ..fit.apply import pack_columns
from ..fit.transforms import apply_function

ROW_ID = "__row_id"


@dataclass(frozen=True)
class ReadSpec:
    """Everything a task needs besides its fragment: where, which columns, which policies, the hold-out."""

    uri: str
    columns: Columns
    on_bad_file: str = "fail"
    on_bad_value: str = "fill"
    val_fraction: float = 0.0
    val_seed: int = 0
    schema: pa.Schema | None = None  # a Delta or Iceberg table's columns (row_groups.read_fragment)
    defaults: tuple = ()  # the table's values of columns added after a file was written (row_groups.read_fragment)


def read(spec: ReadSpec, frag: Fragment, pf=None) -> pa.Table | dict:
    """The fragment's rows with their global row ids, or (on_bad_file = quarantine) a manifest entry
    saying why not. pf: the file, already open (row_groups.opened)."""
    fn = spec.columns.function
    try:
        table = read_fragment(spec.uri, frag, None if fn else spec.columns.read, pf, spec.schema, spec.defaults)
    except (OSError, pa.ArrowException) as e:
        rows = f"rows {frag.file_row_start}-{frag.file_row_start + frag.num_rows - 1}"
        text = str(e).lower()
        if "encrypt" in text or "decrypt" in text:
            what, why = "is encrypted", ("its columns are encrypted; reading them needs the decryption keys "
                                         "(pyarrow.parquet.encryption), which this pipeline does not take: decrypt it upstream")
        elif isinstance(e, DamagedRowGroup):
            what, why = "is damaged", "the file is damaged behind a readable footer: rewrite it"
        else:
            what, why = "cannot be decoded", "the file is damaged behind a readable footer: rewrite it"
        if spec.on_bad_file == "fail":
            raise DataError(f"row group {frag.row_group} ({rows}) of '{frag.path}' {what}: {e}. {why[0].upper()}{why[1:]}, "
                            f"or set quality.on_bad_file = \"quarantine\" to set such row groups aside") from None
        return {"file": frag.path, "row_group": frag.row_group, "row_start": frag.file_row_start,
                "rows": frag.live_rows, "reason": f"row group {what} ({type(e).__name__}: {e})"
                + (f"; {why}" if what == "is encrypted" else "")}
    if fn:  # the user's function sees every column of the row group, then only what is used is kept
        table = apply_function(fn, table).select(spec.columns.read)
    return table.append_column(ROW_ID, pa.array(frag.row_ids()))


def _kept(spec: ReadSpec, frag: Fragment, fitted=None, pf=None) -> tuple[pa.Table | None, Counter, dict | None]:
    table = read(spec, frag, pf)
    if isinstance(table, dict):
        return None, Counter(), table
    kept, dropped = screen(table, frag, spec.columns, spec.on_bad_value, fitted)
    return kept, dropped, None


def _is_val(spec: ReadSpec, kept: pa.Table) -> np.ndarray:
    return holdout_mask(kept[ROW_ID].to_numpy(), spec.val_fraction, spec.val_seed)


def fit_fragment(spec: ReadSpec, frag: Fragment, pf=None) -> tuple:
    """(row_start, rows, partial statistics or None, dropped counts, quarantine entry or None,
    (training rows, validation rows)); or (row_start, message, details) when the run must stop. Statistics
    are of the training rows only, so validation rows never leak into the fit."""
    try:
        kept, dropped, quarantine = _kept(spec, frag, pf=pf)
        if kept is None:
            return frag.row_start, frag.live_rows, None, dropped, quarantine, (0, 0)
        val = _is_val(spec, kept)
        n_val = int(val.sum())
        # the training rows as a mask: each column is taken out once and masked, not the batch filtered
        stats = partial_stats(kept, spec.columns, ~val if n_val else None)
        return frag.row_start, frag.live_rows, stats, dropped, None, (kept.num_rows - n_val, n_val)
    except DataError as e:
        # Returned, not raised: Ray would wrap it in layers of task errors and print a traceback.
        return frag.row_start, str(e), e.details
    except Exception as e:  # noqa: BLE001 - anything else still reaches the user as one paragraph
        return frag.row_start, str(unexpected(e, frag)), traceback.format_exc()


GROUP_ROWS = 1 << 19  # a task reads up to this many rows of one file: few tasks, each opening its file once


def by_file(items: list, path_of, rows_of, same=lambda a, b: True) -> list[list]:
    """Consecutive items of the same file (and `same` otherwise) in groups of up to GROUP_ROWS rows,
    order kept: one task per group reads the file's footer once instead of once per row group."""
    groups: list[list] = []
    rows = 0
    for it in items:
        g = groups[-1] if groups else None
        if g and path_of(g[-1]) == path_of(it) and same(g[-1], it) and rows + rows_of(it) <= GROUP_ROWS:
            g.append(it)
            rows += rows_of(it)
        else:
            groups.append([it])
            rows = rows_of(it)
    return groups


def as_dictionary(spec: ReadSpec, frag: Fragment) -> list[str]:
    """String categoricals are read as dictionaries (ids and counts per dictionary entry), unless the
    user's function comes first: it sees the columns as the file holds them. Named as in the file."""
    return [] if spec.columns.function else in_file(frag, spec.columns.categorical)


def fit_group(spec: ReadSpec, frags: list[Fragment]) -> list[tuple]:
    """fit_fragment over fragments of one file, opened once."""
    with opened(spec.uri, frags[0].path, as_dictionary(spec, frags[0])) as pf:
        return [fit_fragment(spec, f, pf) for f in frags]


def fit_group_split(spec: ReadSpec, frags: list[Fragment], columns: list, partitions: int) -> tuple:
    """fit_group, with the group's category counts taken out of its records and split by hash range
    (counts.split): (records, part 0, ..., part P-1). Under Ray each part is a return value of its own,
    left in the object store for its reducer."""
    from ..fit import counts as shuffle
    from ..fit.columns import count_merge

    records = fit_group(spec, frags)
    tables: dict[str, list] = {c.name: [] for c in columns}
    for r in records:
        if len(r) == 6 and r[2] is not None:
            for c in columns:
                tables[c.name] += r[2].categories.pop(c.name, [])
    return (records, *shuffle.split({k: count_merge(v) for k, v in tables.items()}, columns, partitions))


def fragment_groups(fragments) -> list[list[Fragment]]:
    return by_file(list(fragments), lambda f: f.path, lambda f: f.num_rows)


def piece_groups(pieces, mix: bool = False) -> list[list[Piece]]:
    """A rank's pieces by file. mix=False: never training and validation pieces in one group (a Ray
    block is then all one or the other); mix=True: in fragment order, a fragment's training and
    validation pieces together, so that its row group is read and screened once for both."""
    pieces = sorted(pieces, key=lambda p: (p.fragment.row_start, p.val)) if mix else list(pieces)
    return by_file(pieces, lambda p: p.fragment.path, lambda p: p.rows,
                   (lambda a, b: True) if mix else (lambda a, b: a.val == b.val))


def transform_group(spec: ReadSpec, fitted: FittedPreprocessor, pieces: list[Piece]) -> list[Part]:
    """transform_piece over pieces of one file, opened once; pieces of the same row group share one
    read, screen and hold-out split."""
    with opened(spec.uri, pieces[0].fragment.path, as_dictionary(spec, pieces[0].fragment)) as pf:
        last: dict = {}
        out = []
        for p in pieces:
            if p.fragment.row_start not in last:
                last = {p.fragment.row_start: _split(spec, fitted, p.fragment, pf)}
            out.append(transform_piece(spec, fitted, p, split=last[p.fragment.row_start]))
        return out


def merge_fit(records: list[tuple], source: Source) -> tuple[PartialStats, Accounting]:
    """Merge fit_fragment's records in fragment order (the float64 merge is then the same every run)."""
    errors = sorted(r for r in records if len(r) == 3)
    if errors:
        raise DataError(errors[0][1], errors[0][2])
    total, acct = PartialStats(), Accounting()
    acct.add_bad_files(source.bad_files)
    for row_start, n, part, dropped, quarantine, used in sorted(records, key=lambda r: r[0]):
        acct.merge_fragment(row_start, n, used, dropped, quarantine)
        if part is not None:
            total = total.merge(part)
    acct.quarantined.sort(key=lambda e: (e["file"], e["row_group"] if e["row_group"] is not None else -1))
    return total, acct


Part = tuple  # (packed float32 rows [k, width], global row ids [k], {pass-through column: values [k]})


def extras(spec: ReadSpec, table: pa.Table) -> dict[str, np.ndarray]:
    # A categorical that is also passed through arrives as a dictionary column (row_groups.opened), and
    # to_numpy of a dictionary column is not its values where they are null: decoded first.
    return {c: decoded(table[c]).to_numpy(zero_copy_only=False) for c in spec.columns.passthrough}


def unexpected(e: BaseException, frag: Fragment) -> DataError:
    return DataError(f"unexpected {type(e).__name__} while reading row group {frag.row_group} of '{frag.path}': {e}. "
                     f"The file may hold a type or encoding this pipeline does not handle: run with --debug for the "
                     f"traceback, and rewrite the file or report it", traceback.format_exc())


def transform_piece(spec: ReadSpec, fitted: FittedPreprocessor, piece: Piece, pf=None, split=None) -> Part:
    """(packed float32 rows [k, fitted.width], global row ids [k], pass-through columns) of one piece,
    written straight into the training layout."""
    try:
        return _transform_piece(spec, fitted, piece, split or _split(spec, fitted, piece.fragment, pf))
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001
        raise unexpected(e, piece.fragment) from None


def _split(spec: ReadSpec, fitted: FittedPreprocessor, f: Fragment, pf=None) -> dict[bool, Part]:
    """A fragment's kept rows, packed once, as {is validation: part}."""
    try:
        kept, _, quarantine = _kept(spec, f, pf=pf)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001
        raise unexpected(e, f) from None
    if kept is None:  # readable during fit, not now: the data changed under the run
        raise DataError(f"'{f.path}' row group {f.row_group} could be read during fit but not now "
                        f"({quarantine['reason']}); do not modify data.path while a run is in progress")
    val = _is_val(spec, kept)
    columns, ids, extra = pack_columns(fitted, kept), kept[ROW_ID].to_numpy(), extras(spec, kept)
    # Packed first, split after: a boolean index on one float32 array instead of filtering every column;
    # each side's rows a row-major view of its column-major selection, copied once into rows where they
    # land (the rank's tensor, or a Ray block)
    return {v: (np.compress(m, columns, axis=1).T, ids[m], {c: x[m] for c, x in extra.items()})
            for v, m in ((True, val), (False, ~val))}


def _transform_piece(spec: ReadSpec, fitted: FittedPreprocessor, piece: Piece, split: dict[bool, Part]) -> Part:
    f = piece.fragment
    rows, ids, extra = split[piece.val]
    if len(ids) < piece.hi:
        raise DataError(f"'{f.path}' row group {f.row_group} yields {len(ids):,} usable rows now but "
                        f"{piece.hi:,} or more during fit; do not modify data.path while a run is in progress")
    s = slice(piece.lo, piece.hi)
    return rows[s], ids[s], {c: x[s] for c, x in extra.items()}


EXTRA = "extra:"  # prefix of pass-through columns in a Ray block


def concat(parts: list[Part], fitted: FittedPreprocessor, spec: ReadSpec) -> dict[str, Any]:
    """Parts as one Ray block: rows, row_id and a column per pass-through column."""
    if not parts:
        return {"rows": np.empty((0, fitted.width), np.float32), "row_id": np.empty(0, np.int64),
                **{EXTRA + c: np.empty(0, object) for c in spec.columns.passthrough}}
    return {"rows": np.ascontiguousarray(np.concatenate([p[0] for p in parts])),  # (parts may be column-major views)
            "row_id": np.concatenate([p[1] for p in parts]),
            **{EXTRA + c: np.concatenate([p[2][c] for p in parts]) for c in spec.columns.passthrough}}
