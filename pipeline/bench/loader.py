"""`python -m pipeline bench`: this project's loader beside the alternatives, in one run, on the same
in-memory rows and the same shuffled order.

  (a) textbook: per-row __getitem__ in a torch DataLoader with default collate (num_workers 0 and 2)
  (b) Ray Data: iter_torch_batches over the same rows (already in the shuffled order: no shuffle cost)
  (c) this project: DeviceLoader
  (d) limit: index_select of the same indices into preallocated buffers, in a bare loop
  (e) ceiling: the same order gathered ~4 MiB per index_select with no batches cut (the memory
      system's rate for this random access; a loader cannot beat it)

Figures are rows/s; ratios are measured side by side, so machine noise affects all columns alike.
Slow methods are measured over a time budget (their rate is steady after the first batch).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from ..feed.dataset import TabularDataset
from ..feed.loader import CHUNK_BYTES, DeviceLoader
from ..feed.sampler import BatchSampler


@dataclass
class Data:
    ds: TabularDataset
    perm: torch.Tensor  # the shuffled order every method follows


def make_data(rows: int, features: int, cats: int, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    ds = TabularDataset.from_numpy(torch.randn(rows, features, generator=g).numpy(),
                                   torch.randint(0, 1000, (rows, cats), generator=g, dtype=torch.int32).numpy(),
                                   torch.randint(0, 2, (rows,), generator=g).float().numpy())
    sampler = BatchSampler(rows, 1, seed=seed, shuffle=True, drop_last=False)
    return Data(ds, sampler.order(0))


def _rate(batches: Iterable, rows_of: Callable, max_rows: int, max_seconds: float) -> float:
    """rows/s after the first batch (which pays for worker start-up and first-touch), until max_rows
    rows or max_seconds have passed."""
    it = iter(batches)
    next(it)
    rows, t0 = 0, time.perf_counter()
    for b in it:
        rows += rows_of(b)
        if rows >= max_rows or time.perf_counter() - t0 > max_seconds:
            break
    return rows / (time.perf_counter() - t0)


def _rows(b) -> int:
    return b[2].shape[0]


class _PermSampler(torch.utils.data.Sampler):
    def __init__(self, perm: torch.Tensor):
        self.perm = perm.tolist()

    def __iter__(self):
        return iter(self.perm)

    def __len__(self):
        return len(self.perm)


class RowDataset(torch.utils.data.Dataset):
    """The textbook map-style dataset: one row per __getitem__, batched by default_collate."""

    def __init__(self, ds: TabularDataset):
        self.x_num, self.x_cat, self.y = ds.x_num, ds.x_cat, ds.y

    def __len__(self) -> int:
        return self.y.shape[0]

    def __getitem__(self, i: int):
        return self.x_num[i], self.x_cat[i], self.y[i]


def bench_textbook(d: Data, batch: int, workers: int, pin: bool, max_rows: int, budget: float) -> float:
    dl = torch.utils.data.DataLoader(RowDataset(d.ds), batch_size=batch, sampler=_PermSampler(d.perm), num_workers=workers,
                                     pin_memory=pin, persistent_workers=False)
    return _rate(dl, _rows, max_rows, budget)


_RAY_CACHE: dict[int, object] = {}


def bench_ray(d: Data, batch: int, max_rows: int, budget: float) -> float:
    if id(d) not in _RAY_CACHE:
        _RAY_CACHE[id(d)] = _ray_dataset(d)
    it = _RAY_CACHE[id(d)].iter_torch_batches(batch_size=batch, drop_last=False)
    return _rate(it, lambda b: b["y"].shape[0], max_rows, budget)


def _ray_dataset(d: Data):
    """The same rows as a materialised Ray Dataset, already in the shuffled order."""
    import pyarrow as pa
    import ray
    from ray.data.extensions import ArrowTensorArray

    ds = d.ds
    p = d.perm.numpy()
    n = len(p)
    tables = []
    for s in range(0, n, 100_000):
        q = p[s:s + 100_000]
        tables.append(pa.table({"x_num": ArrowTensorArray.from_numpy(ds.x_num.numpy()[q]),
                                "x_cat": ArrowTensorArray.from_numpy(ds.x_cat.numpy()[q]),
                                "y": pa.array(ds.y.numpy()[q])}))
    return ray.data.from_arrow(tables).materialize()


def bench_loader(d: Data, batch: int, device: str, max_rows: int, budget: float) -> float:
    sampler = BatchSampler(len(d.ds), batch, seed=0, shuffle=True, drop_last=False)
    loader = DeviceLoader(d.ds, sampler, device, placement="host")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    r = _rate(loader, _rows, max_rows, budget)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return r


def bench_limit(d: Data, batch: int, max_rows: int, budget: float) -> float:
    """One index_select per batch of the same rows into one preallocated buffer, nothing else."""
    src = d.ds.rows
    out = torch.empty(batch, src.shape[1])

    def loop():
        for s in range(0, len(d.perm), batch):
            idx = d.perm[s:s + batch]
            if idx.numel() != batch:
                return
            yield torch.index_select(src, 0, idx, out=out)

    return _rate(loop(), lambda b: b.shape[0], max_rows, budget)


def bench_bulk(d: Data, max_rows: int, budget: float) -> float:
    """The memory system's ceiling for this order: the same rows gathered ~4 MiB per index_select (the
    loader's chunk size), with no batches cut from them. Batch size plays no part."""
    src = d.ds.rows
    n = len(d.perm)
    chunk = min(CHUNK_BYTES // (4 * d.ds.width), max(1, n // 4))

    def loop():
        while True:  # round and round the order until max_rows or the time budget
            for s in range(0, n - chunk + 1, chunk):
                yield torch.index_select(src, 0, d.perm[s:s + chunk])

    return _rate(loop(), lambda b: b.shape[0], max_rows, budget)


def loader_peak_memory(d: Data, batch: int) -> int:
    """Peak resident memory added while the loader runs one epoch (sampled every millisecond)."""
    import ctypes
    import gc

    def rss() -> int:  # Linux; elsewhere the figure reads 0
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    sampler = BatchSampler(len(d.ds), batch, seed=1, shuffle=True, drop_last=False)
    loader = DeviceLoader(d.ds, sampler, "cpu")
    gc.collect()
    try:  # hand freed heap back to the OS, so reuse of earlier garbage cannot hide the loader's memory
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    base = rss()
    peak = base
    done = threading.Event()

    def watch():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss())
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    for _ in loader:
        pass
    done.set()
    t.join()
    return max(0, max(peak, rss()) - base)


def cuda_checks(d: Data, batch: int, budget: float) -> dict:
    """Host-to-device GB/s of the loader beside a plain pinned copy of the same bytes, and the data-wait
    share of a real training step fed by the loader."""
    from torch import nn

    from ..feed.metrics import StepStats, timed

    dev = torch.device("cuda")
    row_bytes = d.ds.width * 4
    steps = max(10, min(2000, len(d.ds) // batch))
    # Plain pinned copy of the same bytes per batch, contiguous, no gather.
    src = torch.empty(batch * row_bytes, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        src.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    plain = steps * batch * row_bytes / (time.perf_counter() - t0) / 1e9
    sampler = BatchSampler(len(d.ds), batch, seed=0, shuffle=True, drop_last=False)
    loader = DeviceLoader(d.ds, sampler, dev, placement="host")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += 1
        if n >= steps:
            break
    torch.cuda.synchronize()
    ours = n * batch * row_bytes / (time.perf_counter() - t0) / 1e9
    model = nn.Sequential(nn.Linear(d.ds.x_num.shape[1], 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters())
    out = {"h2d_gbps_loader": round(ours, 2), "h2d_gbps_plain_pinned": round(plain, 2)}
    for placement in ("host", "device"):
        sampler = BatchSampler(len(d.ds), batch, seed=0, shuffle=True, drop_last=True)
        loader = DeviceLoader(d.ds, sampler, dev, placement=placement)
        stats = StepStats()
        t0 = time.perf_counter()
        for b in timed(loader, stats):
            loss = nn.functional.binary_cross_entropy_with_logits(model(b.x_num).squeeze(1), b.y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if time.perf_counter() - t0 > budget:
                break
        torch.cuda.synchronize()
        out[f"train_step_data_wait_pct_{placement}"] = round(stats.data_wait_pct, 2)
        out[f"train_step_rows_per_s_{placement}"] = round(stats.rows / (time.perf_counter() - t0), 1)
    return out


def run(rows: int, features: int, cats: int, batches: list[int], device: str, budget: float, with_ray: bool,
        repeats: int = 3) -> dict:
    """Every method `repeats` times, interleaved (a, b, c, d, a, b, ...), best rate kept: a noisy
    neighbour then slows one sample, not one method."""
    d = make_data(rows, features, cats)
    shard_bytes = d.ds.nbytes
    pin = device.startswith("cuda")
    results: dict = {"rows": rows, "features": features, "categorical": cats, "device": device, "repeats": repeats,
                     "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "by_batch": {}}
    if with_ray:
        import ray

        if not ray.is_initialized():
            ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                     logging_level="ERROR")
        from ..cluster.runtime import quiet_ray_data

        quiet_ray_data(progress=False)
    for b in batches:
        methods: dict[str, Callable[[], float]] = {
            "a_textbook_w0": lambda: bench_textbook(d, b, 0, pin, rows, budget),
            "a_textbook_w2": lambda: bench_textbook(d, b, 2, pin, rows, budget),
            "c_loader": lambda: bench_loader(d, b, device, rows, budget * 2),
            "d_limit": lambda: bench_limit(d, b, rows, budget * 2),
        }
        if b == batches[0]:
            methods["e_bulk_gather"] = lambda: bench_bulk(d, rows, budget * 2)
        if with_ray:
            methods["b_ray_iter_torch_batches"] = lambda: bench_ray(d, b, rows, budget)
        samples: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(repeats):
            for k, fn in methods.items():
                samples[k].append(fn())
        r: dict = {k: max(v) for k, v in samples.items()}
        r["samples"] = samples
        best_a = max(r["a_textbook_w0"], r["a_textbook_w2"])
        r["ratio_c_over_a"] = r["c_loader"] / best_a
        if with_ray:
            r["ratio_c_over_b"] = r["c_loader"] / r["b_ray_iter_torch_batches"]
        r["ratio_c_over_d"] = r["c_loader"] / r["d_limit"]
        results["by_batch"][str(b)] = r
        if "e_bulk_gather" in r:
            results["bulk_gather"] = r.pop("e_bulk_gather")
    results["shard_bytes"] = shard_bytes
    results["loader_peak_extra_bytes"] = loader_peak_memory(d, batches[0])
    results["loader_peak_extra_pct_of_shard"] = 100.0 * results["loader_peak_extra_bytes"] / shard_bytes
    if device.startswith("cuda"):
        results["cuda"] = cuda_checks(d, batches[-1], budget * 4)
    return results


def table(res: dict) -> str:
    cols = [("a_textbook_w0", "(a) per-row w0"), ("a_textbook_w2", "(a) per-row w2"),
            ("b_ray_iter_torch_batches", "(b) Ray iter_torch"), ("c_loader", "(c) this loader"), ("d_limit", "(d) limit")]
    lines = [f"rows {res['rows']:,} x {res['features']} float32 + {res['categorical']} int32 ids + label, "
             f"device {res['device']}, torch threads {res['torch_threads']}, shuffled", "",
             f"{'batch':>6} " + " ".join(f"{name:>18}" for _, name in cols) + f" {'c/a':>7} {'c/b':>7} {'c/d':>6}"]
    for b, r in res["by_batch"].items():
        vals = " ".join(f"{r[k] / 1e6:>15.3f} M/s" if k in r else f"{'-':>18}" for k, _ in cols)
        cb = f"{r['ratio_c_over_b']:>7.1f}" if "ratio_c_over_b" in r else f"{'-':>7}"
        lines.append(f"{b:>6} {vals} {r['ratio_c_over_a']:>7.1f} {cb} {r['ratio_c_over_d']:>6.2f}")
    lines.append("")
    if "bulk_gather" in res:
        e = res["bulk_gather"]
        ray_b = {b: r.get("b_ray_iter_torch_batches") for b, r in res["by_batch"].items()}
        vs = ", ".join(f"{e / v:.0f}x Ray at batch {b}" for b, v in ray_b.items() if v)
        lines.append(f"(e) ceiling, the same order gathered in ~4 MiB chunks, no batches cut: {e / 1e6:.3f} M rows/s"
                     + (f" ({vs})" if vs else ""))
    lines.append(f"loader peak memory beyond the shard: {res['loader_peak_extra_bytes'] / 2**20:.1f} MiB "
                 f"= {res['loader_peak_extra_pct_of_shard']:.1f}% of the {res['shard_bytes'] / 2**20:.0f} MiB shard")
    if "cuda" in res:
        lines.append("cuda: " + ", ".join(f"{k} {v}" for k, v in res["cuda"].items()))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["a_textbook_w0", "a_textbook_w2", "b_ray_iter_torch_batches", "c_loader", "d_limit"]
    labels = ["(a) per-row\nworkers 0", "(a) per-row\nworkers 2", "(b) Ray Data\niter_torch_batches",
              "(c) this loader", "(d) limit\nindex_select"]
    fig, ax = plt.subplots(figsize=(10, 5))
    batches = list(res["by_batch"])
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        r = res["by_batch"][b]
        vals = [r.get(k, 0) / 1e6 for k in keys]
        bars = ax.bar(np.arange(len(keys)) + i * width, vals, width, label=f"batch {b}")
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in vals], fontsize=7)
    ax.set_xticks(np.arange(len(keys)) + width * (len(batches) - 1) / 2, labels)
    ax.set_yscale("log")
    ax.set_ylabel("million rows / s (log scale)")
    ax.set_title(f"Loader throughput, {res['rows']:,} rows x {res['features']} features, shuffled, {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
