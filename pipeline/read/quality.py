"""Bad values and bad row groups: detect them, apply the configured policy, account for every row.

The same deterministic screen runs in the fit pass and in the transform pass, so both see exactly the
same rows; the fit pass also produces the accounting (rows read = used + dropped + quarantined), and
the transform pass is checked against it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from ..fit.columns import Columns, as_float64, as_matrix
from ..errors import DataError

_EXPECTED = {"numeric": "a finite number", "categorical": "a non-null category", "weight": "a finite number >= 0"}


def value_problems(table: pa.Table, cols: Columns, fitted=None) -> list[tuple[str, str, str, np.ndarray]]:
    """(column, role, what, row mask) for each kind of bad value present in the table.

    fitted: a FittedPreprocessor whose classes targets must belong to (a saved fit used on new data)."""
    out = []
    for c, d in zip(cols.numeric, cols.dims):
        if d:
            v, wrong = as_matrix(table[c], d)
            if wrong.any():
                out.append((c, "numeric", f"a list whose length is not {d}", wrong))
            nan = np.isnan(v).any(axis=1) & ~wrong
            inf = np.isinf(v).any(axis=1)
        else:
            v = as_float64(table[c])
            nan, inf = np.isnan(v), np.isinf(v)
        if nan.any():
            out.append((c, "numeric", "null or NaN", nan))
        if inf.any():
            out.append((c, "numeric", "inf", inf))
    for c in cols.categorical:
        col = table[c]
        if col.null_count:
            out.append((c, "categorical", "null", col.is_null().to_numpy(zero_copy_only=False)))
    for t in cols.targets:
        y = None if t.family == "string" else as_float64(table[t.name])
        null = table[t.name].is_null().to_numpy(zero_copy_only=False) if y is None else np.isnan(y)
        if null.any():
            out.append((t.name, "target", "null or NaN target", null))
        if y is None:
            continue
        if not t.counted:
            inf = np.isinf(y)
            if inf.any():
                out.append((t.name, "target", "inf target", inf))
        if t.kind == "binary":
            bad = (y != 0.0) & (y != 1.0) & ~null
            if bad.any():
                out.append((t.name, "target", "binary target not 0 or 1", bad))
        if cols.label_values:
            bad = ~np.isin(y, np.asarray(cols.label_values, dtype=np.float64)) & ~null
            if bad.any():
                out.append((t.name, "target", f"target not in quality.label_values {list(cols.label_values)}", bad))
    if fitted is not None and cols.targets:
        y = fitted.target_matrix(table.select([t.name for t in cols.targets]))
        for j, t in enumerate(fitted.targets):
            if t.kind == "multiclass":
                unseen = np.isnan(y[:, j]) & table[t.name].is_valid().to_numpy(zero_copy_only=False)
                if unseen.any():
                    out.append((t.name, "target", "class not seen when the preprocessor was fitted", unseen))
    if cols.weight:
        w = as_float64(table[cols.weight])
        bad = ~(np.isfinite(w) & (w >= 0))
        if bad.any():
            out.append((cols.weight, "weight", "null, NaN, inf or negative weight", bad))
    return out


def screen(table: pa.Table, frag, cols: Columns, on_bad_value: str, fitted=None) -> tuple[pa.Table, Counter]:
    """Apply quality.on_bad_value; returns the rows kept and the dropped-row counts by reason.

    fail: the first bad value stops the run, naming file, column, row and value.
    drop_row: any row with any bad value is dropped.
    fill: features are filled at transform time (mean / unknown id); a bad target or weight still
    drops its row (a missing target is never made up).
    """
    if on_bad_value == "fill":  # only a bad target or weight drops a row: the features' checks would change nothing
        cols = replace(cols, numeric=(), dims=(), categorical=())
    problems = value_problems(table, cols, fitted)
    dropped: Counter = Counter()
    if not problems:
        return table, dropped
    if on_bad_value == "fail":
        col, role, what, mask = problems[0]
        i = int(np.argmax(mask))
        value = table[col][i].as_py()
        expected = _EXPECTED.get(role, "a valid target for its kind")
        raise DataError(
            f"column '{col}' in '{frag.path}' has {value!r} ({what}) at row {frag.file_row_start + i} of the file "
            f"(row group {frag.row_group}); expected {expected}. Fix the data upstream, or set "
            f"quality.on_bad_value = \"drop_row\" (drop such rows) or \"fill\" (fill features with the fitted "
            f"mean or the unknown category; rows with a bad target or weight are dropped)")
    drop = np.zeros(table.num_rows, dtype=bool)
    for col, role, what, mask in problems:
        if on_bad_value == "drop_row" or role in ("target", "weight"):
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
    used_by_fragment: dict[int, tuple[int, int]] = field(default_factory=dict)  # fragment row_start ->
    # (training rows, validation rows) it yields after the screen

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def rows_quarantined(self) -> int:
        return sum(e["rows"] or 0 for e in self.quarantined)

    @property
    def balanced(self) -> bool:
        return self.rows_read == self.rows_used + self.rows_dropped + self.rows_quarantined

    def merge_fragment(self, row_start: int, rows: int, used: tuple[int, int], dropped: Counter,
                       quarantine: dict | None) -> None:
        self.rows_read += rows
        self.rows_used += sum(used)
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

    def to_state(self) -> dict[str, Any]:
        """Everything, for a saved fit (from_state rebuilds it)."""
        return {"rows_read": self.rows_read, "rows_used": self.rows_used, "dropped": dict(self.dropped),
                "quarantined": self.quarantined, "unknown_row_files": self.unknown_row_files,
                "used_by_fragment": [[k, *v] for k, v in sorted(self.used_by_fragment.items())]}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "Accounting":
        return cls(d["rows_read"], d["rows_used"], Counter(d["dropped"]), list(d["quarantined"]), d["unknown_row_files"],
                   {k: (a, b) for k, a, b in d["used_by_fragment"]})

    def manifest_jsonl(self) -> str:
        import json

        return "".join(json.dumps(e, sort_keys=True) + "\n" for e in self.quarantined)
