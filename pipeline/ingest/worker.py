"""A rank's side: rank_data() finds this process's rank (Ray Train, torchrun or none) and reads its share
into one packed tensor (from the plan's Ray Data iterator, or with pyarrow in this process), then
builds its loader.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..errors import PipelineError
from ..fit.preprocess import FittedPreprocessor
from .plan import IngestPlan


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

    from ..feed.loader import DeviceLoader
    from ..feed.sampler import BatchSampler, resume_span, upgrade

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

        from ..cluster import ray_side

        ranks_on_node = ray.train.get_context().get_local_world_size()
        if cfg.loader.read_share == "worker":
            read_here = " (read in this worker: loader.read_share = worker)"
        elif ray_side.cpus()[0] >= 1:
            from ..cluster.runtime import quiet_ray_data

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
    from ..feed.dataset import Layout, RowWriter

    cfg, f = plan.config, plan.fitted
    layout = Layout(f.num_features, len(f.categorical), len(f.targets), 1 if f.weight else 0)
    planned = (plan.train_rows if plan.global_shuffle else plan.train_sizes[rank], plan.val_sizes[rank])
    spill_dir, where = spill_dir_for(cfg, sum(planned), layout.width, ranks_on_node)
    writers = {val: RowWriter(n, layout, spill_dir=spill_dir, what=f"{'validation' if val else 'training'} rows for "
                                                                   f"rank {rank}") for val, n in zip((False, True), planned)}

    def sink(part, val: bool) -> None:
        writers[val].add(*part)

    if iterator is not None:
        from ..cluster import ray_side

        local, secs = ray_side.receive(iterator, sink, rank, sum(planned), cfg.run.stall_timeout_s)
    else:
        from ..cluster import local_side

        local, secs = local_side.read_share(plan, rank, sink, ranks_on_node)
    return writers[False].finish(), writers[True].finish(), local, secs, where
