"""The built-in training job: one client of the public API (`pipeline.prepare`, `pipeline.rank_data`),
importing nothing a user could not.

Driver: prepare (validate, one fit pass, plan every rank's share) -> TorchTrainer with the plan's
datasets and DataConfig. Worker: rank_data (this rank's rows, read and transformed on its own node,
and a loader) -> an MLP with a head per target: binary (BCE; accuracy vs the majority class),
multiclass (cross-entropy; accuracy vs the majority class), regression (MSE; RMSE vs predicting the
mean), several at once (the losses summed), with an optional per-row weight.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import pipeline
from pipeline import Config, DataError, NoUsableRows, PipelineError, StepStats, storage, timed

CHECKPOINT_FILE = "state.pt"
PREPROCESSOR_FILE = "preprocessor.json"
QUARANTINE_FILE = "quarantine.jsonl"
FIT_FILE = "fit.json"


def head_widths(fitted: "pipeline.FittedPreprocessor") -> list[int]:
    """Model outputs per target: K logits for K classes, else one."""
    return [t.num_classes if t.kind == "multiclass" else 1 for t in fitted.targets]


class TabularMLP(nn.Module):
    """Standardised numeric features + one embedding per categorical column -> MLP -> one output per
    binary or regression target and one logit per class of each multiclass target."""

    def __init__(self, num_features: int, cardinalities: tuple[int, ...], embedding_dim: int, hidden: tuple[int, ...],
                 out: int = 1, sparse: bool = False):
        super().__init__()
        # One table for all categorical columns, each column's ids shifted into its own range:
        # a single embedding lookup per batch instead of one per column.
        self.register_buffer("offsets", torch.tensor([0, *np.cumsum(cardinalities)[:-1]], dtype=torch.int64)
                             if cardinalities else torch.zeros(0, dtype=torch.int64), persistent=False)
        # sparse: a step's gradient (and its all-reduce) covers only the rows the batch looked up, not the
        # whole table: at CTR vocabulary sizes the difference between an epoch near the loader's speed and
        # one an order of magnitude slower (see SPARSE_ROWS).
        self.embedding = nn.Embedding(max(1, sum(cardinalities)), embedding_dim, sparse=sparse)
        width = num_features + embedding_dim * len(cardinalities)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, out))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        parts = [x_num]
        if x_cat.shape[1]:
            parts.append(self.embedding(x_cat + self.offsets).flatten(1))
        return self.mlp(torch.cat(parts, dim=1))


SPARSE_ROWS = 100_000  # train.sparse_embeddings = auto: sparse gradients from this many embedding rows on


def sparse_embeddings(fitted, cfg: Config, use_gpu: bool) -> bool:
    """auto: sparse where the table is large and the gradients are all-reduced by gloo (CPU training);
    NCCL cannot all-reduce sparse gradients, so GPU training keeps them dense."""
    s = cfg.train.sparse_embeddings
    if s != "auto":
        return s == "true"
    return not use_gpu and sum(fitted.cardinalities) >= SPARSE_ROWS


def build_model(fitted, cfg: Config, sparse: bool = False) -> TabularMLP:
    return TabularMLP(fitted.num_features, fitted.cardinalities, cfg.train.embedding_dim, cfg.train.hidden,
                      sum(head_widths(fitted)), sparse=sparse)


class Optimizers:
    """AdamW for the dense parameters and, with sparse embeddings, train.sparse_optimizer for the
    table (AdamW cannot take sparse gradients): adam (SparseAdam at train.lr: adaptive per row, as the
    dense path) or sgd (train.embedding_lr, as DLRM trains it: SparseAdam's coalescing made a step
    about 1.7x slower than SGD's row updates, measured on Criteo shapes, 2 cores). One object to step,
    zero and checkpoint."""

    def __init__(self, model: nn.Module, cfg: Config, sparse: bool):
        inner = model.module if hasattr(model, "module") else model
        table = [inner.embedding.weight] if sparse else []
        dense = [p for p in model.parameters() if all(p is not q for q in table)]
        t = cfg.train
        self.parts = {"dense": torch.optim.AdamW(dense, lr=t.lr, weight_decay=t.weight_decay)}
        if table:
            self.parts["sparse"] = torch.optim.SGD(table, lr=t.embedding_lr) if t.sparse_optimizer == "sgd" else \
                torch.optim.SparseAdam(table, lr=t.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts.values():
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts.values():
            o.step()

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if "state" in state:  # a checkpoint from before: one AdamW over every parameter
            state = {"dense": state}
        if set(state) != set(self.parts):
            raise pipeline.PipelineError(
                f"the checkpoint's optimizer has parts {sorted(state)} but this run has {sorted(self.parts)}: it was "
                f"saved with another train.sparse_embeddings; resume with the setting it was saved with")
        for k, o in self.parts.items():
            o.load_state_dict(state[k])


def _target_columns(y: torch.Tensor, n: int) -> torch.Tensor:
    return y.reshape(y.shape[0], n)  # [B] (one target) or [B, T] -> [B, T]


def per_row_loss(fitted, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B] loss per row, summed over targets."""
    f = nn.functional
    ys = _target_columns(y, len(fitted.targets))
    total, at = torch.zeros(out.shape[0], device=out.device), 0
    for j, (t, k) in enumerate(zip(fitted.targets, head_widths(fitted))):
        o = out[:, at:at + k]
        if t.kind == "binary":
            total = total + f.binary_cross_entropy_with_logits(o[:, 0], ys[:, j], reduction="none")
        elif t.kind == "multiclass":
            total = total + f.cross_entropy(o, ys[:, j].long(), reduction="none")
        else:
            total = total + f.mse_loss(o[:, 0], ys[:, j], reduction="none")
        at += k
    return total


def batch_loss(fitted, out: torch.Tensor, batch) -> torch.Tensor:
    loss = per_row_loss(fitted, out, batch.y)
    if batch.w is None:
        return loss.mean()
    return (loss * batch.w).sum() / batch.w.sum().clamp_min(1e-12)


# ---------------------------------------------------------------------------------------------
# Inside each training worker


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _all_gather(value: Any) -> list[Any]:
    """For the job's own metrics only (where each rank ran): the data path needs no collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


AUC_BINS = 1 << 14  # AUC from score histograms summed over ranks: pairs within one bin count as ties


def binned_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC from the positives' and negatives' counts per score bin (ascending scores): the chance
    a random positive outscores a random negative, ties (one bin) counting half."""
    n_pos, n_neg = pos.sum(), neg.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    below = np.cumsum(neg) - neg  # negatives in lower bins
    return float((pos * (below + 0.5 * neg)).sum() / (n_pos * n_neg))


@torch.no_grad()
def evaluate(model: nn.Module, data, fitted, device: torch.device, chunk: int = 65_536) -> dict[str, float]:
    """Over every rank's validation rows, per target: accuracy beside the majority class (binary,
    multiclass) or RMSE in the target's units beside predicting the training mean (regression); for a
    binary target also ROC AUC (baseline 0.5) and log loss (baseline: predicting the training rows'
    positive rate for every row). The first target's figures are also given as val_metric / baseline."""
    model.eval()
    targets, widths = fitted.targets, head_widths(fitted)
    sums = [0.0] * (2 + len(targets))  # rows, loss, then per target: correct count or squared error
    binary = [j for j, t in enumerate(targets) if t.kind == "binary"]
    # per binary target: positive rows, log-loss sum, then the positives' and negatives' score histograms
    curves = torch.zeros((len(binary), 2 + 2 * AUC_BINS), dtype=torch.float64, device=device)
    for start in range(0, len(data), chunk):
        b = data.get_batch(torch.arange(start, min(start + chunk, len(data)))).to(device)
        out = model(b.x_num, b.x_cat)
        ys = _target_columns(b.y, len(targets))
        sums[0] += ys.shape[0]
        sums[1] += per_row_loss(fitted, out, b.y).sum().item()
        at = 0
        for j, (t, k) in enumerate(zip(targets, widths)):
            o = out[:, at:at + k]
            if t.kind == "binary":
                sums[2 + j] += ((o[:, 0] > 0).float() == ys[:, j]).sum().item()
                c, y = curves[binary.index(j)], ys[:, j]
                c[0] += y.sum()
                c[1] += nn.functional.binary_cross_entropy_with_logits(o[:, 0], y, reduction="sum")
                bins = (torch.sigmoid(o[:, 0].double()) * AUC_BINS).long().clamp_(0, AUC_BINS - 1)
                c[2:2 + AUC_BINS] += torch.bincount(bins[y > 0.5], minlength=AUC_BINS)
                c[2 + AUC_BINS:] += torch.bincount(bins[y <= 0.5], minlength=AUC_BINS)
            elif t.kind == "multiclass":
                sums[2 + j] += (o.argmax(1) == ys[:, j].long()).sum().item()
            else:
                sums[2 + j] += ((o[:, 0] - ys[:, j]).double() ** 2).sum().item()
            at += k
    model.train()
    sums = _all_reduce_sum(sums, device)
    if binary and dist.is_available() and dist.is_initialized():
        dist.all_reduce(curves)
    curves = curves.cpu().numpy()
    total = sums[0]
    if total == 0:
        return {"val_rows": 0}
    out_m: dict[str, Any] = {"val_rows": int(total), "val_loss": sums[1] / total}
    for j, t in enumerate(targets):
        name, value_key, base_key = target_keys(t.name, t.kind)
        if t.kind == "regression":
            m = fitted.stats["targets"][t.name]
            value = float(np.sqrt(sums[2 + j] / total)) * t.std  # back in the target's units
            baseline = float(m["std"])  # RMSE of predicting the training mean
        else:
            value = sums[2 + j] / total
            baseline = max(t.counts) / max(1, sum(t.counts))  # the training rows' majority class
        out_m[value_key], out_m[base_key] = value, baseline
        figures = {name: (value, baseline)}
        if t.kind == "binary":
            c = curves[binary.index(j)]
            p = min(max(t.counts[1] / max(1, sum(t.counts)), 1e-12), 1 - 1e-12)  # training positive rate
            q = c[0] / total  # validation positive rate
            figures["val_auc"] = (binned_auc(c[2:2 + AUC_BINS], c[2 + AUC_BINS:]), 0.5)
            figures["val_logloss"] = (c[1] / total, float(-(q * np.log(p) + (1 - q) * np.log(1 - p))))
        for metric, (v, base) in figures.items():
            _, vk, bk = metric_keys(t.name, metric)
            out_m[vk], out_m[bk] = v, base
            if j == 0:
                out_m[metric], out_m["baseline_" + metric.removeprefix("val_")] = v, base
        if j == 0:
            out_m.update(metric=name, val_metric=value, baseline=baseline)
    return out_m


def metric_keys(name: str, metric: str) -> tuple[str, str, str]:
    """A target's metric and its metrics.json keys: ('val_auc', 'label:val_auc', 'label:baseline_auc')."""
    return metric, f"{name}:{metric}", f"{name}:baseline_{metric.removeprefix('val_')}"


def target_keys(name: str, kind: str) -> tuple[str, str, str]:
    """A target's main metric and its metrics.json keys: ('val_acc', 'segment:val_acc', 'segment:baseline_acc')."""
    return metric_keys(name, "val_rmse" if kind == "regression" else "val_acc")


def target_metrics(name: str, kind: str) -> list[tuple[str, str, str]]:
    """Every metric reported for a target: the main one, and for a binary target AUC and log loss."""
    main = target_keys(name, kind)
    return [main] + ([metric_keys(name, "val_auc"), metric_keys(name, "val_logloss")] if kind == "binary" else [])


def target_figures(metrics: dict, targets) -> str:
    """'val_acc 0.8229 (baseline 0.5331), val_auc 0.9012 (baseline 0.5000), ...', per target ('segment:
    val_acc ...' when there are several)."""
    parts = []
    for t in targets:
        figures = ", ".join(f"{name} {metrics.get(vk, float('nan')):.4f} (baseline {metrics.get(bk, float('nan')):.4f})"
                            for name, vk, bk in target_metrics(t.name, t.kind))
        parts.append(f"{t.name + ': ' if len(targets) > 1 else ''}{figures}")
    return "; ".join(parts)


def _save_checkpoint(model: nn.Module, optimizer, loader, history: list, fitted, cfg_json: str,
                     partial: dict[str, Any] | None = None):
    """A directory holding model, optimizer and loader state, the fitted preprocessor and the config.

    partial (mid-epoch checkpoints): the epoch's sums so far over all ranks, so that a run resumed
    from it reports the whole epoch (rows, loss, timings), not only the steps after the resume."""
    from ray.train import Checkpoint

    d = tempfile.mkdtemp(prefix="ckpt-")
    inner = model.module if hasattr(model, "module") else model
    torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict(),
                "history": history, "partial": partial}, os.path.join(d, CHECKPOINT_FILE))
    fitted.save(os.path.join(d, PREPROCESSOR_FILE))  # and its vocabulary file beside it
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(cfg_json)
    return Checkpoint.from_directory(d)


def train_loop_per_worker(loop_config: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    import ray.train
    import ray.train.torch

    clock = {"loop_start": time.time()}  # wall-clock times (the driver compares them with the command's start)
    plan = loop_config["plan"]
    if not isinstance(plan, pipeline.IngestPlan):  # a PlanBox: the driver is still validating and fitting
        plan = ray.get(plan.get.remote(), timeout=loop_config["stall_timeout_s"])
        if plan is None:  # the driver's prepare failed; it reports why, in one paragraph
            return []
    clock["plan_ready"] = time.time()
    cfg, fitted = plan.config, plan.fitted
    ckpt = ray.train.get_checkpoint()
    state = None
    if ckpt is not None:  # read first: the loader goes on from it on however many workers this run has
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location="cpu", weights_only=False)
    data = pipeline.rank_data(plan, resume=state["loader"] if state else None)
    plan = data.plan  # planned for the workers this run has (elastic: fewer or more than the plan was made for)
    rank, world, device, loader = data.rank, data.world_size, data.device, data.loader
    print(data.describe(), flush=True)
    clock["data_ready"] = time.time()
    t = cfg.train
    node_ids = _all_gather(ray.get_runtime_context().get_node_id())  # where each rank runs, by rank
    local_rows = [int(v) for v in _all_gather(data.rows_local)]
    share_rows = [a + b for a, b in zip(plan.train_sizes, plan.val_sizes)] if not plan.global_shuffle else \
        [plan.train_rows + v for v in plan.val_sizes]

    torch.manual_seed(t.seed)  # identical initial weights on every rank (DDP broadcasts rank 0's anyway)
    sparse = sparse_embeddings(fitted, cfg, device.type == "cuda")
    model = ray.train.torch.prepare_model(build_model(fitted, cfg, sparse))
    optimizer = Optimizers(model, cfg, sparse)
    history: list[dict[str, Any]] = []
    partial: dict[str, Any] | None = None  # the resumed epoch's sums before the checkpoint

    if state is not None:
        (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # rank_data's loader already went on from state["loader"]
        history = state["history"]
        partial = state.get("partial")

    if rank == 0:
        sizes = plan.train_sizes
        # a plain epoch's steps (a resumed one may have fewer): every rank the same, see pipeline.BatchSampler
        steps = min(sizes) // t.batch_size if t.drop_last else -(-max(sizes) // t.batch_size)
        dropped = sum(max(0, n - steps * t.batch_size) for n in sizes) if t.drop_last else 0
        print(f"[train] {world} worker(s) on {device.type}, placement={loader.placement}; training rows per rank "
              f"{sizes}; {steps} steps/epoch of {t.batch_size}; drop_last remainder {dropped} rows/epoch", flush=True)

    cfg_json = json.dumps(cfg.to_dict())
    trace = open(os.path.join(loop_config["run_dir"], f"trace-rank{rank}.txt"), "a") \
        if t.trace_batches and loop_config.get("run_dir") else None
    # The row ids themselves, with the epoch's position after the step (rows all ranks consumed, the same on
    # any world size) and the time: what a check of every row once per epoch across restarts and resizes reads.
    ids_out = open(os.path.join(loop_config["run_dir"], f"ids-rank{rank}.txt"), "a") if trace is not None else None
    every = t.checkpoint_every_steps
    start_epoch = loader.state_dict()["epoch"]
    for epoch in range(start_epoch, t.epochs):
        loader.set_epoch(epoch)
        stats = StepStats()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        # Resumed mid-epoch: the steps before the checkpoint count too. The sums are over all ranks, so
        # only rank 0 adds them (the all-reduce below adds up the ranks); the elapsed time every rank.
        resumed = partial if partial is not None and partial["epoch"] == epoch else None
        carried = resumed["sums"] if resumed and rank == 0 else [0.0] * 5  # loss, steps, rows, wait, busy
        carried_wall = resumed["wall"] if resumed else 0.0
        partial = None
        t0 = time.perf_counter()
        for batch in timed(loader, stats):
            loss = batch_loss(fitted, model(batch.x_num, batch.x_cat), batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if "first_step" not in clock:
                loss.item()  # the step's work is done (on a GPU too) before the time is taken, once
                clock["first_step"] = time.time()
            loss_sum += loss.detach()  # no .item() per step: that would sync the GPU every batch
            step = loader.delivered  # batches of this epoch so far (no dict built per step)
            if trace is not None:
                ids = data.train.row_id[loader.last_index.cpu()].numpy()
                trace.write(f"{epoch} {step} {hashlib.sha1(ids.tobytes()).hexdigest()[:16]}\n")
                trace.flush()
                ids_out.write(f"{time.time():.6f} {epoch} {loader.state_dict()['position']} {world} {os.getpid()} "
                              f"{' '.join(map(str, ids.tolist()))}\n")
                ids_out.flush()
            if every and step % every == 0 and step < len(loader):  # mid-epoch: every rank reports (a collective)
                # The epoch so far over all ranks, this step included (`timed` counts it when the body ends).
                sums = _all_reduce_sum([loss_sum.item() + carried[0], stats.steps + 1 + carried[1],
                                        stats.rows + batch.x_num.shape[0] + carried[2], stats.data_wait_s + carried[3],
                                        stats.total_s + carried[4]], device)
                mid = {"epoch": epoch, "sums": sums, "wall": time.perf_counter() - t0 + carried_wall}
                ckpt_mid = _save_checkpoint(model, optimizer, loader, history, fitted, cfg_json, mid) \
                    if rank == 0 else None
                ray.train.report({"epoch": epoch, "step": step, "mid_epoch": True}, checkpoint=ckpt_mid)
        wall = time.perf_counter() - t0 + carried_wall
        loss_total, steps, rows, wait, busy = _all_reduce_sum(
            [loss_sum.item() + carried[0], stats.steps + carried[1], stats.rows + carried[2],
             stats.data_wait_s + carried[3], stats.total_s + carried[4]], device)
        metrics = {"epoch": epoch + 1, "train_loss": loss_total / max(1, steps), "rows": int(rows),
                   "rows_per_s": rows / max(wall, 1e-9), "data_wait_pct": 100.0 * wait / max(busy, 1e-9),
                   "epoch_s": wall, "node_ids": node_ids, "clock": dict(clock), "share_rows": share_rows, "share_rows_local": local_rows,
                   **evaluate(model, data.val, fitted, device)}
        history.append(metrics)
        if rank == 0:
            print(f"[train] epoch {metrics['epoch']}/{t.epochs}  loss {metrics['train_loss']:.4f}  "
                  f"{target_figures(metrics, fitted.targets)}  {metrics['rows_per_s']:,.0f} rows/s  "
                  f"data wait {metrics['data_wait_pct']:.1f}% of step time", flush=True)
        checkpoint = _save_checkpoint(model, optimizer, loader, history, fitted, cfg_json) if rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)
    return history


# ---------------------------------------------------------------------------------------------
# On the driver


def plan_run(cfg: Config, out_uri: str, use_ray: bool | None = None) -> "pipeline.IngestPlan":
    plan = prepare_run(cfg, out_uri, cfg.train.workers, use_ray=use_ray)
    if not plan.accounting.balanced:
        raise DataError(f"row accounting does not balance: {plan.accounting.summary()}; was data.path modified "
                        f"during the run?")
    return plan


def workers_beside_fit(cfg: Config) -> bool:
    """run.start_workers. auto: measured on a 2-core machine with 2 workers, starting them beside the
    fit made both slower (fit 2.8 -> 3.9 s, workers 7.7 -> 10.5 s) for no gain; with cores to spare the
    fit's seconds disappear behind the workers' start-up."""
    if cfg.run.start_workers == "auto":
        return cfg.loader.read_share == "worker" and (os.cpu_count() or 1) > cfg.train.workers + 1
    return cfg.run.start_workers == "beside_fit"


def fit_beside(trainer, box, make_plan: Callable[[], "pipeline.IngestPlan"]):
    """trainer.fit() in a thread while make_plan() runs here; the plan goes into the box the workers
    wait on. A failed make_plan raises at once (the workers find None in the box and end)."""
    fit = Background(trainer.fit)
    try:
        plan = make_plan()
    except BaseException:
        box.put.remote(None)
        raise
    box.put.remote(plan)
    return plan, fit.result()


class Background:
    """fn(*args) in a daemon thread (a failure while Ray starts ends the command without waiting for
    it); result() re-raises its exception in the caller's thread."""

    def __init__(self, fn: Callable, *args) -> None:
        import threading

        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name="plan", daemon=True)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self._out["result"] = fn(*args)
        except BaseException as e:  # re-raised by result(), in the caller's thread
            self._out["error"] = e

    def result(self):
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)  # in slices, so that Ctrl-C reaches the main thread
        if "error" in self._out:
            raise self._out["error"]
        return self._out["result"]


class PlanBox:
    """Hands the IngestPlan to training workers that were started before it existed, so that Ray
    Train's worker group (several seconds: a controller and a process per rank, each importing torch)
    starts while the driver validates and fits. A Ray actor (num_cpus=0) owned by the driver: if the
    driver dies, so does the box, and a waiting worker's get() fails instead of waiting."""

    def __init__(self) -> None:
        import asyncio

        self._ready, self._plan = asyncio.Event(), None

    async def put(self, plan) -> None:  # None: prepare failed, the workers end at once
        self._plan = plan
        self._ready.set()

    async def get(self):
        await self._ready.wait()
        return self._plan


def run_name(cfg: Config) -> str:
    """A fresh folder per run, unless resuming: re-running a command never silently continues an old run."""
    return cfg.run.name if cfg.run.resume else f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


RESUME_KEYS = ("batch_size", "seed", "shuffle", "drop_last")  # any number of workers resumes (sampler.py)


def check_resume(cfg: Config, out_uri: str) -> None:
    """With run.resume, refuse up front (not inside every worker, after Ray Train retries) a run whose
    settings could not continue the checkpoint's batch order exactly."""
    snapshot = storage.join(out_uri, "checkpoint_manager_snapshot.json")
    if not cfg.run.resume or not storage.exists(*storage.filesystem(snapshot)):
        return
    latest = (storage.read_json(snapshot) or {}).get("latest_checkpoint_result") or {}
    if not latest.get("checkpoint_dir_name"):
        return
    saved_uri = storage.join(out_uri, latest["checkpoint_dir_name"], "config.json")
    saved = Config.model_validate(storage.read_json(saved_uri))
    diff = [f"train.{k} = {getattr(saved.train, k)!r} there, {getattr(cfg.train, k)!r} now" for k in RESUME_KEYS
            if getattr(saved.train, k) != getattr(cfg.train, k)]
    if diff:
        raise PipelineError(f"cannot resume run '{out_uri}' exactly: its last checkpoint ({saved_uri}) was written "
                            f"with {'; '.join(diff)}. Each rank's rows and batch order depend on these, so the run "
                            f"would not continue where it stopped. Resume with the checkpoint's values, or start a new "
                            f"run (run.resume = false)")


def check_elastic(cfg: Config, scaling_config: type, ray_version: str) -> bool:
    """Whether the run is elastic (train.num_workers = [min, max]); refused in one paragraph where this
    Ray Train has no elastic ScalingConfig."""
    lo, hi = cfg.train.workers_range
    if lo != hi and not hasattr(scaling_config, "elasticity_enabled"):  # Ray Train V2's elastic ScalingConfig
        raise PipelineError(f"train.num_workers = {[lo, hi]} asks for elastic training, which Ray Train has from Ray "
                            f"2.60 (ScalingConfig(num_workers=(min, max))); this is Ray {ray_version}. Upgrade Ray, "
                            f"or give train.num_workers one number")
    return lo != hi


def check_cluster_fits(workers: int, use_gpu: bool) -> None:
    """Stop at once, in one paragraph, when the cluster could never place the training workers (Ray
    Train would wait for them forever)."""
    import ray

    kind = "GPU" if use_gpu else "CPU"  # a GPU worker takes one GPU and no CPU; a CPU worker one CPU
    total = ray.cluster_resources().get(kind, 0.0)
    if total < workers:
        raise PipelineError(f"train.num_workers = {workers} needs {workers} {kind}s (one per training worker) but the "
                            f"Ray cluster has {total:g}; lower train.num_workers to {int(total) or 1}, "
                            + ("or set train.use_gpu = false" if use_gpu else "or give the local Ray more CPUs "
                               "(run.num_cpus) or join a larger cluster (run.ray_address)"))
    if not use_gpu and total == workers:
        print(f"[train] the {workers} training workers take all {total:g} CPUs of the cluster: each rank reads and "
              f"transforms its share inside its own worker process", flush=True)


def prepare_run(cfg: Config, out_uri: str, world_size: int, use_ray: bool | None = None) -> "pipeline.IngestPlan":
    """Validate, fit (or, resuming, reuse the run's preprocessor), plan; save the preprocessor and the
    quarantine manifest to the run folder and print what was decided."""
    saved = storage.join(out_uri, PREPROCESSOR_FILE)
    earlier = cfg.run.resume and storage.exists(*storage.filesystem(saved))
    manifest = storage.join(out_uri, QUARANTINE_FILE)
    try:
        plan = pipeline.prepare(config=cfg, world_size=world_size, fitted=saved if earlier else None, use_ray=use_ray)
    except NoUsableRows as e:  # nothing to train on: the manifest still says what was set aside, and why
        if not e.manifest_jsonl:
            raise
        storage.write_text(manifest, e.manifest_jsonl)
        raise DataError(f"{e} Every file and row group set aside is listed in {manifest}", e.details) from None
    if earlier:
        print(f"[fit] resuming: using the preprocessor fitted earlier, {saved}", flush=True)
    else:
        plan.fitted.save(saved)
    fit_json = storage.join(out_uri, FIT_FILE)
    plan.save_fit(fit_json)  # `--run.fit_from` this file skips the fit pass next time, while the data is unchanged
    if plan.accounting.quarantined:
        storage.write_text(manifest, plan.accounting.manifest_jsonl())
    lines = plan.describe()
    lines[2] += f"; manifest {manifest}" if plan.accounting.quarantined else ""
    print("\n".join(lines) + f"\n[fit] saved {saved} and {fit_json} (reuse it with --run.fit_from)", flush=True)
    return plan


def first_step_line(started: float, ray_s: float, plan, history: list) -> tuple[str, dict]:
    """'[time] first training step N s after the command started: ...' and its figures. started: the
    command's wall-clock start; the workers' clock marks come from rank 0's first epoch. Stages that
    ran at the same time are said together, with the seconds until both were done."""
    clock = history[0].get("clock", {}) if history else {}
    if "first_step" not in clock:
        return "", {}
    t = plan.timings
    ready = clock.get("plan_ready", clock["loop_start"])  # the rank had both its process and the plan
    beside = t["trainer_started_at"] < t["planned_at"]  # the workers started while the driver fitted
    ray_span = t.get("ray_span")  # Ray started while the driver validated and fitted
    total = clock["first_step"] - started
    fig = {"start Ray": ray_s, "validate": t["validate_s"], "fit pass": t["fit_s"],
           "start the training workers": clock["loop_start"] - t["trainer_started_at"]}
    if ray_span:
        fig["Ray and the plan both ready"] = max(ray_span[1], t["planned_at"]) - ray_span[0]
    if beside:
        fig["plan and workers both ready"] = ready - t["trainer_started_at"]
    fig["read this rank's share"] = clock["data_ready"] - ready
    fig["first step (model, DDP, one batch)"] = clock["first_step"] - clock["data_ready"]
    s = {k: f"{k} {v:.1f}s" for k, v in fig.items()}
    fit = f"{s['validate']} + {s['fit pass']}"
    if ray_span and beside:  # Ray, then the workers, both while the driver fitted
        said = [f"{s['start Ray']} beside {fit}",
                f"{s['start the training workers']} beside the rest of the fit "
                f"({fig['plan and workers both ready']:.1f}s for both)"]
        path = ["start Ray", "plan and workers both ready"]
    elif ray_span:
        said = [f"{s['start Ray']} beside {fit} ({fig['Ray and the plan both ready']:.1f}s for both)",
                s["start the training workers"]]
        path = ["Ray and the plan both ready", "start the training workers"]
    elif beside:
        said = [s["start Ray"], f"{fit} beside {s['start the training workers']} "
                                f"({fig['plan and workers both ready']:.1f}s for both)"]
        path = ["start Ray", "plan and workers both ready"]
    else:
        said = [s["start Ray"], s["validate"], s["fit pass"], s["start the training workers"]]
        path = ["start Ray", "validate", "fit pass", "start the training workers"]
    path += ["read this rank's share", "first step (model, DDP, one batch)"]
    fig["other (imports, config)"] = total - sum(fig[k] for k in path)
    said += [s["read this rank's share"], s["first step (model, DDP, one batch)"],
             f"other (imports, config) {fig['other (imports, config)']:.1f}s"]
    line = f"[time] first training step {total:.1f}s after the command started: " + ", ".join(said)
    return line, {"total_s": round(total, 2), **{k: round(v, 2) for k, v in fig.items()}}


def run(cfg: Config, started: float | None = None, ray_s: float = 0.0,
        start_ray: Callable[[Config], None] | None = None, starts_private_ray: bool = False) -> dict[str, Any]:
    """The whole job; returns the summary that is also written to <output>/<name>/metrics.json.
    start_ray(cfg), when given, connects to or starts Ray (the CLI's runtime.init_ray). When it starts
    a private local Ray (starts_private_ray) and the fit runs in this process (run.fit_on local, or
    auto on that one node), the fit needs no Ray and runs while Ray starts: Ray's processes spend most
    of their seconds being spawned and importing, the fit's threads in pyarrow and numpy."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not cfg.data.targets:
        raise PipelineError("data.label is empty, so there is nothing for the built-in train job to learn; name the "
                            "target column(s) with data.label, or read unlabelled rows through pipeline.prepare and "
                            "pipeline.rank_data in your own loop (docs/api.md)")
    name = run_name(cfg)
    out_uri = storage.join(cfg.run.output, name)
    t_start = time.perf_counter()
    started = started or time.time()
    check_resume(cfg, out_uri)
    early = None  # the plan, made while Ray starts
    if start_ray is not None:
        if starts_private_ray and cfg.run.fit_on != "ray":
            early = Background(plan_run, cfg, out_uri, False)
        t0 = time.time()
        start_ray(cfg)
        ray_s = time.time() - t0
        if early is not None:
            early.ray_span = (t0, t0 + ray_s)
    use_gpu = cfg.train.use_gpu == "true" or (cfg.train.use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
    check_cluster_fits(cfg.train.workers_range[0], use_gpu)
    elastic = check_elastic(cfg, ScalingConfig, ray.__version__)
    # Ray Train writes through the filesystem pipeline.storage builds (same endpoint, addressing style
    # and credentials as every other read and write), pickled to its controller and workers.
    storage_path, storage_filesystem = storage.ray_storage(cfg.run.output)

    def trainer(plan, **data) -> TorchTrainer:
        return TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"plan": plan, "stall_timeout_s": cfg.run.stall_timeout_s,
                               "run_dir": os.path.abspath(out_uri) if storage.is_local(out_uri) else None},
            scaling_config=ScalingConfig(num_workers=cfg.train.workers_range if elastic else cfg.train.workers,
                                         **({"elastic_resize_monitor_interval_s": cfg.train.elastic_resize_s}
                                            if elastic else {}),
                                         use_gpu=use_gpu,
                                         resources_per_worker=None if use_gpu else {"CPU": 1},
                                         placement_strategy=cfg.train.placement_strategy),
            run_config=RunConfig(name=name, storage_path=storage_path, storage_filesystem=storage_filesystem,
                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                 failure_config=FailureConfig(max_failures=cfg.train.max_failures)),
            **data)

    if workers_beside_fit(cfg):
        # The trainer needs nothing from the plan but the plan itself (the ranks read their own shares),
        # so Ray Train starts its workers now and they take the plan from a PlanBox once it exists.
        box = ray.remote(num_cpus=0)(PlanBox).remote()
        started_at = time.time()
        plan, result = fit_beside(trainer(box), box, early.result if early else lambda: plan_run(cfg, out_uri))
    else:  # ray_data: the plan's DataConfig is part of the trainer, so the plan comes first
        plan = early.result() if early else plan_run(cfg, out_uri)
        started_at = time.time()
        result = trainer(plan, **plan.trainer_kwargs(cpus_per_worker=0.0 if use_gpu else 1.0)).fit()
    plan.timings["trainer_started_at"] = started_at
    if early is not None:
        plan.timings["ray_span"] = early.ray_span
    acct = plan.accounting
    history = getattr(result, "return_value", None) or []  # Ray 2.52 has no return_value: then the last checkpoint's
    if not history and result.checkpoint is not None:
        with result.checkpoint.as_directory() as d:
            history = torch.load(os.path.join(d, CHECKPOINT_FILE), weights_only=False)["history"]
    summary = {"run": out_uri, "rows_read": acct.rows_read, "accounting": acct.as_dict(),
               "accounting_summary": acct.summary(), "epochs": history,
               "coverage": plan.fitted.stats.get("categorical", {}),
               "targets": [{"name": t.name, "kind": t.kind, "classes": len(t.classes)} for t in plan.fitted.targets],
               "checkpoint": storage.to_uri(result.checkpoint.filesystem, result.checkpoint.path) if result.checkpoint else None,
               "preprocessor": storage.join(out_uri, PREPROCESSOR_FILE), "use_gpu": use_gpu,
               "wall_s": round(time.perf_counter() - t_start, 2)}
    line, figures = first_step_line(started, ray_s, plan, history) if not cfg.run.resume else ("", {})
    if line:
        print(line, flush=True)
        summary["time_to_first_step"] = figures
    storage.write_json(storage.join(out_uri, "metrics.json"), summary)
    return summary
