"""Bad values and bad row groups: detect them, apply the configured policy, account for every row.

The same deterministic screen runs in the fit pass and in the transform pass, so both see exactly the
same rows; the fit pass also produces the accounting (rows read = used + dropped + quarantined), and
the transform pass is checked against it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import DataError
from .preprocess import _as_float64


def value_problems(table: pa.Table, numeric, categorical, label: str, label_values) -> list[tuple[str, str, np.ndarray]]:
    """(column, what, row mask) for each kind of bad value present in the table."""
    out = []
    for c in numeric:
        v = _as_float64(table[c])
        nan = np.isnan(v)
        if nan.any():
            out.append((c, "null or NaN", nan))
        inf = np.isinf(v)
        if inf.any():
            out.append((c, "inf", inf))
    for c in categorical:
        col = table[c]
        if col.null_count:
            out.append((c, "null", col.is_null().to_numpy(zero_copy_only=False)))
    y = _as_float64(table[label])
    nan = np.isnan(y)
    if nan.any():
        out.append((label, "null or NaN label", nan))
    bad = ~np.isin(y, np.asarray(label_values, dtype=np.float64)) & ~nan
    if bad.any():
        out.append((label, f"label not in {list(label_values)}", bad))
    return out


def screen(table: pa.Table, frag, cfg) -> tuple[pa.Table, Counter]:
    """Apply quality.on_bad_value; returns the rows kept and the dropped-row counts by reason.

    fail: the first bad value stops the run, naming file, column, row and value.
    drop_row: any row with any bad value is dropped.
    fill: features are filled at transform time (mean / unknown id); a bad label still drops its row.
    """
    d, q = cfg.data, cfg.quality
    problems = value_problems(table, d.numeric, d.categorical, d.label, q.label_values)
    dropped: Counter = Counter()
    if not problems:
        return table, dropped
    if q.on_bad_value == "fail":
        col, what, mask = problems[0]
        i = int(np.argmax(mask))
        value = table[col][i].as_py()
        expected = (f"one of {list(q.label_values)}" if col == d.label else
                    "a finite number" if col in d.numeric else "a non-null category")
        raise DataError(
            f"column '{col}' in '{frag.path}' has {value!r} ({what}) at row {frag.file_row_start + i} of the file "
            f"(row group {frag.row_group}); expected {expected}. Fix the data upstream, or set "
            f"quality.on_bad_value = \"drop_row\" (drop such rows) or \"fill\" (fill features with the fitted "
            f"mean or the unknown category; rows with a bad label are dropped)")
    drop = np.zeros(table.num_rows, dtype=bool)
    for col, what, mask in problems:
        if q.on_bad_value == "drop_row" or col == d.label:
            new = mask & ~drop
            if new.any():
                dropped[f"{what} in '{col}'"] += int(new.sum())
                drop |= mask
    if drop.any():
        table = table.filter(pa.array(~drop))
    return table, dropped


@dataclass
class Accounting:
    """Every row of the input is used, dropped (by reason) or in a quarantined file or row group."""

    rows_read: int = 0  # rows in every file whose footer could be read
    rows_used: int = 0
    dropped: Counter = field(default_factory=Counter)
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # manifest entries
    unknown_row_files: int = 0  # quarantined files whose footer was unreadable (row count unknown)
    used_by_fragment: dict[int, int] = field(default_factory=dict)  # fragment row_start -> rows it yields

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def rows_quarantined(self) -> int:
        return sum(e["rows"] or 0 for e in self.quarantined)

    @property
    def balanced(self) -> bool:
        return self.rows_read == self.rows_used + self.rows_dropped + self.rows_quarantined

    def merge_fragment(self, row_start: int, rows: int, used: int, dropped: Counter, quarantine: dict | None) -> None:
        self.rows_read += rows
        self.rows_used += used
        self.used_by_fragment[row_start] = used
        self.dropped.update(dropped)
        if quarantine:
            self.quarantined.append(quarantine)

    def add_bad_files(self, bad_files) -> None:
        for b in bad_files:
            self.quarantined.append(b.manifest())
            if b.rows is None:
                self.unknown_row_files += 1
            else:
                self.rows_read += b.rows

    def summary(self) -> str:
        files = {e["file"] for e in self.quarantined}
        reasons = ", ".join(f"{n:,} {r}" for r, n in sorted(self.dropped.items())) or "none"
        line = (f"rows read {self.rows_read:,} = used {self.rows_used:,} + dropped {self.rows_dropped:,} ({reasons}) "
                f"+ quarantined {self.rows_quarantined:,} ({len(self.quarantined)} entries in {len(files)} files)")
        if self.unknown_row_files:
            line += f"; {self.unknown_row_files} quarantined files had unreadable footers (row count unknown)"
        return line + ("" if self.balanced else "  [DOES NOT BALANCE]")

    def as_dict(self) -> dict[str, Any]:
        return {"rows_read": self.rows_read, "rows_used": self.rows_used, "rows_dropped": self.rows_dropped,
                "dropped_by_reason": dict(sorted(self.dropped.items())), "rows_quarantined": self.rows_quarantined,
                "quarantined_entries": len(self.quarantined), "unknown_row_files": self.unknown_row_files,
                "balanced": self.balanced}

    def manifest_jsonl(self) -> str:
        import json

        return "".join(json.dumps(e, sort_keys=True) + "\n" for e in self.quarantined)
