"""`python -m pipeline bench --mode preprocess`: the project's preprocessing beside a hand-written
single-process script, in one run, on the same files (the demo generator's, 10M rows in 32 shards by
default; written once under data/bench-<rows>).

  (h) hand-written: one process, pyarrow + numpy, two passes over the files as a user would write
      them: statistics (mean/std per numeric column, category counts), then the packed float32 rows
      (standardised features, missing indicators, category ids, label) in one array;
  (p) this project: pipeline.prepare (validate + the one distributed fit pass), then every rank's
      share read, transformed and packed into its tensor (the same code a Ray Train worker runs),
      all ranks at once, on a private local Ray with one CPU per core.

It prints seconds, rows/s, the ratio p/h, and each rank's memory beyond its process's fixed size
against the share's packed bytes: the peak of its private memory (from /proc/self/statm every 20 ms)
and its PSS at the end (smaps_rollup), so object-store pages shared with other processes are not
counted twice; writes JSON and a PNG.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config import DEMO_CATEGORICAL, DEMO_NUMERIC

LABEL = "label"


def handwritten(paths: list[str]) -> dict:
    """The two passes a user writes by hand, timed."""
    numeric, categorical = list(DEMO_NUMERIC), list(DEMO_CATEGORICAL)
    cols = [*numeric, *categorical, LABEL]
    t0 = time.perf_counter()
    n, cnt = 0, np.zeros(len(numeric))
    s, ss, nulls = np.zeros(len(numeric)), np.zeros(len(numeric)), np.zeros(len(numeric))
    counts = [Counter() for _ in categorical]
    for p in paths:  # pass 1: statistics
        t = pq.read_table(p, columns=cols)
        n += t.num_rows
        x = np.column_stack([t[c].to_numpy(zero_copy_only=False) for c in numeric])
        ok = np.isfinite(x)
        cnt += ok.sum(0)
        nulls += (~ok).sum(0)
        x0 = np.where(ok, x, 0.0)
        s += x0.sum(0)
        ss += (x0 * x0).sum(0)
        for j, c in enumerate(categorical):
            vc = pc.value_counts(t[c])
            counts[j].update({v: k for v, k in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())
                              if v is not None})
    mean = s / cnt
    std = np.sqrt(np.maximum(ss / cnt - mean * mean, 0.0))
    std[std == 0] = 1.0
    vocab = [sorted(c, key=lambda v: (-c[v], v)) for c in counts]
    indicators = np.flatnonzero(nulls > 0)
    f = len(numeric) + len(indicators)
    width = f + len(categorical) + 1
    out = np.empty((n, width), np.float32)
    at = 0
    for p in paths:  # pass 2: the packed rows
        t = pq.read_table(p, columns=cols)
        k = t.num_rows
        x = np.column_stack([t[c].to_numpy(zero_copy_only=False) for c in numeric])
        z = (x - mean) / std
        missing = ~np.isfinite(z)
        z[missing] = 0.0
        out[at:at + k, :len(numeric)] = z
        out[at:at + k, len(numeric):f] = missing[:, indicators]
        ids = out[at:at + k, f:f + len(categorical)].view(np.int32)
        for j, c in enumerate(categorical):
            ids[:, j] = pc.fill_null(pc.index_in(t[c], value_set=pa.array(vocab[j], pa.string())), -1).to_numpy() + 1
        out[at:at + k, -1] = t[LABEL].to_numpy(zero_copy_only=False)
        at += k
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": n, "rows_per_s": n / seconds, "packed_bytes": out.nbytes}


def handwritten_dlrm(paths: list[str]) -> dict:
    """The DLRM recipe by hand, as a user writes it with pyarrow and numpy: pass 1 counts every
    categorical value (per file with pyarrow, merged as Arrow tables), pass 2 packs the rows: counts
    with nulls as 0, negatives as 0, log(1 + x); categories with a frequency threshold of 3 (ids by
    frequency, 0 for the rest and for nulls); the label."""
    from ..demo import CRITEO_CATEGORICAL, CRITEO_NUMERIC

    numeric, categorical = list(CRITEO_NUMERIC), list(CRITEO_CATEGORICAL)
    t0 = time.perf_counter()
    parts: list[list[pa.Table]] = [[] for _ in categorical]
    n = 0
    for p in paths:  # pass 1: category counts
        t = pq.read_table(p, columns=categorical)
        n += t.num_rows
        for j, c in enumerate(categorical):
            vc = pc.value_counts(t[c])
            parts[j].append(pa.table({"v": vc.field("values"), "n": vc.field("counts")}))
    vocab = []
    for j in range(len(categorical)):
        g = pa.concat_tables(parts[j]).group_by("v").aggregate([("n", "sum")])
        g = g.filter(pc.and_(pc.greater_equal(g["n_sum"], 3), pc.is_valid(g["v"])))
        vocab.append(g["v"].take(pc.sort_indices(g, sort_keys=[("n_sum", "descending"), ("v", "ascending")])))
    width = len(numeric) + len(categorical) + 1
    out = np.empty((n, width), np.float32)
    at = 0
    for p in paths:  # pass 2: the packed rows
        t = pq.read_table(p, columns=[*numeric, *categorical, LABEL])
        k = t.num_rows
        x = np.column_stack([t[c].to_numpy(zero_copy_only=False) for c in numeric]).astype(np.float64)
        x = np.log1p(np.maximum(np.nan_to_num(x, nan=0.0), 0.0))
        out[at:at + k, :len(numeric)] = x
        ids = out[at:at + k, len(numeric):-1].view(np.int32)
        for j, c in enumerate(categorical):
            ids[:, j] = pc.fill_null(pc.index_in(t[c], value_set=vocab[j]), -1).to_numpy() + 1
        out[at:at + k, -1] = t[LABEL].to_numpy(zero_copy_only=False)
        at += k
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": n, "rows_per_s": n / seconds, "packed_bytes": out.nbytes}


def _dlrm_keys() -> dict:
    from ..demo import CRITEO_CATEGORICAL, CRITEO_NUMERIC

    return dict(numeric=list(CRITEO_NUMERIC), categorical=list(CRITEO_CATEGORICAL), vocab_max_size=100_000_000,
                vocab_min_count=3, missing_indicator=False,
                numeric_transform={"log1p": True, "scale": "none", "fill": "zero"})


# dataset -> (what it is, the project's prepare() keywords, the hand-written script)
DATASETS = {
    "demo": (f"{len(DEMO_NUMERIC)} numeric + {len(DEMO_CATEGORICAL)} categorical + label; standardize, top-1000 "
             f"vocabularies", lambda: dict(numeric=list(DEMO_NUMERIC), categorical=list(DEMO_CATEGORICAL)), handwritten),
    "criteo": ("Criteo-shaped: 13 counts + 26 hashed categoricals + label; the DLRM recipe: log(1 + x) counts, "
               "frequency threshold 3", _dlrm_keys, handwritten_dlrm),
}


def _memory() -> tuple[int, int]:
    """(USS, PSS) of this process in bytes, from /proc/self/smaps_rollup: exact, but the kernel walks
    every page of the process for it (4 ms and more in a Ray worker, whose object store is mapped too),
    so it is read at the start and the end only."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                fields[parts[0][:-1]] = int(parts[1]) * 1024
    return fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0), fields.get("Pss", 0)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _private() -> int:
    """This process's resident private anonymous memory in bytes (resident less file-backed and shared
    pages, /proc/self/statm): what a share's arrays and tensors take, read in microseconds, so it can
    be sampled often. Object-store pages are shared memory and not in it, as they are not in USS."""
    with open("/proc/self/statm") as f:
        v = f.read().split()
    return (int(v[1]) - int(v[2])) * _PAGE


def _at_priority(nice: int) -> int:
    """Run this process at `nice` (the script's), where allowed; returns the nice it runs at. Ray starts
    its workers at nice 15: on a machine that others use too, a rank would then measure the neighbours'
    load against a script at nice 0, not the code (a training node runs nothing else)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:  # lowering one's nice needs the privilege
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def _rank_read(plan, rank: int, how: str, nice: int | None = None) -> dict:
    """One rank's share through the code a Ray Train worker runs (read_rank: in this process, or from
    Ray Data tasks with how = ray_data), with its process's private memory sampled every 20 ms.

    The peak comes from /proc/self/statm (a read costs microseconds). It used to be smaps_rollup every 0.1
    s, which the kernel answers by walking every page the process maps: 4 ms and more of system time a
    read in a Ray worker, a tenth of the rank's own system time."""
    import ray.train  # noqa: F401 - what a Ray Train worker has loaded before its share (pandas among it,
    # which pyarrow imports at its first pa.array of a numpy array: 0.2 to 0.5 s in a fresh process)

    from ..cluster import ray_side  # noqa: F401 - torch and the readers, loaded as in a training worker
    from ..feed import dataset  # noqa: F401
    from ..ingest import read_rank

    ran_at = _at_priority(nice) if nice is not None else None

    base, base_private = _memory(), _private()
    peak = [base_private]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _private())
            done.wait(0.02)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    it = ray_side.share_dataset(plan.spec, plan.fitted, plan.pieces(rank)).iterator() if how == "ray_data" else None
    train, val, _, _, _ = read_rank(plan, rank, it, ranks_on_node=plan.world_size)
    seconds = time.perf_counter() - t0
    done.set()
    end = _memory()
    return {"rank": rank, "seconds": seconds, "rows": len(train) + len(val), "nice": ran_at,
            "packed_bytes": train.nbytes + val.nbytes,
            # the peak of private memory (sampled every 20 ms), and USS / PSS at the end, beyond the start
            "uss_peak_extra": max(peak[0], _private()) - base_private, "uss_end_extra": end[0] - base[0],
            "pss_end_extra": end[1] - base[1]}


def _size(path: str) -> int:
    """Bytes of a file, or of every file in a folder."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def project(path: str, world: int, how: str, dataset: str = "demo") -> dict:
    import ray

    import pipeline

    from ..cluster.runtime import loopback_only, quiet_ray_data

    if not ray.is_initialized():
        loopback_only()
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, logging_level="ERROR")
    quiet_ray_data(progress=False)
    t0 = time.perf_counter()
    # fit where the built-in job fits (run.fit_on = auto: threads in this process on a one-node Ray, Ray
    # tasks across a cluster of several nodes); plan.timings["fit_on"] says which
    plan = pipeline.prepare(path, label=LABEL, world_size=world, **DATASETS[dataset][1]())
    fit_s = time.perf_counter() - t0
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # the fitted state a job saves, and what loading it costs
        plan.save_fit(f"{d}/fit.json")
        plan.fitted.save(f"{d}/preprocessor.json")
        sizes = {n: _size(f"{d}/{n}") for n in os.listdir(d)}  # the JSONs and their vocabulary folder
        t2 = time.perf_counter()
        pipeline.FittedPreprocessor.load(f"{d}/preprocessor.json")
        load_s = time.perf_counter() - t2
    t1 = time.perf_counter()
    # A rank holds a CPU, as a CPU training worker does; with ray_data its Ray Data tasks take the others.
    read = ray.remote(num_cpus=0 if how == "ray_data" else 1)(_rank_read)
    ranks = ray.get([read.remote(plan, r, how, os.getpriority(os.PRIO_PROCESS, 0)) for r in range(world)])
    with_start_s = time.perf_counter() - t1  # also starting the two processes and importing torch there
    transform_s = max(r["seconds"] for r in ranks)  # what a training worker, already running, spends
    rows = plan.accounting.rows_used
    return {"validate_s": plan.timings["validate_s"], "fit_pass_s": plan.timings["fit_s"], "prepare_s": fit_s,
            "transform_s": transform_s, "transform_with_process_start_s": with_start_s,
            "seconds": fit_s + transform_s, "rows": rows, "state_bytes": sizes, "state_load_s": load_s,
            "vocab_values": sum(len(v) for v in plan.fitted.vocab), "fit_on": plan.timings["fit_on"],
            "rows_per_s": rows / (fit_s + transform_s), "ranks": ranks}


def run(rows: int, shards: int, world: int, data_dir: str | None, repeats: int, how: str = "worker",
        dataset: str = "demo") -> dict:
    from .. import demo

    path = data_dir or (f"data/bench-{rows}" if dataset == "demo" else f"data/bench-{dataset}-{rows}")
    t0 = time.perf_counter()
    paths = (demo.generate if dataset == "demo" else demo.generate_criteo)(path, rows, shards, seed=0)
    res: dict = {"rows": rows, "shards": shards, "world": world, "cpu_count": os.cpu_count(), "data": path, "read_share": how,
                 "dataset": dataset, "generate_s": time.perf_counter() - t0, "handwritten": [], "project": []}
    for _ in range(repeats):  # interleaved: a noisy neighbour slows one sample, not one side
        res["handwritten"].append(DATASETS[dataset][2](paths))
        res["project"].append(project(path, world, how, dataset))
    if repeats:
        _best(res)
    return res


def _best(res: dict) -> None:
    h = min(res["handwritten"], key=lambda r: r["seconds"])
    p = min(res["project"], key=lambda r: r["seconds"])
    res["best"] = {"handwritten": h, "project": p, "ratio_project_over_handwritten": p["seconds"] / h["seconds"],
                   "worst_rank_uss_over_packed": max(r["uss_peak_extra"] / r["packed_bytes"] for r in p["ranks"])}


def table(res: dict) -> str:
    b = res["best"]
    h, p = b["handwritten"], b["project"]
    lines = [f"preprocessing {res['rows']:,} rows in {res['shards']} shards ({DATASETS[res.get('dataset', 'demo')][0]}), "
             f"{res['world']} ranks, {res['cpu_count']} cores, best of {len(res['project'])}; shares read by: "
             f"{res['read_share']}",
             f"  (h) hand-written, one process, fit + transform   {h['seconds']:7.1f} s  {h['rows_per_s'] / 1e6:6.2f} M rows/s",
             f"  (p) this project: validate + fit pass            {p['prepare_s']:7.1f} s  (fit pass {p['fit_pass_s']:.1f} s, "
             f"in {p.get('fit_on', 'Ray')})",
             f"      every rank's share into its packed tensor    {p['transform_s']:7.1f} s  (in running workers"
             f"{_nice(p)}; {p['transform_with_process_start_s']:.1f} s with starting them)",
             f"      total                                        {p['seconds']:7.1f} s  {p['rows_per_s'] / 1e6:6.2f} M rows/s"
             f"   p/h = {b['ratio_project_over_handwritten']:.2f}"]
    mib = 2**20
    lines.append(f"  fitted state: {p['vocab_values']:,} vocabulary values; " + ", ".join(
        f"{n} {v / mib:.1f} MiB" for n, v in sorted(p["state_bytes"].items())) + f"; loaded in {p['state_load_s']:.2f} s")
    for r in p["ranks"]:
        lines.append(f"  rank {r['rank']}: {r['rows']:,} rows, {r['packed_bytes'] / mib:.0f} MiB packed; peak beyond its "
                     f"fixed size: private {r['uss_peak_extra'] / mib:.0f} MiB ({r['uss_peak_extra'] / r['packed_bytes']:.2f}x), "
                     f"at the end: PSS {r['pss_end_extra'] / mib:.0f} MiB ({r['pss_end_extra'] / r['packed_bytes']:.2f}x)")
    return "\n".join(lines)


def _nice(p: dict) -> str:
    nice = {r.get("nice") for r in p["ranks"]} - {None}
    return f" at nice {'/'.join(str(n) for n in sorted(nice))}" if nice else ""


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = res.get("cases", [res])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 1.5 + 1.2 * len(every)))
    for i, r in enumerate(every):  # per case: the script's bar, then the project's (fit, then the slowest share)
        h, p = r["best"]["handwritten"], r["best"]["project"]
        name = f"{r.get('dataset', 'demo')} {r['rows'] / 1e6:g}M"
        ax1.barh([f"{name} (h)"], [h["seconds"]], color="grey", label="hand-written" if not i else None)
        ax1.barh([f"{name} (p)"], [p["prepare_s"]], color="C0", label="validate + fit" if not i else None)
        ax1.barh([f"{name} (p)"], [p["transform_s"]], left=[p["prepare_s"]], color="C1",
                 label="slowest share -> packed tensor" if not i else None)
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds")
    ax1.set_title(f"Preprocessing, {res['cpu_count']} cores")
    ax1.legend()
    p = every[-1]["best"]["project"]
    ranks = p["ranks"]
    x = np.arange(len(ranks))
    ax2.bar(x - 0.2, [r["packed_bytes"] / 2**20 for r in ranks], 0.4, label="packed rows")
    ax2.bar(x + 0.2, [r["uss_peak_extra"] / 2**20 for r in ranks], 0.4, label="peak USS beyond fixed size")
    ax2.set_xticks(x, [f"rank {r['rank']}" for r in ranks])
    ax2.set_ylabel("MiB")
    ax2.set_title(f"A rank's memory against its share ({every[-1]['rows']:,} rows)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cases(datasets: str, rows: str | int | None) -> list[tuple[str, int]]:
    """(dataset, rows) of every case a run measures: each dataset named (comma-separated) at each row
    count given (comma-separated), or at its default (demo: 10M; criteo: 2M and 10M, as issue 38 asks)."""
    default = {"demo": [10_000_000], "criteo": [2_000_000, 10_000_000]}
    sizes = [int(r) for r in str(rows).split(",")] if rows else None
    return [(d, n) for d in datasets.split(",") for n in (sizes or default[d])]


SHARDS = {"demo": 32, "criteo": 16}  # files a dataset's rows are written in, unless --shards says


def run_cases(todo: list[tuple[str, int]], shards: int | None, world: int, data_dir: str | None, repeats: int,
              how: str = "worker") -> dict:
    """Every case side by side in one run: the cases interleaved within each repetition (script, then the
    project), so that a busy neighbour slows a repetition of every case, not one case. One case: run()'s
    figures; several: under "cases" (the first one's also at the top, as run() gives them)."""
    if len(todo) == 1:
        d, n = todo[0]
        return run(n, shards or SHARDS[d], world, None if data_dir is None else f"{data_dir}/{d}-{n}", repeats, how, d)
    runs = []
    for d, n in todo:  # the files first (written once, kept under data/)
        runs.append(run(n, shards or SHARDS[d], world, None if data_dir is None else f"{data_dir}/{d}-{n}", 0, how, d))
    for _ in range(repeats):
        for r in runs:
            r["handwritten"].append(DATASETS[r["dataset"]][2](_paths(r["data"])))
            r["project"].append(project(r["data"], world, how, r["dataset"]))
    for r in runs:
        _best(r)
    return {**runs[0], "cases": runs}


def _paths(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))


def summary(res: dict) -> str:
    """One line per case: fit (validate + fit pass), the slowest rank's share, total, the script, and the
    ratio: of the best of each side, and its spread over the repetitions (each project run over the
    script run beside it)."""
    lines = [f"{'case':>22} {'fit s':>7} {'share s':>8} {'total s':>8} {'script s':>9} {'ratio':>6}  ratio per repetition"]
    for r in res.get("cases", [res]):
        b = r["best"]
        h, p = b["handwritten"], b["project"]
        each = [q["seconds"] / g["seconds"] for g, q in zip(r["handwritten"], r["project"])]
        lines.append(f"{r['dataset'] + ' ' + format(r['rows'], ','):>22} {p['prepare_s']:7.2f} {p['transform_s']:8.2f} "
                     f"{p['seconds']:8.2f} {h['seconds']:9.2f} {b['ratio_project_over_handwritten']:6.2f}  "
                     + " ".join(f"{x:.2f}" for x in each))
    return "\n".join(lines)


def main(args) -> int:
    from .report import report

    res = run_cases(cases(args.dataset, args.rows), args.shards, args.world, args.data, args.repeats, args.read_share)
    return report(res, lambda r: "\n\n".join([*(table(c) for c in r.get("cases", [r])), summary(r)]),
                  lambda r, path: plot(r, path), args)
