"""The plan: what prepare() hands from the driver to every rank (the source's row groups, the fitted
preprocessing, each rank's pieces), with its own save and load, and the saved fit's checks.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field, replace
from typing import Any

from .. import storage
from ..cluster.tasks import ReadSpec
from ..config import Config
from ..errors import ConfigError, PipelineError
from ..feed.plan import Piece, plan_shares, rank_sizes
from ..fit.preprocess import FittedPreprocessor, coverage_lines
from ..read.quality import Accounting
from ..read.source import Source

_PLAN_FORMAT = "pipeline.IngestPlan/1"


@dataclass
class IngestPlan:
    """What the driver decided: the validated source, the fitted preprocessing, the row accounting and
    every rank's share (pieces of row groups; sizes within one row). Small and picklable: pass it to
    your training function (closure or train_loop_config); `trainer_kwargs()` wires it into TorchTrainer."""

    config: Config
    source: Source
    fitted: FittedPreprocessor
    accounting: Accounting
    world_size: int
    train_shares: list[list[Piece]]
    val_shares: list[list[Piece]]
    timings: dict[str, float] = field(default_factory=dict)
    increment: Any = None  # increments.Range: the rows gained after a previous plan's version (prepare(since=...))

    @property
    def empty(self) -> bool:
        """No rows to train on: an increment with nothing new after the previous plan's version. Test it
        before rank_data (which refuses an empty plan); its `increment` still moves the next since= on."""
        return self.train_rows == 0 and not sum(self.val_sizes)

    @property
    def spec(self) -> ReadSpec:
        return read_spec(self.config, self.source)

    @property
    def global_shuffle(self) -> bool:
        return self.config.train.shuffle == "global"

    @property
    def train_rows(self) -> int:
        return sum(u[0] for u in self.accounting.used_by_fragment.values())

    @property
    def train_sizes(self) -> list[int]:
        """Training rows of every rank (in global shuffle mode: each rank's share of every epoch)."""
        if self.global_shuffle:
            return rank_sizes(self.train_rows, self.world_size)
        return [sum(p.rows for p in s) for s in self.train_shares]

    @property
    def val_sizes(self) -> list[int]:
        return [sum(p.rows for p in s) for s in self.val_shares]

    def for_world(self, world: int) -> "IngestPlan":
        """The same fit planned for another number of ranks: shares re-planned from the fit's counts, no
        new pass over the data (an elastic run that lost or gained workers)."""
        if world == self.world_size:
            return self
        return replace(self, world_size=world, **_shares(self.source, self.accounting, world, self.global_shuffle))

    def with_train_span(self, rank: int, lo: int, hi: int) -> "IngestPlan":
        """rank reads training positions [lo, hi) instead of its block (a resume on another world size)."""
        shares = list(self.train_shares)
        shares[rank] = plan_shares(self.source.fragments, _used(self.accounting, 0), 1, bounds=[(lo, hi)])[0]
        return replace(self, train_shares=shares)

    def pieces(self, rank: int) -> list[Piece]:
        """What rank reads: its training pieces, then its validation pieces."""
        return [*self.train_shares[rank], *self.val_shares[rank]]

    def trainer_kwargs(self, datasets: dict[str, Any] | None = None, dataset_config=None,
                       cpus_per_worker: float = 1.0) -> dict[str, Any]:
        """`TorchTrainer(..., **plan.trainer_kwargs())`: the datasets and the DataConfig that give every
        rank its share. Your own `datasets` are kept and split by `dataset_config` (default: Ray Train's
        DataConfig), exactly as without this library. cpus_per_worker: CPUs each training worker holds
        (what your ScalingConfig asks), to know what a node has left for reading shares.

        With loader.read_share = "worker" (the default) each rank reads its own share, so the plan adds
        no dataset: Ray Train then starts no Ray Data machinery at all unless you pass datasets."""
        from ..cluster import ray_side

        if datasets and ray_side.DATASET in datasets:
            raise ConfigError(f"the dataset name '{ray_side.DATASET}' is taken by the ingest plan; rename your dataset")
        if self.config.loader.read_share == "worker":
            return {"datasets": dict(datasets or {}),
                    **({"dataset_config": dataset_config} if dataset_config is not None else {})}
        return {"datasets": {**(datasets or {}), ray_side.DATASET: ray_side.placeholder()},
                "dataset_config": ray_side.data_config(self, base=dataset_config, cpus_per_worker=cpus_per_worker)}

    def describe(self) -> list[str]:
        """The lines a job prints about the plan."""
        t = self.timings
        inc = f"; {self.increment.describe()} ({self.increment.how})" if self.increment is not None else ""
        if self.empty:
            r = self.increment
            if r is None:
                return ["[fit] an empty plan (plan.empty), nothing to train"]
            return [f"[fit] nothing new after version {r.after} in {r.name} (read up to version {r.upto}): an empty "
                    f"plan (plan.empty), nothing to train"] + [f"[fit] {n}" for n in r.notes]
        kinds = ", ".join(f"'{x.name}' {x.kind}" + (f" ({x.num_classes} classes)" if x.num_classes > 2 else "")
                          for x in self.fitted.targets) or "none (unlabelled)"
        return [f"[fit] {len(self.source.shards)} shards, {self.source.num_rows:,} rows, {len(self.source.fragments)} "
                f"row groups {self.source.where}{inc}; {self.source.describe_columns()}",
                f"[fit] one pass in {t.get('fit_s', 0):.1f}s ({t.get('fit_on', '?')}): {self.fitted.num_features} "
                f"numeric features, vocab sizes {dict(zip(self.fitted.categorical, (len(v) for v in self.fitted.vocab)))}; "
                f"targets: {kinds}",
                f"[rows] {self.accounting.summary()}",
                f"[plan] training rows per rank {self.train_sizes}, validation rows per rank {self.val_sizes}, from "
                f"{[len(self.pieces(r)) for r in range(self.world_size)]} row-group pieces"] + \
            coverage_lines(self.fitted, self.config.preprocess.vocab_max_size, self.config.preprocess.vocab_min_count) + \
            [f"[columns] {note}" for note in self.source.conversions(self.fitted.stats)] + \
            [f"[fit] {n}" for n in (self.increment.notes if self.increment is not None else ())]

    def save_fit(self, uri: str) -> None:
        """The fit pass's result, for `prepare(fit_from=uri)` (run.fit_from): the fitted preprocessor, the
        row accounting, the settings it depends on and a fingerprint of every file (size, modification
        time, row groups, footer size). Plain JSON."""
        storage.write_json(uri, {"format": _FIT_FORMAT, "settings": _fit_settings(self.config),
                                 "files": self.source.fingerprint, "fitted": self.fitted.state(uri),
                                 "table": self.source.table.fingerprint if self.source.table else None,
                                 "accounting": self.accounting.to_state()})

    def save(self, uri: str) -> None:
        """Pickle the plan to a file or URI (load it with IngestPlan.load in the same code version). The
        vocabularies go beside it as their parts' files (`vocab-<digest>/`), which the pickle names: every
        process that loads the plan (torchrun ranks of a node) maps the same pages instead of holding a
        copy, and the pickle stays small. Copy or move the folder with the plan: load finds them beside it."""
        from ..fit import fitted_io

        uri = os.path.abspath(uri) if storage.is_local(uri) else uri
        fitted = fitted_io.on_files(self.fitted, uri)  # no object refs
        if fitted.history is not None and fitted.history.partitions:  # the counts as files too, not in the pickle
            fitted = replace(fitted, history=fitted.history.on_files(
                f"{uri.rsplit('/', 1)[0]}/counts-{fitted.history.digest}" if "/" in uri else f"counts-{fitted.history.digest}"))
        fs, path = storage.filesystem(uri)
        with fs.open_output_stream(path) as out:
            out.write(pickle.dumps((_PLAN_FORMAT, replace(self, fitted=fitted))))

    @classmethod
    def load(cls, uri: str) -> "IngestPlan":
        fs, path = storage.filesystem(uri)
        with fs.open_input_stream(path) as f:
            fmt, plan = pickle.loads(f.read())
        if fmt != _PLAN_FORMAT:
            raise PipelineError(f"'{uri}' holds {fmt!r}, not {_PLAN_FORMAT!r}; prepare the plan again with this version")
        _beside(plan, uri)
        return plan


def _beside(plan: IngestPlan, uri: str) -> None:
    """A plan loaded from another folder than it was saved in (a run folder copied to another machine or
    bucket): the files its pickle names (vocab-<digest>/ and counts-<digest>/ parts, named by their content's
    digest) are read from beside it where they are there, else from where they were saved."""
    folder = uri.rsplit("/", 1)[0] if "/" in uri else "."

    def here(path: str, suffix: str = "") -> str:
        if not isinstance(path, str) or "/" not in path:
            return path
        moved = storage.join(folder, *path.rsplit("/", 2)[-2:])  # <its folder>/part-NNNNN
        fs, p = storage.filesystem(moved + suffix)
        return moved if storage.exists(fs, p) else path

    for parts in {id(v.parts): v.parts for v in plan.fitted.vocab if hasattr(v, "parts")}.values():
        parts.sources = [here(s, ".arrow") for s in parts.sources]
        if parts.backup is not None:
            parts.backup = [here(s, ".arrow") for s in parts.backup]
    history = plan.fitted.history
    if history is not None and history.partitions:
        history.sources = [here(s) for s in history.sources]


_FIT_FORMAT = "pipeline.Fit/1"


def _shares(src: Source, acct: Accounting, world: int, whole: bool) -> dict[str, list[list[Piece]]]:
    """Every rank's training and validation pieces: pure functions of the fit's counts and the world size."""
    return {"train_shares": plan_shares(src.fragments, _used(acct, 0), world, whole=whole),
            "val_shares": plan_shares(src.fragments, _used(acct, 1), world, val=True)}


def _used(acct: Accounting, which: int) -> dict[int, int]:
    """fragment row_start -> the training (0) or validation (1) rows it yields after the screen."""
    return {k: u[which] for k, u in acct.used_by_fragment.items()}


def read_spec(cfg: Config, src: Source) -> ReadSpec:
    return ReadSpec(src.uri, src.columns, cfg.quality.on_bad_file, cfg.quality.on_bad_value, cfg.data.val_fraction,
                    cfg.data.val_seed, *((src.table.schema, src.table.defaults) if src.table is not None else ()))


def _fit_settings(cfg: Config) -> dict[str, Any]:
    """The settings a fit depends on (the data description, quality policies, preprocessing)."""
    d = cfg.to_dict()
    out = {k: d[k] for k in ("data", "quality", "preprocess")}
    out["data"] = {k: v for k, v in out["data"].items() if k != "version"}  # the table's version read is checked itself
    out["preprocess"] = {k: v for k, v in out["preprocess"].items() if k != "refit_numeric"}  # increments only
    return out


def load_fit(uri: str, cfg: Config, src: Source) -> tuple[FittedPreprocessor, Accounting]:
    """A saved fit, after checking it was made from these files with these settings."""
    try:
        saved = storage.read_json(uri)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot read the saved fit '{uri}' (run.fit_from): {e}; point run.fit_from at a fit.json "
                            f"written by `python -m pipeline fit` or a train run, or leave it empty to fit again") from None
    if saved.get("format") != _FIT_FORMAT:
        raise PipelineError(f"'{uri}' is not a saved fit (format {saved.get('format')!r}, expected {_FIT_FORMAT!r})")
    then, table_now = saved.get("table"), src.table.fingerprint if src.table else None
    if then != table_now:
        def said(t):
            return f"the {t[0]} table {t[1]} at version {t[2] or '(none)'}" if t else "a folder of Parquet files"

        pin = f", or read the version it was made from (data.version = {then[2]!r})" if then and table_now else ""
        raise PipelineError(f"the saved fit '{uri}' was made from {said(then)}, but this run reads {said(table_now)}: its "
                            f"statistics and row counts would be wrong. Fit again (leave run.fit_from empty){pin}")
    now = _fit_settings(cfg)
    changed = [f"{sec}.{k}: {saved['settings'][sec].get(k)!r} then, {v!r} now" for sec, body in now.items()
               for k, v in body.items() if saved["settings"].get(sec, {}).get(k) != v]
    files_then = {f[0]: f for f in saved["files"]}
    files_now = {f[0]: f for f in json.loads(json.dumps(src.fingerprint))}
    diff = sorted(set(files_then) ^ set(files_now)) + sorted(p for p in files_then.keys() & files_now.keys()
                                                               if files_then[p] != files_now[p])
    if changed or diff:
        what = "; ".join(([f"settings changed ({', '.join(changed[:4])})"] if changed else [])
                         + ([f"{len(diff)} files were added, removed or changed since (first: {', '.join(diff[:3])})"]
                            if diff else []))
        raise PipelineError(f"the saved fit '{uri}' does not describe this data: {what}. Its statistics and row counts "
                            f"would be wrong; fit again (leave run.fit_from empty) or restore the data and settings")
    return FittedPreprocessor.from_dict(saved["fitted"], uri), Accounting.from_state(saved["accounting"])
