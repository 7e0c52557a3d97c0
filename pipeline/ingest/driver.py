"""The driver's side: prepare() validates the source, fits the preprocessing in one pass (on Ray tasks
across a cluster, or threads in this process) and plans every rank's share; prepare(since=) fits only
the rows a table gained since a previous plan, extending its fitted state.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import config as config_mod
from ..cluster.tasks import ReadSpec, merge_fit
from ..config import Config
from ..errors import ConfigError, DataError, NoUsableRows, PipelineError
from ..fit.counts import partitions_for as shuffle_partitions
from ..fit.preprocess import FittedPreprocessor, shuffle_columns
from ..fit.vocab_parts import keep_beyond_session
from ..read.quality import Accounting
from ..read.source import Source, inspect, list_reasons
from .plan import IngestPlan, _fit_settings, _shares, load_fit, read_spec
from .worker import _default_world, _torch_dist

_SECTIONS = ("data", "quality", "preprocess")  # where prepare()'s keyword arguments are looked up


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
        from ..cluster import ray_side as side
    else:
        from ..cluster import local_side as side  # type: ignore[no-redef]
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
            from ..fit.history import CountHistory

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
    from ..fit import history
    from ..read import increments

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
        from ..cluster import ray_side

        return ray_side.fit_records(src, spec, cfg.run.stall_timeout_s)[0]
    from ..cluster import local_side

    return local_side.fit_records(src, spec, cfg.run.stall_timeout_s)


# ---------------------------------------------------------------------------------------------
# Inside each training process
