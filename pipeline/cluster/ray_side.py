"""The Ray parts behind `pipeline.ingest` (prepare and rank_data): the distributed fit pass, each rank's read-and-transform
tasks, and the Ray Train `DataConfig` that hands every rank its share.

The per-fragment work itself is in tasks.py and is the same without Ray (local_side.py).
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from . import tasks
from ..errors import StallError, find_pipeline_error

DATASET = "pipeline"  # the name under which the plan's rows reach Ray Train workers


def _items(objs: list) -> Any:
    import ray

    ds = ray.data.from_items([{"blob": pickle.dumps(o)} for o in objs], override_num_blocks=max(1, len(objs)))
    # Records in item order: the float64 merge of partial statistics is then the same every run.
    ds.context.execution_options.preserve_order = True
    return ds


def _objs(batch: pa.Table):
    for blob in batch.column("blob").to_pylist():
        yield pickle.loads(blob)


def cpus() -> tuple[float, float]:
    """(free, total) CPUs of the cluster, as the GCS sees them now."""
    import ray

    return ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)


def watched(items: Iterable, stall_s: float, waiting_for: Callable[[], str]) -> Iterator:
    """Yield from `items` (pulled in a helper thread); if none arrives for stall_s seconds, raise a
    StallError whose message is waiting_for(), instead of waiting forever."""
    q: queue.Queue = queue.Queue(maxsize=2)
    done = object()

    def pull() -> None:
        try:
            for x in items:
                q.put((x, None))
            q.put((done, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            q.put((done, e))

    threading.Thread(target=pull, daemon=True, name="pipeline-watched").start()
    while True:
        try:
            x, err = q.get(timeout=stall_s)
        except queue.Empty:
            raise StallError(waiting_for()) from None
        if x is done:
            if err is not None:
                inner = find_pipeline_error(err)
                raise (inner or err) from None
            return
        yield x


def _fit_group(spec: tasks.ReadSpec, group: list, columns: list, partitions: int) -> tuple:
    out = tasks.fit_group_split(spec, group, columns, partitions)
    return out if partitions else out[0]


def _reduce(columns: list, partition: int, *parts: dict) -> tuple[dict, dict]:
    from ..fit import counts

    _fail_once("reduce_counts", partition)
    summary, merged = counts.reduce_counts(parts, columns)
    summary["_memory"] = _memory_now()  # while the range's counts are all held: about the task's peak
    return summary, merged


def _memory_now() -> dict[str, int]:
    """This worker process's resident and unique memory in bytes (what bench --scale reports of reducers)."""
    import psutil

    m = psutil.Process().memory_full_info()
    return {"rss": int(m.rss), "uss": int(m.uss)}


def _finalize(columns: list, merged: dict, cut: dict) -> tuple[dict, dict]:
    from ..fit import counts

    summary, part = counts.finalize(merged, cut, columns)
    summary["_memory"] = _memory_now()
    return summary, part


def _fail_once(stage: str, partition: int) -> None:
    """Fault injection for the tests (PIPELINE_FAIL_ONCE=<folder>, set in a job's runtime_env): the first
    attempt of partition 0's task of `stage` kills its own worker process, as a lost node would."""
    import os

    folder = os.environ.get("PIPELINE_FAIL_ONCE")
    if folder and partition == 0:
        marker = os.path.join(folder, f"{stage}-{partition}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), 9)


def _wait_all(pending: dict, stall_s: float, what: str, total: int) -> dict:
    """{index: result} of every pending ref {ref: index}, or a StallError after stall_s without one."""
    import ray

    done: dict = {}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=stall_s)
        if not ready:
            free, all_cpus = cpus()
            raise StallError(f"the fit pass made no progress for {stall_s:.0f}s ({len(done)} of {total} {what} done): its "
                             f"Ray tasks are not running. The cluster has {free:g} of {all_cpus:g} CPUs free; free some "
                             f"(other jobs hold them), add nodes, or raise run.stall_timeout_s if the storage is just slow")
        for ref in ready:
            try:
                done[pending.pop(ref)] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a task that failed outright (its own errors come back as records)
                raise _fit_failure(e) from None
    return done


def _fit_failure(e: BaseException) -> BaseException:
    """A fit task's failure as the user should read it: the pipeline's own error, or one paragraph on an
    object store or disk that filled up."""
    import ray

    inner = find_pipeline_error(e)
    if inner is not None:
        return inner
    full = (ray.exceptions.ObjectStoreFullError, ray.exceptions.OutOfDiskError, ray.exceptions.OutOfMemoryError)
    if isinstance(e, full) or isinstance(getattr(e, "cause", None), full):
        from ..errors import PipelineError

        try:
            stores = ", ".join(f"{n['NodeManagerAddress']}: {n.get('Resources', {}).get('object_store_memory', 0) / 2**30:.1f} GiB"
                               for n in ray.nodes() if n.get("Alive"))
        except Exception:  # noqa: BLE001 - the message goes out without the sizes rather than not at all
            stores = "unknown"
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        return PipelineError(f"the fit's category counts did not fit: {type(e).__name__}: {first}. Object store per "
                             f"node: {stores}. The counts of every categorical column pass "
                             f"through the object store (spilling to each node's disk): add nodes or memory, give Ray "
                             f"more object store or spill space (ray start --object-store-memory, "
                             f"object_spilling_directory), or raise preprocess.vocab_partitions so each reducer holds less")
    return e


def fit_records(source, spec: tasks.ReadSpec, stall_s: float = 300.0, shuffle: tuple | None = None) -> tuple:
    """(records, shuffled): tasks.fit_group over every group of a file's row groups (tasks.by_file), one
    plain Ray task each, spread over the cluster; records in fragment order. Plain tasks, not a Ray
    Data pipeline: the results are a few kilobytes each, and a Ray Data execution costs seconds to
    start (measured: bench --mode preprocess). A task whose worker dies is retried by Ray.

    shuffle = (counts.Column list, P): the category counts do not come back here. Each fit task returns
    them split into P hash ranges as objects of their own; P reducer tasks merge a range each, this
    process picks the top-K cut from their histograms, and P finalize tasks build the vocabulary parts,
    which stay in the object store (see counts.py). shuffled = (part refs, reduce summaries, finalize
    summaries), or None without categorical columns."""
    import ray

    columns, partitions = shuffle if shuffle and shuffle[0] else ([], 0)
    opts = dict(num_cpus=1, max_retries=3, scheduling_strategy="SPREAD")
    fit = ray.remote(_fit_group).options(name="fit_group", num_returns=partitions + 1, **opts)
    groups = tasks.fragment_groups(source.fragments)
    spec_ref, cols_ref = ray.put(spec), ray.put(columns)
    refs = [fit.remote(spec_ref, g, cols_ref, partitions) for g in groups]
    heads = [r[0] if partitions else r for r in refs]
    t0 = time.perf_counter()
    done = _wait_all({h: i for i, h in enumerate(heads)}, stall_s, "groups of row groups", len(groups))
    t1 = time.perf_counter()
    records = [r for i in range(len(groups)) for r in done[i]]
    if not partitions or any(len(r) == 3 for r in records):  # no categorical columns, or the fit failed
        return records, None
    reduce = ray.remote(_reduce).options(name="reduce_counts", num_returns=2, **opts)
    first, merged = zip(*(reduce.remote(cols_ref, q, *(r[1 + q] for r in refs)) for q in range(partitions)))
    del refs  # the map parts are freed once their reducers are done with them
    summaries = _wait_all({s: q for q, s in enumerate(first)}, stall_s, "count reducers", partitions)
    summaries = [summaries[q] for q in range(partitions)]
    t2 = time.perf_counter()
    from ..fit import counts

    finalize = ray.remote(_finalize).options(name="finalize_vocabulary", num_returns=2, **opts)
    second, parts = zip(*(finalize.remote(cols_ref, m, k) for m, k in zip(merged, counts.cuts(summaries, columns))))
    del merged
    done = _wait_all({s: q for q, s in enumerate(second)}, stall_s, "vocabulary parts", partitions)
    summaries[0]["_seconds"] = {"map": t1 - t0, "reduce": t2 - t1, "finalize": time.perf_counter() - t2}
    return records, (list(parts), summaries, [done[q] for q in range(partitions)])


def share_dataset(spec: tasks.ReadSpec, fitted, pieces: list, node_id: str | None = None, node_cpus: int = 1):
    """Lazy Ray Dataset of the packed rows of `pieces`, in order: rows [k, width] float32, row_id, val
    (the piece is validation rows), local (the task ran on node_id).

    With node_id, the read-and-transform tasks prefer that node, up to `node_cpus` at a time (the CPUs
    it has beside its training workers), so their output lands in the object store of the node that
    trains on it and the rank reads its rows without crossing the network. A task the node cannot
    take at once (busy, or gone) runs elsewhere rather than waiting."""
    import ray

    def read_transform(batch: pa.Table) -> dict[str, np.ndarray]:
        here = node_id is not None and ray.get_runtime_context().get_node_id() == node_id
        parts, vals = [], []
        for group in _objs(batch):
            for p, part in zip(group, tasks.transform_group(spec, fitted, group)):
                parts.append(part)
                vals.append(np.full(len(part[1]), p.val))
        out = tasks.concat(parts, fitted, spec)
        out["val"] = np.concatenate(vals) if vals else np.empty(0, bool)
        out["local"] = np.full(len(out["row_id"]), here)
        return out

    groups = tasks.piece_groups(pieces)
    ds = _items(groups)
    if node_id is None:
        return ds.map_batches(read_transform, batch_format="pyarrow", batch_size=1)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # soft=True alone makes a task wait for the node however long it stays busy (a training worker may
    # hold its last CPU); _spill_on_unavailable (the flag Ray Serve uses for the same purpose) lets
    # such a task run elsewhere. Passed as a raw remote arg (deprecated in Ray Data 2.60 in favour of
    # label selectors, which cannot express this fallback); keep that warning out of the job's output.
    affinity = NodeAffinitySchedulingStrategy(node_id=node_id, soft=True, _spill_on_unavailable=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return ds.map_batches(read_transform, batch_format="pyarrow", batch_size=1,
                              compute=ray.data.TaskPoolStrategy(size=max(1, min(node_cpus, len(groups)))),
                              scheduling_strategy=affinity)


def _spare_cpus(worker_node_ids, cpus_per_worker: float) -> dict[str, int]:
    """CPUs each training node has beside the training workers placed on it (totals from the GCS)."""
    import ray

    if not worker_node_ids:
        return {}
    totals = {n["NodeID"]: n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")}
    return {node: int(totals.get(node, 0) - cpus_per_worker * worker_node_ids.count(node)) for node in set(worker_node_ids)}


def data_config(plan, base=None, cpus_per_worker: float = 1.0):
    """A Ray Train DataConfig: each rank gets its planned share (see plan.py: a pure function of the
    data and the world size, so which rows a rank owns is reproducible) under the name DATASET, read
    and transformed by Ray Data tasks pinned to the node that rank runs on; every other dataset the
    user passed is handled by `base` (a DataConfig; default: Ray Train's, which splits them).

    Ray's own streaming_split is locality-aware too, but which rows it hands a rank depends on where
    blocks happen to be, which would make the order irreproducible."""
    from ray.train import DataConfig

    class ShareSplit(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            # Elastic training restarts on however many workers it has: the same fit, re-planned for them
            # (rank_data re-plans the same way).
            planned = plan.for_world(world_size)
            others = {k: v for k, v in datasets.items() if k != DATASET}
            out = (base or DataConfig()).configure(others, world_size, worker_handles, worker_node_ids, **kwargs) \
                if others else [{} for _ in range(world_size)]
            spare = _spare_cpus(worker_node_ids, cpus_per_worker)
            for r in range(world_size):
                node = worker_node_ids[r] if worker_node_ids else None
                # A node with no CPU beside its training workers cannot transform anything: no affinity.
                cpus = spare.get(node, 0) // max(1, worker_node_ids.count(node)) if node else 0
                part = share_dataset(planned.spec, planned.fitted, planned.pieces(r), node_id=node if cpus >= 1 else None,
                                     node_cpus=cpus)
                part.context.enable_progress_bars = False  # a worker's read of its share takes seconds
                out[r][DATASET] = part.iterator()
            return out

    return ShareSplit()


def placeholder():
    """What TorchTrainer is given under DATASET: ShareSplit replaces it by each rank's share. Ray
    Train skips DataConfig.configure when no dataset is passed, so one must be there; it never runs."""
    import ray

    return ray.data.from_items([{"placeholder": 0}])


def receive(iterator, sink: Callable[[tasks.Part, bool], None], rank: int = 0, expected: int = 0,
            stall_s: float = 300.0) -> tuple[int, float]:
    """Hand each block of this rank's DataIterator to sink(part, is_validation) as it arrives (parts:
    packed rows, row ids, pass-through columns); returns how many rows were transformed on this node
    and the seconds taken. No block for stall_s seconds: a StallError saying what it waited for."""
    t0 = time.perf_counter()
    got = local = 0

    def waiting() -> str:
        free, total = cpus()
        return (f"rank {rank} received no rows of its share for {stall_s:.0f}s ({got:,} of {expected:,} so far): the Ray "
                f"Data tasks that read and transform it are not running. The cluster has {free:g} of {total:g} CPUs "
                f"free; give the training workers fewer CPUs than the nodes have (ScalingConfig resources_per_worker), "
                f"add CPUs, or raise run.stall_timeout_s if the storage is just slow")

    blocks = iterator.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
    for b in watched(blocks, stall_s, waiting):
        if not len(b["row_id"]):
            continue
        got += len(b["row_id"])
        local += int(b["local"].sum())
        is_val = b["val"]
        extra = {k[len(tasks.EXTRA):]: v for k, v in b.items() if k.startswith(tasks.EXTRA)}
        for want in (False, True):
            sel = is_val == want
            if sel.all():  # a block is one piece, all training or all validation rows: no copy
                sink((b["rows"], b["row_id"], extra), want)
            elif sel.any():
                sink((b["rows"][sel], b["row_id"][sel], {k: v[sel] for k, v in extra.items()}), want)
    return local, time.perf_counter() - t0
