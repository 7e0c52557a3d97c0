"""The public API: describe the data once on the driver, get each rank's rows and a loader in the loop.

Driver (or every torchrun process, or a notebook):

    plan = pipeline.prepare("data/demo", label="label", world_size=2)   # validate, fit, plan every rank's share
    trainer = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), **plan.trainer_kwargs())

Worker (inside the loop, under Ray Train, torchrun or none):

    data = pipeline.rank_data(plan, batch_size=1024)     # this rank's training/validation rows + a loader
    for epoch in range(epochs):
        data.loader.set_epoch(epoch)
        for batch in data.loader: ...                    # pipeline.Batch(x_num, x_cat, y, w) on the device

`prepare` runs the fit pass on Ray when Ray is initialised (one task per row group, across the
cluster) and in this process otherwise; both give the same fitted state and the same plan. Under Ray
Train each rank's rows are read and transformed by Ray Data tasks on the rank's own node; elsewhere
the rank reads them itself with pyarrow. Either way rank r sees exactly the same rows and batches.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import config as config_mod
from . import storage
from .config import Config
from .errors import ConfigError, DataError, NoUsableRows, PipelineError
from .feed.plan import Piece, plan_shares, rank_sizes
from .fit.counts import partitions_for as shuffle_partitions
from .fit.preprocess import FittedPreprocessor, coverage_lines, shuffle_columns
from .read.quality import Accounting
from .read.source import Source, inspect, list_reasons
from .cluster.tasks import ReadSpec, merge_fit
from .fit.vocab_parts import keep_beyond_session

_PLAN_FORMAT = "pipeline.IngestPlan/1"
_SECTIONS = ("data", "quality", "preprocess")  # where prepare()'s keyword arguments are looked up


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
        from .cluster import ray_side

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
        copy, and the pickle stays small. Copy the folder with the plan."""
        from .fit import fitted_io

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
        return plan


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


def build_config(config: Config | str | Path | None = None, path: str | None = None, **settings: Any) -> Config:
    """A Config from a Config, a TOML file or the defaults, with keyword overrides: a data, quality or
    preprocess key by its bare name (label=, numeric=, on_bad_value=, ...) or any key by its dotted
    name through `settings={'train.shuffle': 'global'}`."""
    known = config_mod.keys()
    overrides: dict[str, Any] = dict(settings.pop("settings", None) or {})
    if path is not None:
        overrides["data.path"] = path
    for name, value in settings.items():
        if value is None:
            continue
        hits = [f"{s}.{name}" for s in _SECTIONS if f"{s}.{name}" in known]
        if not hits:
            raise ConfigError(config_mod._unknown(name, {k.split(".", 1)[1] for k in known if k.split(".")[0] in _SECTIONS},
                                                  "prepare()", what="keyword argument"))
        overrides[hits[0]] = list(value) if isinstance(value, tuple) else value
    if isinstance(config, Config):
        return config_mod.Config.model_validate({**config.to_dict(), **_nest(overrides, config.to_dict())}) \
            if overrides else config
    return config_mod.load(config, overrides)


def _nest(overrides: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        out.setdefault(section, dict(base.get(section, {})))[name] = value
    return out


def agreed_version(cfg: Config, src: Source) -> Source:
    """Under torch.distributed every process prepares for itself: where a table's latest version was
    read, all of them read rank 0's, even when a writer committed between their reads."""
    dist = _torch_dist()
    if src.table is None or cfg.data.version or dist is None or dist.get_world_size() == 1:
        return src
    versions = [None] * dist.get_world_size()
    dist.all_gather_object(versions, src.table.version)
    if versions[dist.get_rank()] == versions[0]:
        return src
    return inspect(build_config(cfg, settings={"data.version": versions[0]}))


def _ray_ready() -> bool:
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def _fit_on_ray(fit_on: str) -> bool:
    """run.fit_on: ray, local, or auto: Ray when it is initialised and has more than one node. On one
    node, threads in this process use the same cores without starting Ray worker processes (measured:
    seconds less before the first step)."""
    if fit_on != "auto":
        return fit_on == "ray"
    if not _ray_ready():
        return False
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) > 1


def shuffle_memory(shuffled: tuple) -> dict[str, int]:
    """The count shuffle's reducer and finalize tasks: how many, and the most memory one of them held."""
    _, first, second = shuffled
    mem = [s["_memory"] for s in (*first, *second) if "_memory" in s]
    return {"partitions": len(first), "task_rss_max": max((m["rss"] for m in mem), default=0),
            "task_uss_max": max((m["uss"] for m in mem), default=0), **first[0].get("_seconds", {})}


def prepare(path: str | None = None, *, world_size: int | None = None, config: Config | str | Path | None = None,
            fitted: FittedPreprocessor | str | None = None, fit_from: str | None = None, use_ray: bool | None = None,
            since: "IngestPlan | str | None" = None, **data: Any) -> IngestPlan:
    """Validate the shards, fit the preprocessing in one pass, and plan every rank's share.

    path: a directory or URI of Parquet shards (or data.path of `config`). Describe the data with
    keyword arguments (label=, numeric=, categorical=, weight=, target_kind=, val_fraction=,
    on_bad_value=, ...: any data/quality/preprocess key) or a TOML `config`; features left unnamed
    are inferred from the schema. world_size: the number of training ranks (default: torch.distributed's
    world size, else $WORLD_SIZE, else 1). fitted: a FittedPreprocessor (or its JSON path) to use
    instead of the one this pass fits, e.g. when resuming. fit_from: a fit.json (IngestPlan.save_fit)
    to reuse instead of the fit pass, refused in one paragraph when the files or the data, quality or
    preprocess settings changed since. use_ray: run the fit pass on Ray (default: when Ray is initialised).

    since: a previous IngestPlan (or the URI it was saved to with plan.save): plan only the rows the
    source gained after that plan's version, and extend its fitted state (known ids never move; see
    docs/continuous.md). Its settings are the previous plan's unless given (and then must equal them).
    Nothing new gives an empty plan: test `plan.empty`."""
    if since is not None:
        if fitted is not None or fit_from:
            raise ConfigError("since= extends the previous plan's fitted state; it takes no fitted= or fit_from= (leave "
                              "them out, or prepare without since= to use them)")
        return _prepare_since(path, since, world_size, config, use_ray, data)
    cfg = build_config(config, path, **data)
    world = world_size or _default_world()
    t0 = time.perf_counter()
    src = agreed_version(cfg, inspect(cfg))
    spec = read_spec(cfg, src)
    on_ray = _fit_on_ray(cfg.run.fit_on) if use_ray is None else use_ray
    if on_ray:
        from .cluster import ray_side as side
    else:
        from .cluster import local_side as side  # type: ignore[no-redef]
    t1 = time.perf_counter()
    reuse = fit_from or cfg.run.fit_from
    saved = load_fit(reuse, cfg, src) if reuse else None
    shuffled, partitions, kept, here = None, 1, None, None
    if saved is not None:
        fitted, acct = fitted or saved[0], saved[1]
        on_ray, fit_s = False, 0.0
        total_rows = acct.rows_used
    else:
        p = cfg.preprocess
        partitions = shuffle_partitions(p.vocab_partitions, src.num_rows)
        if on_ray:
            records, shuffled = side.fit_records(src, spec, cfg.run.stall_timeout_s,
                                                 (shuffle_columns(src.columns, p.vocab_max_size, p.vocab_min_count),
                                                  partitions))
        else:
            records, shuffled = side.fit_records(src, spec, cfg.run.stall_timeout_s), None
        total, acct = merge_fit(records, src)
        if shuffled is None and fitted is None:  # the shuffle here, every count kept for prepare(since=...)
            from .fit.history import CountHistory

            here, kept = CountHistory.fit(total.categories, shuffle_columns(src.columns, p.vocab_max_size,
                                                                            p.vocab_min_count), partitions, total.rows)
        fit_s = time.perf_counter() - t1
        total_rows = total.rows
    if total_rows == 0:
        set_aside = f"; set aside: {list_reasons(acct.quarantined)}" if acct.quarantined else ""
        raise NoUsableRows(f"no usable rows under '{src.uri}': {acct.summary()}{set_aside}. Fix the data or the quality "
                           f"policy (quality.on_bad_value, quality.label_values)", acct.manifest_jsonl())
    p = cfg.preprocess
    if isinstance(fitted, str):
        fitted = FittedPreprocessor.load(fitted)
    fitted = fitted or replace(FittedPreprocessor.from_stats(total, src.columns, max_size=p.vocab_max_size,
                                                             min_count=p.vocab_min_count,
                                                             missing_indicator=p.missing_indicator,
                                                             standardize_target=p.standardize_target,
                                                             partitions=partitions, shuffled=shuffled or here),
                               history=kept)
    if saved is None:
        fit_s = time.perf_counter() - t1  # the vocabularies' cut and parts included
    plan = IngestPlan(cfg, src, fitted, acct, world, **_shares(src, acct, world, cfg.train.shuffle == "global"),
                      timings={"validate_s": t1 - t0, "fit_s": fit_s, "planned_at": time.time(),
                               "fit_on": f"reused {reuse}" if saved else "Ray" if on_ray else "this process",
                               **({"shuffle": shuffle_memory(shuffled)} if shuffled else {})})
    if _ray_ready():
        fitted.shared()  # tasks and training workers get the vocabularies from the object store, not pickled in
        keep_beyond_session(fitted.vocab, fitted.vocab_digest)  # the plan still saves and serves after ray.shutdown()
    if min(plan.train_sizes) == 0:
        raise DataError(f"{world} ranks but only {plan.train_rows:,} training rows: ranks "
                        f"{[r for r, n in enumerate(plan.train_sizes) if n == 0]} would get none; use fewer ranks")
    return plan


def _prepare_since(path, since, world_size, config, use_ray, data) -> IngestPlan:
    """prepare(since=...): the rows the source gained after the previous plan's version (increments.py),
    fitted by extending the previous fitted state (history.py), planned like any other rows."""
    from .fit import history
    from .read import increments

    prev = IngestPlan.load(since) if isinstance(since, (str, Path)) else since
    if not isinstance(prev, IngestPlan):
        raise ConfigError(f"since= takes the previous IngestPlan or the URI it was saved to (plan.save), not "
                          f"{type(prev).__name__}")
    pinned = data.pop("version", None)  # the previous plan's pinned version is where this one starts, not ends
    if pinned is None and config is not None:  # a config of this call's own (the job's) pins where this one ends
        pinned = build_config(config, path).data.version or None
    cfg = build_config(config if config is not None else prev.config, path, **data,
                       settings={"data.version": pinned or ""})
    increments.same_settings(_fit_settings(cfg), _fit_settings(prev.config))
    cols = prev.source.columns
    if prev.source.inferred is not None:  # the features stay the previous fit's, whatever the table adds
        cfg = build_config(cfg, settings={"data.numeric": list(cols.numeric), "data.categorical": list(cols.categorical)})
    world = world_size or _default_world()
    t0 = time.perf_counter()
    table, paths, rng = increments.gained(cfg, prev)
    dist = _torch_dist()
    if table is not None and not pinned and dist is not None and dist.get_world_size() > 1:
        ends = [None] * dist.get_world_size()  # every process reads up to rank 0's version, as agreed_version does
        dist.all_gather_object(ends, rng.upto)
        if ends[dist.get_rank()] != ends[0]:
            cfg = build_config(cfg, settings={"data.version": ends[0]})
            table, paths, rng = increments.gained(cfg, prev)
    if not paths and (table is None or not table.files):
        return IngestPlan(cfg, Source(cfg.data.path, (), (), columns=cols, table=table), prev.fitted, Accounting(),
                          world, [[] for _ in range(world)], [[] for _ in range(world)],
                          timings={"validate_s": time.perf_counter() - t0, "fit_s": 0.0, "planned_at": time.time(),
                                   "fit_on": "nothing to fit"}, increment=rng)
    if table is not None and not paths:
        src = inspect(cfg, table=table)
    else:  # new files of a folder, or the change data feed's rows written beside the table
        src = inspect(cfg, paths[0].rsplit("/", 1)[0] if table is not None else cfg.data.path, paths=paths)
    src, rng = increments.placed(src, rng, prev.source)
    spec = read_spec(cfg, src)
    on_ray = _fit_on_ray(cfg.run.fit_on) if use_ray is None else use_ray
    t1 = time.perf_counter()
    total, acct = merge_fit(_records(src, spec, cfg, on_ray), src)
    counts_then, how = prev.fitted.history, ""
    if counts_then is None or not counts_then.partitions:  # a fit by the count shuffle kept none: recounted once
        if prev.increment is not None:
            raise PipelineError("the previous plan's fitted state keeps no category counts (it was pickled without "
                                "plan.save, or fitted on a Ray cluster), so the thresholds cannot count over the "
                                "whole history. Pass the plan saved with plan.save, or prepare without since=")
        total0, _ = merge_fit(_records(prev.source, prev.spec, cfg, on_ray), prev.source)
        counts_then = history.recounted(prev.fitted, total0, prev.source.columns, cfg.preprocess)
        how = "; the previous plan's rows recounted once: its state kept no counts"
    fitted = history.extended(prev.fitted, counts_then, total, src.columns, cfg.preprocess, rng.to_dict())
    fit_s = time.perf_counter() - t1
    plan = IngestPlan(cfg, src, fitted, acct, world, **_shares(src, acct, world, cfg.train.shuffle == "global"),
                      timings={"validate_s": t1 - t0, "fit_s": fit_s, "planned_at": time.time(),
                               "fit_on": ("Ray" if on_ray else "this process") + how}, increment=rng)
    if _ray_ready():
        fitted.shared()
        keep_beyond_session(fitted.vocab, fitted.vocab_digest)
    if min(plan.train_sizes) == 0 and plan.train_rows:
        raise DataError(f"{world} ranks but only {plan.train_rows:,} training rows in the increment ({rng.describe()}): "
                        f"ranks {[r for r, n in enumerate(plan.train_sizes) if n == 0]} would get none; use fewer ranks "
                        f"or wait for more rows")
    return plan


def _records(src: Source, spec: ReadSpec, cfg: Config, on_ray: bool) -> list:
    """The fit tasks' records with their category counts (an increment extends the counts here)."""
    if on_ray:
        from .cluster import ray_side

        return ray_side.fit_records(src, spec, cfg.run.stall_timeout_s)[0]
    from .cluster import local_side

    return local_side.fit_records(src, spec, cfg.run.stall_timeout_s)


# ---------------------------------------------------------------------------------------------
# Inside each training process


def _in_ray_train() -> bool:
    import sys

    if "ray.train" not in sys.modules:
        return False
    import ray.train

    try:
        ray.train.get_context()
    except RuntimeError:
        return False
    return True


def _torch_dist():
    import sys

    if "torch" not in sys.modules:  # then no process group can be initialised here (and importing torch costs seconds)
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def end_process_group_at_exit() -> None:
    """Registered by rank_data under torch.distributed: at interpreter exit, before finalization,
    destroy the default process group (where the loop did not) and collect what still holds it (a DDP
    model is a reference cycle), so that gloo's worker threads are joined while Python still runs.
    Left to finalization, a gloo thread that drops the last reference to a collective's tensor finds
    the interpreter gone and kills the process (`terminate called without an active exception`,
    SIGABRT) after the loop has ended cleanly; under load it happened in about 1 run of 5."""
    import gc

    dist = _torch_dist()
    if dist is not None and dist.get_backend() == "gloo":  # local to this process; NCCL's destroy is the user's
        dist.destroy_process_group()
    gc.collect()


def _default_world() -> int:
    dist = _torch_dist()
    if dist is not None:
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_context() -> tuple[str, int, int]:
    """(launcher, rank, world size): Ray Train's context, else torch.distributed, else $RANK /
    $WORLD_SIZE (torchrun sets them), else a single process."""
    if _in_ray_train():
        import ray.train

        ctx = ray.train.get_context()
        return "ray", ctx.get_world_rank(), ctx.get_world_size()
    dist = _torch_dist()
    if dist is not None:
        return "torch.distributed", dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "environment", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return "single process", 0, 1


def _default_device(launcher: str):
    import torch

    if launcher == "ray":
        import ray.train.torch

        return ray.train.torch.get_device()
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def available_memory() -> int:
    """Bytes of memory this node can still give without swapping (MemAvailable; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def spill_dir_for(cfg: Config, rows: int, width: int, ranks_on_node: int = 1) -> tuple[str | None, str]:
    """(directory for a memory-mapped share or None for RAM, and why) per loader.spill: the rows of
    every rank on the node against half of the node's available memory."""
    need, avail = rows * width * 4 * ranks_on_node, available_memory()
    spill = cfg.loader.spill == "always" or (cfg.loader.spill == "auto" and 0 < avail < 2 * need)
    if not spill:
        return None, "in memory"
    d = cfg.loader.spill_dir or os.path.join(tempfile.gettempdir(), "pipeline-spill")
    why = "loader.spill = always" if cfg.loader.spill == "always" else \
        f"{need / 2**30:.1f} GiB needed, {avail / 2**30:.1f} GiB available"
    return d, f"memory-mapped from files in {d} ({why})"


@dataclass
class RankData:
    """This rank's rows and loader. `train`/`val` are TabularDatasets (packed rows in row-id order);
    `loader` yields `Batch`es on `device`, the same number on every rank, and its `state_dict()` is
    the same dict on every rank (save rank 0's, load it on all to resume exactly)."""

    plan: IngestPlan
    rank: int
    world_size: int
    launcher: str
    device: Any
    train: Any  # TabularDataset
    val: Any  # TabularDataset
    loader: Any  # DeviceLoader
    rows_local: int  # rows of this rank's share transformed on this node (Ray) or in this process
    read_s: float
    where: str
    resumed: str = ""  # where the loader went on from, when rank_data was given a state

    @property
    def fitted(self) -> FittedPreprocessor:
        return self.plan.fitted

    def describe(self) -> str:
        return (f"[data] rank {self.rank}/{self.world_size} ({self.launcher}): {len(self.train):,} training + "
                f"{len(self.val):,} validation rows, {100.0 * self.rows_local / max(1, len(self.train) + len(self.val)):.0f}% "
                f"transformed on this node, in {self.read_s:.1f}s; rows {self.where}; {len(self.loader)} steps/epoch"
                + (f"; {self.resumed}" if self.resumed else ""))


def rank_data(plan: IngestPlan, *, batch_size: int | None = None, seed: int | None = None,
              shuffle: bool | None = None, drop_last: bool | None = None, device=None, rank: int | None = None,
              world_size: int | None = None, resume: dict | None = None) -> RankData:
    """This rank's training and validation rows and a loader over its training rows.

    Rank and world size come from Ray Train, torch.distributed or $RANK/$WORLD_SIZE (or pass them);
    under Ray Train the rows arrive through the DataConfig of `plan.trainer_kwargs()`, elsewhere this
    process reads its pieces with pyarrow. batch_size, seed, shuffle and drop_last default to the
    plan's config (train.*); device to Ray Train's device, else cuda:$LOCAL_RANK when CUDA is there,
    else the CPU. Every rank runs the same number of steps per epoch (the plan knows every rank's size).

    A plan made for another world size is re-planned from its fit (no new pass over the data). resume: a
    loader state (`loader.state_dict()`, the same on every rank) saved on any number of ranks: the loader
    goes on from it, and the rank reads what the rest of that epoch deals it (every row of the epoch once
    across the ranks, see sampler.py)."""
    import torch

    from .feed.loader import DeviceLoader
    from .feed.sampler import BatchSampler, resume_span, upgrade

    if plan.empty:
        raise PipelineError(f"the plan is empty: {plan.describe()[0].removeprefix('[fit] ')}. Test plan.empty before "
                            f"rank_data, and wait for new rows (prepare(since=plan) again later)")
    launcher, r, w = rank_context()
    if launcher == "torch.distributed":
        atexit.unregister(end_process_group_at_exit)  # once, however many times rank_data is called
        atexit.register(end_process_group_at_exit)
    r = r if rank is None else rank
    w = w if world_size is None else world_size
    if not 0 <= r < w:
        raise PipelineError(f"rank {r} is not one of world_size={w} ranks ({launcher})")
    plan = plan.for_world(w)
    cfg = plan.config
    t = cfg.train
    batch_size, seed = batch_size or t.batch_size, t.seed if seed is None else seed
    drop_last = t.drop_last if drop_last is None else drop_last
    shuffle = t.shuffle != "none" if shuffle is None else shuffle
    iterator, ranks_on_node, read_here = None, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), ""
    if launcher == "ray":
        import ray.train

        from .cluster import ray_side

        ranks_on_node = ray.train.get_context().get_local_world_size()
        if cfg.loader.read_share == "worker":
            read_here = " (read in this worker: loader.read_share = worker)"
        elif ray_side.cpus()[0] >= 1:
            from .cluster.runtime import quiet_ray_data

            quiet_ray_data(progress=False)  # a shard of an already planned read: no bars, no banner per rank
            iterator = ray.train.get_dataset_shard(ray_side.DATASET)
        else:  # the training workers hold every CPU: a Ray Data task would wait forever, so read here
            read_here = " (read in this worker: the cluster has no CPU free for Ray Data tasks)"
    span = resume_span(resume, plan.train_rows, w, r, global_rows=plan.global_shuffle) if resume else None
    if span is not None and iterator is not None:  # the DataConfig's share is the plain block: read here
        iterator, read_here = None, " (read in this worker: a resume on another world size)"
    reading = plan.with_train_span(r, *span) if span else plan
    train, val, local, secs, where = read_rank(reading, r, iterator, ranks_on_node)
    sizes = plan.train_sizes
    sampler = BatchSampler(sizes[r], batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=r,
                           rank_sizes=sizes, global_rows=plan.train_rows if plan.global_shuffle else None,
                           **({"offset": span[0], "dataset_rows": span[1] - span[0]} if span else {}))
    device = torch.device(device) if device is not None else _default_device(launcher)
    loader = DeviceLoader(train, sampler, device, placement=cfg.loader.placement, prefetch=cfg.loader.prefetch,
                          device_memory_fraction=cfg.loader.device_memory_fraction,
                          chunk_bytes=int(cfg.loader.chunk_mib * 2**20))
    resumed = ""
    if resume:
        loader.load_state_dict(resume)
        st = upgrade(resume)
        saved_on = sorted({s[0] for s in st["segments"]}) or ["any"]
        resumed = (f"resumed at epoch {st['epoch']}, position {st.get('position', 0):,} (saved on "
                   f"{'/'.join(map(str, saved_on))} ranks): {len(loader) - loader.sampler.step} steps left in it"
                   + (f", read positions {span[0]:,}-{span[1] - 1:,}" if span else ""))
    return RankData(plan, r, w, launcher, device, train, val, loader, local, secs, where + read_here, resumed)


def read_rank(plan: IngestPlan, rank: int, iterator=None, ranks_on_node: int = 1):
    """(training TabularDataset, validation TabularDataset, rows transformed on this node or in this
    process, seconds, where the rows live): rank's share from a Ray DataIterator (the plan's DataConfig
    made it) or, without one, read in this process; each block is written straight into the rank's
    packed tensors as it arrives, whose sizes the plan knows up front."""
    from .feed.dataset import Layout, RowWriter

    cfg, f = plan.config, plan.fitted
    layout = Layout(f.num_features, len(f.categorical), len(f.targets), 1 if f.weight else 0)
    planned = (plan.train_rows if plan.global_shuffle else plan.train_sizes[rank], plan.val_sizes[rank])
    spill_dir, where = spill_dir_for(cfg, sum(planned), layout.width, ranks_on_node)
    writers = {val: RowWriter(n, layout, spill_dir=spill_dir, what=f"{'validation' if val else 'training'} rows for "
                                                                   f"rank {rank}") for val, n in zip((False, True), planned)}

    def sink(part, val: bool) -> None:
        writers[val].add(*part)

    if iterator is not None:
        from .cluster import ray_side

        local, secs = ray_side.receive(iterator, sink, rank, sum(planned), cfg.run.stall_timeout_s)
    else:
        from .cluster import local_side

        local, secs = local_side.read_share(plan, rank, sink, ranks_on_node)
    return writers[False].finish(), writers[True].finish(), local, secs, where
