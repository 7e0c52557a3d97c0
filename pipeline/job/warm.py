"""The built-in job's warm start (`--run.since <previous run>`): the increment planned from the previous
run's saved plan, checks that its model can go on (it finished; the same shape), and, in each worker, the
previous final model and optimizer grown to the increment's new ids (pipeline.grow_embedding)."""

from __future__ import annotations

import io
import re
from typing import Any

import pyarrow.fs as pafs
import torch

import pipeline
from pipeline import PipelineError, storage

PLAN_FILE = "plan.pkl"
_SHAPE = ("hidden", "embedding_dim")  # train settings the model's shape depends on


def run_folder(since: str) -> str:
    """`since` itself when it is a run's folder; else `since` read as <output>/<name>: the newest finished run
    of that name (<output>/<name>-<timestamp> with a metrics.json), so a daily job names yesterday's run by
    its name (--run.name day-1, then --run.since runs/day-1)."""
    fs, path = storage.filesystem(since)
    if storage.exists(fs, f"{path}/metrics.json") or storage.exists(fs, f"{path}/{PLAN_FILE}"):
        return since
    parent, name = path.rsplit("/", 1) if "/" in path else (".", path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
    except OSError:
        infos = []
    runs = sorted(i.path for i in infos if i.type == pafs.FileType.Directory
                  and re.fullmatch(re.escape(name) + r"-\d{8}-\d{6}", i.base_name)
                  and storage.exists(fs, f"{i.path}/metrics.json"))
    return storage.to_uri(fs, runs[-1]) if runs else since


def previous_run(since: str) -> dict[str, Any]:
    """What a warm start needs of the run at `since` (a run's folder, or <output>/<name> for the newest
    finished run of that name): its summary (metrics.json), its saved plan and the final checkpoint's
    model state; refused in one paragraph when that run never finished."""
    since = run_folder(since)
    metrics_uri, plan_uri = storage.join(since, "metrics.json"), storage.join(since, PLAN_FILE)
    fs, path = storage.filesystem(metrics_uri)
    if not storage.exists(fs, path):
        raise PipelineError(f"run.since = '{since}' names no finished run: it has no metrics.json (a run writes it when "
                            f"its last epoch is done), and no finished run of that name is beside it ({since}-<time>). "
                            f"Name the folder of a run that finished (runs/<name>-<time>, or runs/<name> for the newest), "
                            f"or resume that run first (run.resume)")
    summary = storage.read_json(metrics_uri)
    if not summary.get("checkpoint") or summary.get("missing_epoch_metrics"):
        raise PipelineError(f"run.since = '{since}' did not finish cleanly (final checkpoint "
                            f"{summary.get('checkpoint')!r}, epochs without metrics {summary.get('missing_epoch_metrics')}): "
                            f"warm-starting from it would continue a model that never completed its training. Resume "
                            f"it (run.resume) or name an earlier run")
    if not storage.exists(*storage.filesystem(plan_uri)):
        raise PipelineError(f"run.since = '{since}' has no {PLAN_FILE} (runs before continuous training did not save "
                            f"their plan), so the rows it trained on are not known. Train once in full with this "
                            f"version, then warm-start from that run")
    return {"run": since, "summary": summary, "plan": pipeline.IngestPlan.load(plan_uri), "plan_uri": plan_uri,
            "checkpoint": summary["checkpoint"]}


def check_shape(prev: dict[str, Any], cfg, plan) -> None:
    """The previous model can go on only with the same layers: the same train.hidden and embedding_dim, numeric
    features and targets, and the same categorical columns (their tables grow; none appears or vanishes)."""
    old_cfg, old = prev["plan"].config, prev["plan"].fitted
    new = plan.fitted
    diff = [f"train.{k} = {getattr(old_cfg.train, k)!r} then, {getattr(cfg.train, k)!r} now" for k in _SHAPE
            if getattr(old_cfg.train, k) != getattr(cfg.train, k)]
    if old.num_features != new.num_features:
        diff.append(f"{old.num_features} numeric features then, {new.num_features} now")
    if tuple(old.categorical) != tuple(new.categorical):
        diff.append(f"categorical columns {list(old.categorical)} then, {list(new.categorical)} now")
    heads = lambda f: [(t.name, t.kind, t.num_classes) for t in f.targets]  # noqa: E731
    if heads(old) != heads(new):
        diff.append(f"targets {heads(old)} then, {heads(new)} now")
    if diff:
        raise PipelineError(f"run.since = '{prev['run']}' trained a model of another shape ({'; '.join(diff)}), so its "
                            f"weights cannot be continued. Warm-start with that run's settings, or train in full (leave "
                            f"run.since empty)")


def growth(prev_fitted, fitted) -> dict[str, tuple[int, int, int]]:
    """Per categorical column: embedding rows before and after, and the rows at the block's end that move with
    it (a vocab+hash column's buckets follow its vocabulary)."""
    ops = fitted.categorical_ops or ()
    out = {}
    for i, (c, b, a) in enumerate(zip(fitted.categorical, prev_fitted.cardinalities, fitted.cardinalities)):
        op = ops[i] if i < len(ops) else None
        tail = op.buckets if op is not None and op.encode == "vocab+hash" else 0
        out[c] = (int(b), int(a), int(tail))
    return out


def warm_line(prev: dict[str, Any], plan, grown: dict[str, tuple[int, int, int]]) -> tuple[str, dict[str, Any]]:
    """'[warm] ...' and what metrics.json keeps of the warm start."""
    def version(p):
        return p.source.table.version if p.source.table is not None else f"{len(p.source.shards)} files"

    said = ", ".join(f"{c} {b:,} -> {a:,}" for c, (b, a, _) in grown.items())
    info = {"since_run": prev["run"], "from_version": version(prev["plan"]), "to_version": version(plan),
            "rows": plan.accounting.rows_read, "train_rows": plan.train_rows,
            "growth": {c: {"before": b, "after": a} for c, (b, a, _) in grown.items()},
            "previous_checkpoint": prev["checkpoint"]}
    line = (f"[warm] from run {prev['run']} (its final model and optimizer): rows added after version "
            f"{info['from_version']} up to version {info['to_version']}, {info['rows']:,} rows; embedding rows {said}")
    return line, info


def load_state(uri: str) -> dict[str, Any]:
    """A checkpoint folder's state.pt, local or remote."""
    fs, path = storage.filesystem(storage.join(uri, "state.pt"))
    with fs.open_input_stream(path) as f:
        return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)


def warm_model(warm: dict[str, Any], fitted, cfg, device, build_model, optimizers):
    """(model, optimizer): the previous run's final model and optimizer, grown to this increment's ids, on `device`,
    not yet wrapped in DDP (grow first: DDP registers the parameters' sizes). Every rank grows identically (the
    new rows' initialisation is seeded)."""
    state = load_state(warm["checkpoint"])
    sparse = "sparse" in state["optimizer"]  # the table's optimizer as it was trained
    before, after, tail = warm["before"], warm["after"], warm["tail"]
    shaped = type("Shape", (), {"num_features": fitted.num_features, "cardinalities": tuple(before),
                                "targets": fitted.targets})
    model = build_model(shaped, cfg, sparse)
    model.load_state_dict(state["model"])
    model.to(device)
    optimizer = optimizers(model, cfg, sparse)
    optimizer.load_state_dict(state["optimizer"])
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    pipeline.grow_embedding(model.embedding, (before, after, tail), optimizer, generator=gen)
    starts = torch.tensor([0, *after]).cumsum(0)[:-1]
    model.offsets = starts.to(device=model.offsets.device, dtype=model.offsets.dtype)  # each column's block starts now
    return model, optimizer, sparse
