"""`python -m pipeline bench --mode preprocess --scale 2000000,8000000,32000000`: the fit as the data
grows, on a 3-node Ray cluster started on this machine (`ray.cluster_utils.Cluster`: a head and two
worker nodes, one CPU and 3 GiB of object store each), on the Criteo-shaped files (26 categoricals with the Criteo Kaggle
cardinalities), every value kept (no frequency threshold, no size cap).

For each size, in processes of their own so that no figure carries another's memory:

- the driver: a fresh process joins the cluster and runs `pipeline.prepare` (run.fit_on = ray). Its
  peak RSS (the whole process: imports and Ray client included) and its growth during the fit;
- the count shuffle's reducer and finalize tasks: the most memory one of them held (RSS and USS, at
  the end of its merge), from `plan.timings["shuffle"]`;
- the hand-written counting pass a user writes (pyarrow per file, merged as Arrow tables, sorted: the
  fit half of bench --mode preprocess --dataset criteo's script), one process; the ratio of the
  project's fit to it;
- the same fit in one process (use_ray = False, the same parts), whose vocabularies must have the same
  digest: the same values with the same ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM: since its exec, unlike ru_maxrss, which a child inherits from the
    process that forked it)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def _keys(partitions: int | str) -> dict:
    from .preprocess import _dlrm_keys

    # every value kept; every row fitted (no validation hold-out), as the hand-written pass counts them all
    return _dlrm_keys() | {"vocab_min_count": 1, "vocab_partitions": partitions, "val_fraction": 0.0}


def driver(address: str, path: str, partitions: int | str) -> None:
    """One fit as a driver of the cluster at `address`; prints a JSON line."""
    import threading

    import ray

    import pipeline

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    plan = pipeline.prepare(path, label="label", world_size=1, use_ray=True, **_keys(partitions))
    seconds = time.perf_counter() - t0
    done.set()
    print("RESULT " + json.dumps({
        "prepare_s": seconds, "fit_s": plan.timings["fit_s"], "validate_s": plan.timings["validate_s"],
        "rss_before_fit": base, "rss_peak_during_fit": max(peak[0], _rss()), "rss_peak_process": _peak_rss(),
        "vocab_values": sum(len(v) for v in plan.fitted.vocab), "distinct": sum(
            v.get("distinct", 0) for v in plan.fitted.stats["categorical"].values()),
        "digest": plan.fitted.vocab_digest, "shuffle": plan.timings.get("shuffle", {}), "rows": plan.source.num_rows}),
        flush=True)


def one_process(path: str, partitions: int | str) -> None:
    """The same fit without Ray; prints a JSON line with its digest."""
    import pipeline

    t0 = time.perf_counter()
    plan = pipeline.prepare(path, label="label", world_size=1, use_ray=False, **_keys(partitions))
    print("RESULT " + json.dumps({"fit_s": time.perf_counter() - t0, "digest": plan.fitted.vocab_digest,
                                  "rss_peak_process": _peak_rss()}), flush=True)


def handwritten_counts(path: str) -> None:
    """The counting pass of the hand-written DLRM script (bench_preprocess.handwritten_dlrm), every value
    kept; prints a JSON line."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ..demo import CRITEO_CATEGORICAL

    paths = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    t0 = time.perf_counter()
    parts: list[list[pa.Table]] = [[] for _ in CRITEO_CATEGORICAL]
    for p in paths:
        t = pq.read_table(p, columns=list(CRITEO_CATEGORICAL))
        for j, c in enumerate(CRITEO_CATEGORICAL):
            vc = pc.value_counts(t[c])
            parts[j].append(pa.table({"v": vc.field("values"), "n": vc.field("counts")}))
    kept = 0
    for j in range(len(CRITEO_CATEGORICAL)):
        g = pa.concat_tables(parts[j]).group_by("v").aggregate([("n", "sum")])
        parts[j] = []
        g = g.filter(pc.is_valid(g["v"]))
        kept += len(g["v"].take(pc.sort_indices(g, sort_keys=[("n_sum", "descending"), ("v", "ascending")])))
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "vocab_values": kept,
                                  "rss_peak_process": _peak_rss()}), flush=True)


def _child(call: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", f"from pipeline.bench.scale import *; {call}"], capture_output=True,
                         text=True, timeout=timeout, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{call} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run(sizes: list[int], shards: int, partitions: int | str, check_ids: bool, data_dir: str | None) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from .. import demo
    from ..cluster.runtime import loopback_only

    loopback_only()
    node = dict(num_cpus=1, object_store_memory=3 * 1024**3, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node))
    for _ in range(2):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    res: dict = {"cluster": "3 nodes x 1 CPU, 3 GiB object store each (ray.cluster_utils, one machine)",
                 "cpu_count": os.cpu_count(), "partitions": partitions, "sizes": []}
    try:
        for rows in sizes:
            path = os.path.join(data_dir or "data", f"bench-criteo-{rows}")
            t0 = time.perf_counter()
            demo.generate_criteo(path, rows, shards, seed=0)
            entry = {"rows": rows, "generate_s": time.perf_counter() - t0}
            entry["handwritten"] = _child(f"handwritten_counts({path!r})", 7200)
            entry["project"] = _child(f"driver({cluster.address!r}, {path!r}, {partitions!r})", 7200)
            if check_ids:
                entry["one_process"] = _child(f"one_process({path!r}, {partitions!r})", 7200)
                entry["ids_equal"] = entry["one_process"]["digest"] == entry["project"]["digest"]
            entry["ratio_fit_over_handwritten"] = entry["project"]["fit_s"] / entry["handwritten"]["seconds"]
            res["sizes"].append(entry)
            print(line(entry), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    first, last = res["sizes"][0]["project"], res["sizes"][-1]["project"]
    res["driver_peak_ratio_last_over_first"] = last["rss_peak_process"] / first["rss_peak_process"]
    return res


def line(e: dict) -> str:
    p, h, s = e["project"], e["handwritten"], e["project"]["shuffle"]
    ids = {True: "equal", False: "DIFFER"}.get(e.get("ids_equal"), "not checked")
    return (f"{e['rows']:>12,} {p['distinct']:>12,} {p['rss_peak_process'] / MiB:>9.0f} "
            f"{(p['rss_peak_during_fit'] - p['rss_before_fit']) / MiB:>8.0f} {s.get('partitions', 0):>4} "
            f"{s.get('task_rss_max', 0) / MiB:>8.0f} {s.get('task_uss_max', 0) / MiB:>8.0f} {p['fit_s']:>7.1f} "
            f"{h['seconds']:>7.1f} {h['rss_peak_process'] / MiB:>8.0f} {e['ratio_fit_over_handwritten']:>6.2f}  {ids}")


HEADER = ("        rows     distinct  driver   driver    P  reducer  reducer     fit    hand    hand    fit/   ids vs one\n"
          "                          peak MiB  +fit MiB     RSS MiB  USS MiB       s       s  RSS MiB  hand   process")


def table(res: dict) -> str:
    out = [f"the fit on {res['cluster']}, Criteo-shaped data, every value kept; {res['cpu_count']} cores", HEADER]
    out += [line(e) for e in res["sizes"]]
    out.append(f"driver peak at {res['sizes'][-1]['rows']:,} rows / at {res['sizes'][0]['rows']:,} rows: "
               f"{res['driver_peak_ratio_last_over_first']:.2f}x")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = np.array([e["rows"] for e in res["sizes"]])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(rows, [e["project"]["rss_peak_process"] / MiB for e in res["sizes"]], "o-", label="driver peak RSS")
    a.plot(rows, [e["project"]["shuffle"].get("task_rss_max", 0) / MiB for e in res["sizes"]], "o-",
           label="largest reducer RSS")
    a.plot(rows, [e["handwritten"]["rss_peak_process"] / MiB for e in res["sizes"]], "o--", label="hand-written, one process")
    a.set_xscale("log")
    a.set_xlabel("rows")
    a.set_ylabel("MiB")
    a.legend()
    b.plot(rows, [e["project"]["fit_s"] for e in res["sizes"]], "o-", label="fit on the cluster")
    b.plot(rows, [e["handwritten"]["seconds"] for e in res["sizes"]], "o--", label="hand-written counting pass")
    b.set_xscale("log")
    b.set_xlabel("rows")
    b.set_ylabel("seconds")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    from .report import report

    sizes = [int(float(x)) for x in args.scale.split(",")]
    res = run(sizes, args.shards, args.partitions, not args.no_check_ids, args.data)
    print()
    return report(res, table, plot, args)
