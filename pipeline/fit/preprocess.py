"""The fitted preprocessing as users meet it: `FittedPreprocessor`, the fitted state (fitted.py) with
applying it (apply.py: `transform` for serving, `pack` for training) and saving it (fitted_io.py:
`save`, `load`). The partial statistics of the fit are stats.py, the vocabularies' count shuffle
counts.py. No Ray, no torch.

Fit: every fragment yields partial statistics, merged in fragment order, so the result is the same
whether Ray tasks or one process computed them. Transform: pyarrow/numpy only, no per-row Python; the
same functions feed training and serving, so both give identical arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dataclasses import replace

from . import apply, fitted_io, history
from .. import storage
from .fitted import MAX_CLASSES, UNKNOWN_WARN, FittedState, FittedTarget, Transformed, coverage_lines
from .fitted_io import FORMAT, VERSION
from .stats import (NumericStats, PartialStats, categorical_ops, feature_values, hash_counts, numeric_ops,
                    partial_stats, shuffle_columns)

__all__ = ["FittedPreprocessor", "FittedTarget", "Transformed", "PartialStats", "NumericStats", "partial_stats",
           "shuffle_columns", "coverage_lines", "numeric_ops", "categorical_ops", "feature_values", "hash_counts",
           "FORMAT", "VERSION", "MAX_CLASSES", "UNKNOWN_WARN"]


class FittedPreprocessor(FittedState):
    """The fitted state with its apply (apply.py) and its persistence (fitted_io.py)."""

    # -- apply ----------------------------------------------------------------------------------

    def transform(self, data: Any, *, with_target: bool | None = None) -> Transformed:
        """Transform a pyarrow Table / RecordBatch, a pandas DataFrame or a dict of columns; no Ray needed.
        with_target: None takes the targets (and weight) when their columns are present. A target value
        the fit never saw is an error naming the column and the value, never a silent 'unknown'."""
        return apply.transform(self, data, with_target=with_target)

    def pack(self, table: pa.Table) -> np.ndarray:
        """float32 [n, width]: the training layout (features, category ids, targets, weight)."""
        return apply.pack(self, table)

    def features(self, table: pa.Table, x: np.ndarray | None = None,
                 x_cat: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(x_num float32 [n, F], x_cat int32 [n, C]), written into x / x_cat when given."""
        return apply.features(self, table, x, x_cat)

    def target_matrix(self, table: pa.Table, *, strict: bool = False) -> np.ndarray:
        """float32 [n, T]: each target as it travels in the packed rows (NaN: not representable; strict raises)."""
        return apply.target_matrix(self, table, strict=strict)

    def inverse_target(self, values: Any, name: str | None = None) -> np.ndarray:
        """Model outputs back in the data's terms (regression units; class ids as class values)."""
        return apply.inverse_target(self, values, name)

    # -- save and load ----------------------------------------------------------------------------

    def to_dict(self, vocab_file: str | None = None) -> dict[str, Any]:
        """The fitted state as JSON-able data (vocab_file: the vocabularies' file beside the JSON, or inline)."""
        return fitted_io.to_dict(self, vocab_file)

    def state(self, uri: str) -> dict[str, Any]:
        """to_dict for a JSON saved at `uri`, the vocabularies (and the category counts an increment
        extends, history.py) written beside it."""
        d = fitted_io.state(self, uri)
        kept = history.to_state(self.history, uri)
        return {**d, "history": kept} if kept else d

    @classmethod
    def from_dict(cls, d: dict[str, Any], uri: str | None = None) -> "FittedPreprocessor":
        """The inverse of to_dict / state; uri: where the JSON was read from."""
        fp = fitted_io.from_dict(cls, d, uri)
        kept = history.from_state(d.get("history"), uri)
        return replace(fp, history=kept) if kept is not None else fp

    def save(self, uri: str) -> None:
        storage.write_json(uri, self.state(uri))

    def growth(self, previous: "FittedState") -> dict[str, tuple[int, int]]:
        """Per categorical column, (ids before, ids after): the embedding table sizes of `previous` (the
        fitted state this one extends, prepare(since=...)) and of this one, the unknown id 0 and hash
        buckets included. Known ids never move, so a model grows each table to `after` rows and keeps
        the first `before` as they are."""
        return history.growth(self, previous)

    @property
    def lineage(self) -> list[dict[str, Any]]:
        """The increments this state was extended by, oldest first: each one's previous state's digest,
        source, version range and rows (empty for a full fit)."""
        return list(self.stats.get("lineage", []))

    @classmethod
    def load(cls, uri: str) -> "FittedPreprocessor":
        return fitted_io.load(cls, uri)
