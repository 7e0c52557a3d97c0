"""The Ray Train job: fit the preprocessing, hand each rank its rows, train an MLP with DDP.

Driver: validate shards -> one distributed fit pass -> plan each rank's share of the usable rows ->
TorchTrainer. Once the workers are placed, each rank's share is read and transformed by Ray Data
tasks on the rank's own node and materialised once into a TabularDataset; from then on the hot loop
is torch only (DeviceLoader), and Ray is touched again only to report metrics and checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import preprocess, source, storage
from .config import Config
from .dataset import TabularDataset
from .errors import DataError, PipelineError
from .loader import DeviceLoader
from .metrics import StepStats, timed
from .preprocess import FittedPreprocessor, rank_bounds
from .sampler import BatchSampler

CHECKPOINT_FILE = "state.pt"
PREPROCESSOR_FILE = "preprocessor.json"
QUARANTINE_FILE = "quarantine.jsonl"


class TabularMLP(nn.Module):
    """Standardised numeric features + one embedding per categorical column -> MLP -> one logit."""

    def __init__(self, num_features: int, cardinalities: tuple[int, ...], embedding_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        # One table for all categorical columns, each column's ids shifted into its own range:
        # a single embedding lookup per batch instead of one per column.
        self.register_buffer("offsets", torch.tensor([0, *np.cumsum(cardinalities)[:-1]], dtype=torch.int64)
                             if cardinalities else torch.zeros(0, dtype=torch.int64), persistent=False)
        self.embedding = nn.Embedding(max(1, sum(cardinalities)), embedding_dim)
        width = num_features + embedding_dim * len(cardinalities)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        parts = [x_num]
        if x_cat.shape[1]:
            parts.append(self.embedding(x_cat + self.offsets).flatten(1))
        return self.mlp(torch.cat(parts, dim=1)).squeeze(1)


def build_model(fitted: FittedPreprocessor, cfg: Config) -> TabularMLP:
    return TabularMLP(fitted.num_features, fitted.cardinalities, cfg.train.embedding_dim, cfg.train.hidden)


# ---------------------------------------------------------------------------------------------
# Inside each training worker


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _all_gather(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _all_gather_int(value: int) -> list[int]:
    return [int(v) for v in _all_gather(value)]


@torch.no_grad()
def evaluate(model: nn.Module, data: TabularDataset, device: torch.device, chunk: int = 65_536) -> dict[str, float]:
    """Accuracy over every rank's validation rows, beside the majority-class baseline."""
    model.eval()
    correct = total = positives = 0.0
    loss_sum = 0.0
    for start in range(0, len(data), chunk):
        b = data.get_batch(torch.arange(start, min(start + chunk, len(data)))).to(device)
        logits = model(b.x_num, b.x_cat)
        loss_sum += nn.functional.binary_cross_entropy_with_logits(logits, b.y, reduction="sum").item()
        correct += ((logits > 0).float() == b.y).sum().item()
        positives += b.y.sum().item()
        total += b.y.numel()
    model.train()
    correct, total, positives, loss_sum = _all_reduce_sum([correct, total, positives, loss_sum], device)
    if total == 0:
        return {"val_rows": 0}
    return {"val_rows": int(total), "val_loss": loss_sum / total, "val_acc": correct / total,
            "baseline_acc": max(positives, total - positives) / total}


def _save_checkpoint(model: nn.Module, optimizer, loader: DeviceLoader, history: list, fitted_json: str, cfg_json: str,
                     partial: dict[str, Any] | None = None):
    """A directory holding model, optimizer and loader state, the fitted preprocessor and the config.

    partial (mid-epoch checkpoints): the epoch's sums so far over all ranks, so that a run resumed
    from it reports the whole epoch (rows, loss, timings), not only the steps after the resume."""
    from ray.train import Checkpoint

    d = tempfile.mkdtemp(prefix="ckpt-")
    inner = model.module if hasattr(model, "module") else model
    torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict(),
                "history": history, "partial": partial}, os.path.join(d, CHECKPOINT_FILE))
    with open(os.path.join(d, PREPROCESSOR_FILE), "w") as f:
        f.write(fitted_json)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(cfg_json)
    return Checkpoint.from_directory(d)


def train_loop_per_worker(loop_config: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    import ray.train
    import ray.train.torch

    from .runtime import quiet_ray_data

    quiet_ray_data(progress=False)
    cfg = Config.model_validate(loop_config["config"])
    fitted = FittedPreprocessor.from_dict(loop_config["fitted"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    t = cfg.train
    node_ids = _all_gather(ray.get_runtime_context().get_node_id())  # where each rank runs, by rank

    full, local = receive_share(ray.train.get_dataset_shard("train"), loop_config["share_rows"][rank], rank, cfg,
                                fitted.num_features + len(fitted.categorical) + 1, ctx.get_local_world_size())
    local_rows = _all_gather_int(local)  # rows each rank's share had transformed on the rank's own node
    train_ds, val_ds = full.split_holdout(cfg.data.val_fraction, t.seed)
    del full
    if t.shuffle == "global":  # every rank holds all rows; the sampler deals a new share each epoch
        sizes = rank_sizes(len(train_ds), world)
        lo, hi = rank_bounds(len(val_ds), world, rank)
        val_ds = val_ds.subset(torch.arange(lo, hi))
        sampler = BatchSampler(sizes[rank], t.batch_size, seed=t.seed, shuffle=True, drop_last=t.drop_last,
                               rank=rank, rank_sizes=sizes, global_rows=len(train_ds))
    else:
        sizes = _all_gather_int(len(train_ds))
        sampler = BatchSampler(len(train_ds), t.batch_size, seed=t.seed, shuffle=t.shuffle == "local",
                               drop_last=t.drop_last, rank=rank, rank_sizes=sizes)
    loader = DeviceLoader(train_ds, sampler, device, placement=cfg.loader.placement, prefetch=cfg.loader.prefetch,
                          device_memory_fraction=cfg.loader.device_memory_fraction,
                          chunk_bytes=int(cfg.loader.chunk_mib * 2**20))

    torch.manual_seed(t.seed)  # identical initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = ray.train.torch.prepare_model(build_model(fitted, cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    history: list[dict[str, Any]] = []
    partial: dict[str, Any] | None = None  # the resumed epoch's sums before the checkpoint

    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=False)
        (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict({**state["loader"], "rank": rank})
        history = state["history"]
        partial = state.get("partial")

    if rank == 0:
        dropped = sum(max(0, s - sampler.steps * t.batch_size) for s in sizes) if t.drop_last else 0
        print(f"[train] {world} worker(s) on {device.type}, placement={loader.placement}; rows per rank {sizes}; "
              f"{len(loader)} steps/epoch of {t.batch_size}; drop_last remainder {dropped} rows/epoch", flush=True)

    fitted_json, cfg_json = json.dumps(fitted.to_dict()), json.dumps(cfg.to_dict())
    loss_fn = nn.BCEWithLogitsLoss()
    trace = open(os.path.join(loop_config["run_dir"], f"trace-rank{rank}.txt"), "a") \
        if t.trace_batches and loop_config.get("run_dir") else None
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
            logits = model(batch.x_num, batch.x_cat)
            loss = loss_fn(logits, batch.y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()  # no .item() per step: that would sync the GPU every batch
            step = loader.delivered  # batches of this epoch so far (no dict built per step)
            if trace is not None:
                ids = train_ds.row_id[loader.last_index.cpu()].numpy()
                trace.write(f"{epoch} {step} {hashlib.sha1(ids.tobytes()).hexdigest()[:16]}\n")
                trace.flush()
            if every and step % every == 0 and step < len(loader):  # mid-epoch: every rank reports (a collective)
                # The epoch so far over all ranks, this step included (`timed` counts it when the body ends).
                sums = _all_reduce_sum([loss_sum.item() + carried[0], stats.steps + 1 + carried[1],
                                        stats.rows + batch.y.shape[0] + carried[2], stats.data_wait_s + carried[3],
                                        stats.total_s + carried[4]], device)
                mid = {"epoch": epoch, "sums": sums, "wall": time.perf_counter() - t0 + carried_wall}
                ckpt_mid = _save_checkpoint(model, optimizer, loader, history, fitted_json, cfg_json, mid) \
                    if rank == 0 else None
                ray.train.report({"epoch": epoch, "step": step, "mid_epoch": True}, checkpoint=ckpt_mid)
        wall = time.perf_counter() - t0 + carried_wall
        loss_total, steps, rows, wait, busy = _all_reduce_sum(
            [loss_sum.item() + carried[0], stats.steps + carried[1], stats.rows + carried[2],
             stats.data_wait_s + carried[3], stats.total_s + carried[4]], device)
        metrics = {"epoch": epoch + 1, "train_loss": loss_total / max(1, steps), "rows": int(rows),
                   "rows_per_s": rows / max(wall, 1e-9), "data_wait_pct": 100.0 * wait / max(busy, 1e-9),
                   "epoch_s": wall, "node_ids": node_ids,
                   "share_rows": loop_config["share_rows"], "share_rows_local": local_rows, **evaluate(model, val_ds, device)}
        history.append(metrics)
        if rank == 0:
            print(f"[train] epoch {metrics['epoch']}/{t.epochs}  loss {metrics['train_loss']:.4f}  "
                  f"val_acc {metrics.get('val_acc', float('nan')):.4f} (majority baseline "
                  f"{metrics.get('baseline_acc', float('nan')):.4f})  {metrics['rows_per_s']:,.0f} rows/s  "
                  f"data wait {metrics['data_wait_pct']:.1f}% of step time", flush=True)
        checkpoint = _save_checkpoint(model, optimizer, loader, history, fitted_json, cfg_json) if rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)
    return history


# ---------------------------------------------------------------------------------------------
# On the driver


def rank_sizes(n: int, world: int) -> list[int]:
    return [hi - lo for lo, hi in (rank_bounds(n, world, r) for r in range(world))]


def make_data_config(src, fitted: FittedPreprocessor, cfg: Config, shares: list, cpus_per_worker: float = 1.0):
    """Each rank's Ray Dataset: its planned share of the rows (see preprocess.plan_shares: a pure
    function of the data and the world size, so which rows a rank owns is reproducible), read and
    transformed by Ray Data tasks pinned to the node that rank runs on (soft node affinity), so the
    transformed blocks are produced in that node's object store and never cross the network. Ray's
    own streaming_split is locality-aware too, but which rows it hands a rank depends on where
    blocks happen to be, which would make the order irreproducible."""
    from ray.train import DataConfig

    class LocalShareSplit(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            if world_size != len(shares):
                raise RuntimeError(f"planned shares for {len(shares)} workers, Ray Train started {world_size}")
            spare = _spare_cpus(worker_node_ids, cpus_per_worker)
            out = []
            for r in range(world_size):
                node = worker_node_ids[r] if worker_node_ids else None
                # A node with no CPU beside its training workers cannot transform anything: no affinity.
                cpus = spare.get(node, 0) // max(1, worker_node_ids.count(node)) if node else 0
                part = preprocess.transform_pieces(src, fitted, cfg, shares[r], node_id=node if cpus >= 1 else None,
                                                   node_cpus=cpus)
                part.context.enable_progress_bars = False  # a worker's read of its share takes seconds
                out.append({"train": part.iterator()})
            return out

    return LocalShareSplit()


def _spare_cpus(worker_node_ids, cpus_per_worker: float) -> dict[str, int]:
    """CPUs each training node has beside the training workers placed on it (totals from the GCS)."""
    import ray

    if not worker_node_ids:
        return {}
    totals = {n["NodeID"]: n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")}
    return {node: int(totals.get(node, 0) - cpus_per_worker * worker_node_ids.count(node)) for node in set(worker_node_ids)}


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
    """(directory for a memory-mapped share or None for RAM, and why) per loader.spill. The share is
    held twice for a moment (whole, then split into training and validation rows), by every rank on
    the node."""
    need, avail = 2 * rows * width * 4 * ranks_on_node, available_memory()
    spill = cfg.loader.spill == "always" or (cfg.loader.spill == "auto" and 0 < avail < 2 * need)
    if not spill:
        return None, "in memory"
    d = cfg.loader.spill_dir or os.path.join(tempfile.gettempdir(), "pipeline-spill")
    why = "loader.spill = always" if cfg.loader.spill == "always" else \
        f"{need / 2**30:.1f} GiB needed, {avail / 2**30:.1f} GiB available"
    return d, f"memory-mapped from files in {d} ({why})"


def receive_share(iterator, expected_rows: int, rank: int, cfg: Config, width: int,
                  ranks_on_node: int = 1) -> tuple[TabularDataset, int]:
    """Materialise this rank's share once (epochs then never touch Ray), in memory or memory-mapped
    from local disk (loader.spill), check that it holds exactly the planned number of rows, and say
    how much of it was transformed on this node."""
    spill_dir, where = spill_dir_for(cfg, expected_rows, width, ranks_on_node)
    t0 = time.perf_counter()
    blocks = list(iterator.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2))
    n = sum(len(b["y"]) for b in blocks)
    local = sum(int(b["local"].sum()) for b in blocks)
    if n != expected_rows:
        raise DataError(f"rank {rank} received {n:,} rows but its planned share is {expected_rows:,}; was data.path "
                        f"modified during the run?")
    ds = TabularDataset.from_blocks(blocks, spill_dir=spill_dir)
    print(f"[data] rank {rank}: {n:,} rows in {len(blocks)} blocks, {100.0 * local / max(1, n):.0f}% transformed on "
          f"this node, in {time.perf_counter() - t0:.1f}s; rows {where}", flush=True)
    return ds, local


def run_name(cfg: Config) -> str:
    """A fresh folder per run, unless resuming: re-running a command never silently continues an old run."""
    return cfg.run.name if cfg.run.resume else f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


RESUME_KEYS = ("num_workers", "batch_size", "seed", "shuffle", "drop_last")


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


def fit_preprocessor(cfg: Config, out_uri: str):
    """Validate, then one distributed pass: the fitted preprocessor (saved) and the row accounting."""
    src = source.inspect(cfg)
    bad = f"; {len(src.bad_files)} bad files quarantined" if src.bad_files else ""
    print(f"[fit] {len(src.shards)} shards, {src.num_rows:,} rows, {len(src.fragments)} row groups under {src.uri}{bad}",
          flush=True)
    t0 = time.perf_counter()
    fitted, acct = preprocess.fit(src, cfg)
    saved = storage.join(out_uri, PREPROCESSOR_FILE)
    if cfg.run.resume and storage.exists(*storage.filesystem(saved)):
        print(f"[fit] resuming: using the preprocessor fitted earlier, {saved}", flush=True)
        fitted = FittedPreprocessor.load(saved)
    else:
        fitted.save(saved)
    if acct.quarantined:
        storage.write_text(storage.join(out_uri, QUARANTINE_FILE), acct.manifest_jsonl())
    print(f"[fit] one pass in {time.perf_counter() - t0:.1f}s: {fitted.num_features} numeric features, "
          f"vocab sizes {dict(zip(fitted.categorical, (len(v) for v in fitted.vocab)))}; saved {saved}", flush=True)
    print(f"[rows] {acct.summary()}" + (f"; manifest {storage.join(out_uri, QUARANTINE_FILE)}" if acct.quarantined else ""),
          flush=True)
    return src, fitted, acct


def run(cfg: Config) -> dict[str, Any]:
    """The whole job; returns the summary that is also written to <output>/<name>/metrics.json."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = run_name(cfg)
    out_uri = storage.join(cfg.run.output, name)
    t_start = time.perf_counter()
    check_resume(cfg, out_uri)
    src, fitted, acct = fit_preprocessor(cfg, out_uri)

    if not acct.balanced:
        raise DataError(f"row accounting does not balance: {acct.summary()}; was data.path modified during the run?")
    shares = preprocess.plan_shares(src, acct, cfg.train.num_workers, whole=cfg.train.shuffle == "global")
    share_rows = [sum(p.hi - p.lo for p in share) for share in shares]
    print(f"[plan] rows per rank {share_rows}, from {[len(s) for s in shares]} row-group pieces; each rank's "
          f"pieces are read and transformed on its own node where it has a CPU to spare", flush=True)

    use_gpu = cfg.train.use_gpu == "true" or (cfg.train.use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
    # Ray Train writes through the filesystem pipeline.storage builds (same endpoint, addressing style
    # and credentials as every other read and write), pickled to its controller and workers.
    storage_path, storage_filesystem = storage.ray_storage(cfg.run.output)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "fitted": fitted.to_dict(), "share_rows": share_rows,
                           "run_dir": os.path.abspath(out_uri) if storage.is_local(out_uri) else None},
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": 1},
                                     placement_strategy=cfg.train.placement_strategy),
        # Ray Train wants the dataset up front; LocalShareSplit replaces it by each rank's share.
        datasets={"train": preprocess.transform_dataset(src, fitted, cfg, acct)},
        dataset_config=make_data_config(src, fitted, cfg, shares, cpus_per_worker=0.0 if use_gpu else 1.0),
        run_config=RunConfig(name=name, storage_path=storage_path, storage_filesystem=storage_filesystem,
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=cfg.train.max_failures)),
    )
    result = trainer.fit()
    history = result.return_value or []
    if not history and result.checkpoint is not None:
        with result.checkpoint.as_directory() as d:
            history = torch.load(os.path.join(d, CHECKPOINT_FILE), weights_only=False)["history"]
    summary = {"run": out_uri, "rows_read": acct.rows_read, "accounting": acct.as_dict(), "accounting_summary": acct.summary(), "epochs": history, "checkpoint": storage.to_uri(result.checkpoint.filesystem, result.checkpoint.path) if result.checkpoint else None,
               "preprocessor": storage.join(out_uri, PREPROCESSOR_FILE), "use_gpu": use_gpu,
               "wall_s": round(time.perf_counter() - t_start, 2)}
    storage.write_json(storage.join(out_uri, "metrics.json"), summary)
    return summary
