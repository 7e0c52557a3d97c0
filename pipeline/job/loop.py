"""The built-in job's loop in each Ray Train worker: `rank_data`, the model, the epochs, mid-epoch
checkpoints and the batch traces the tests read."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

import torch
from torch import nn

import pipeline
from pipeline import StepStats, timed

from .evaluate import _all_gather, _all_reduce_sum, evaluate, target_figures
from .model import Optimizers, batch_loss, build_model, sparse_embeddings
from .warm import growth, previous_run, warm_model


CHECKPOINT_FILE = "state.pt"
PREPROCESSOR_FILE = "preprocessor.json"
QUARANTINE_FILE = "quarantine.jsonl"
FIT_FILE = "fit.json"


def _report(metrics: dict[str, Any], save: bool, model: nn.Module, optimizer, loader, history: list, fitted,
            cfg_json: str, partial: dict[str, Any] | None = None) -> None:
    """ray.train.report on every rank; with save (rank 0), a checkpoint directory holding model, optimizer and
    loader state, the fitted preprocessor and the config. The directory is temporary: Ray Train copies it into
    the run's storage during report, and it is removed right after (a worker's /tmp does not fill with copies).

    partial (mid-epoch checkpoints): the epoch's sums so far over all ranks, so that a run resumed
    from it reports the whole epoch (rows, loss, timings), not only the steps after the resume."""
    import ray.train
    from ray.train import Checkpoint

    if not save:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ckpt-") as d:
        inner = model.module if hasattr(model, "module") else model
        torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict(),
                    "history": history, "partial": partial}, os.path.join(d, CHECKPOINT_FILE))
        fitted.save(os.path.join(d, PREPROCESSOR_FILE))  # and its vocabulary file beside it
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(cfg_json)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


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
    if plan.empty:  # an increment with nothing new (started beside the fit): the previous model stands
        return []
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
    history: list[dict[str, Any]] = []
    partial: dict[str, Any] | None = None  # the resumed epoch's sums before the checkpoint
    if state is None and cfg.run.since:  # day k: yesterday's final model and optimizer, grown to today's ids
        prev = previous_run(cfg.run.since)
        grown = growth(prev["plan"].fitted, fitted)
        warm = {"checkpoint": prev["checkpoint"], "before": [b for b, _, _ in grown.values()],
                "after": [a for _, a, _ in grown.values()], "tail": [x for _, _, x in grown.values()]}
        model, optimizer, sparse = warm_model(warm, fitted, cfg, device, build_model, Optimizers)
        model = ray.train.torch.prepare_model(model)
    else:  # a resumed run continues with the table's optimizer it was saved with
        sparse = "sparse" in state["optimizer"] if state is not None else \
            sparse_embeddings(fitted, cfg, device.type == "cuda")
        model = ray.train.torch.prepare_model(build_model(fitted, cfg, sparse))
        optimizer = Optimizers(model, cfg, sparse)

    if state is not None:
        (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # rank_data's loader already went on from state["loader"]
        history = state["history"]
        partial = state.get("partial")
        if rank == 0:
            at = state["loader"]
            print(f"[train] resumed from {ckpt.path}: epoch {at['epoch']}, position {at['position']} (rows of the "
                  f"epoch already trained), metrics of {len(history)} epoch(s) before it", flush=True)

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
    if ids_out is not None:  # where this attempt starts (a line without ids): what it trains from here on
        ids_out.write(f"{time.time():.6f} {start_epoch} {loader.state_dict()['position']} {world} {os.getpid()}\n")
        ids_out.flush()
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
            # mid-epoch: every rank reports (a collective). Never at the epoch's last step: the loader's state is
            # then the next epoch's start, which must come with this epoch's metrics (the end-of-epoch checkpoint
            # below). len(loader) counts the steps of the epoch being delivered (of its re-dealt rest after a
            # resize) even once the loader has gathered ahead into the next epoch.
            if every and step % every == 0 and step < len(loader):
                # The epoch so far over all ranks, this step included (`timed` counts it when the body ends).
                sums = _all_reduce_sum([loss_sum.item() + carried[0], stats.steps + 1 + carried[1],
                                        stats.rows + batch.x_num.shape[0] + carried[2], stats.data_wait_s + carried[3],
                                        stats.total_s + carried[4]], device)
                mid = {"epoch": epoch, "sums": sums, "wall": time.perf_counter() - t0 + carried_wall}
                _report({"epoch": epoch, "step": step, "mid_epoch": True}, rank == 0, model, optimizer, loader,
                        history, fitted, cfg_json, mid)
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
        _report(metrics, rank == 0, model, optimizer, loader, history, fitted, cfg_json)
    return history
