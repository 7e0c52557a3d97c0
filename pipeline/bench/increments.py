"""`python -m pipeline bench --mode increments`: what the daily loop buys, measured side by side in one run.

On the drifting daily table (demo.generate_daily: one Delta commit per day), for each day k from 2 on:
- the increment's plan (`prepare(since=day k-1's plan)`: day k's rows only, the fit extended) beside a full
  refit of days 1..k (`prepare` at version k-1): rows read and fit time;
- training: the warm-started chain (day k-1's model, its tables grown with `grow_embedding`, trained on
  day k) beside retraining from scratch on days 1..k: wall time of the same number of epochs;
- quality on day k+1's rows, which no model trained on: ROC AUC and log loss of the chain, of the full
  retrain on days 1..k, and of a model trained on day k alone.
Everything runs in this process (no Ray): the fit and the training are the library's and the job's model,
so the figures are the data path's and the model's, not a cluster's start-up.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .. import demo


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    """ROC AUC by ranks (ties share their average rank)."""
    order = np.argsort(p, kind="stable")
    ranks = np.empty(len(p))
    sorted_p = p[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_p[1:] != sorted_p[:-1]]))
    ends = np.concatenate([starts[1:], [len(p)]])
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, ends - starts)
    pos = y == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def _train(model, optimizer, plan, epochs: int, batch: int, seed: int) -> float:
    import pipeline

    from ..job.model import batch_loss

    t0 = time.perf_counter()
    data = pipeline.rank_data(plan, batch_size=batch, device="cpu", seed=seed, rank=0, world_size=1)
    model.train()
    for epoch in range(epochs):
        data.loader.set_epoch(epoch)
        for b in data.loader:
            loss = batch_loss(data.fitted, model(b.x_num, b.x_cat), b)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return time.perf_counter() - t0


def _score(model, fitted, rows) -> tuple[float, float]:
    import torch

    t = fitted.transform(rows)
    model.eval()
    with torch.no_grad():
        p = torch.sigmoid(model(torch.from_numpy(t.x_num), torch.from_numpy(t.x_cat.astype(np.int64))).squeeze(1)).numpy()
    y = rows["clicked"].to_numpy().astype(np.int64)
    return _auc(y, p), _logloss(y, p)


def run(days: int, rows: int, epochs: int, batch: int, data: str, seed: int = 0) -> dict:
    import pyarrow.compute as pc
    import torch
    from deltalake import DeltaTable

    import pipeline

    from ..config import load
    from ..ingest import build_config
    from ..job.model import build_model

    demo.generate_daily(data, days, rows, seed)
    cfg = load(None, {"data.path": data, "data.label": "clicked", "data.numeric": list(demo.DAILY_NUMERIC),
                      "data.categorical": list(demo.DAILY_CATEGORICAL), "data.val_fraction": 0.0,
                      "train.drop_last": False, "preprocess.vocab_min_count": 2, "preprocess.vocab_max_size": 100_000_000,
                      "train.hidden": [64, 32], "train.embedding_dim": 8})

    def prepare(version: int, since=None):
        t0 = time.perf_counter()
        plan = pipeline.prepare(config=build_config(cfg, settings={"data.version": str(version)}), world_size=1,
                                use_ray=False, since=since)
        return plan, time.perf_counter() - t0

    def fresh(fitted):
        torch.manual_seed(seed)
        m = build_model(fitted, cfg)
        return m, torch.optim.Adam(m.parameters(), lr=cfg.train.lr)

    def day_rows(k: int):
        t = DeltaTable(data, version=k - 1).to_pyarrow_table()
        return t.filter(pc.equal(t["day"], k))

    chain, _ = prepare(0)
    model, opt = fresh(chain.fitted)
    _train(model, opt, chain, epochs, batch, seed)
    out = []
    for k in range(2, days):
        inc, inc_s = prepare(k - 1, since=chain)
        full, full_s = prepare(k - 1)
        growth = inc.fitted.growth(chain.fitted)
        pipeline.grow_embedding(model.embedding, growth, opt, columns=list(inc.fitted.categorical),
                                generator=torch.Generator().manual_seed(seed))
        model.offsets = torch.tensor([0, *np.cumsum(inc.fitted.cardinalities)[:-1]], dtype=torch.int64)
        warm_s = _train(model, opt, inc, epochs, batch, seed)
        full_model, full_opt = fresh(full.fitted)
        full_train_s = _train(full_model, full_opt, full, epochs, batch, seed)
        day_model, day_opt = fresh(inc.fitted)
        _train(day_model, day_opt, inc, epochs, batch, seed)
        test = day_rows(k + 1)
        quality = {name: _score(m, f, test) for name, m, f in (("chain", model, inc.fitted),
                                                                ("full", full_model, full.fitted),
                                                                ("day_only", day_model, inc.fitted))}
        out.append({"day": k, "increment_rows": inc.accounting.rows_read, "full_rows": full.accounting.rows_read,
                    "increment_fit_s": inc.timings["fit_s"], "full_fit_s": full.timings["fit_s"],
                    "increment_prepare_s": inc_s, "full_prepare_s": full_s,
                    "warm_train_s": warm_s, "full_train_s": full_train_s,
                    "growth": {c: list(v) for c, v in growth.items()},
                    **{f"{n}_auc": q[0] for n, q in quality.items()}, **{f"{n}_logloss": q[1] for n, q in quality.items()}})
        print(_line(out[-1]), flush=True)
        chain = inc
    return {"days": days, "rows_per_day": rows, "epochs": epochs, "batch_size": batch, "data": data,
            "cpus": os.cpu_count(), "per_day": out}


_HEAD = (f"{'day':>3}  {'inc rows':>9} {'full rows':>10}  {'fit inc':>8} {'fit full':>8} {'ratio':>6}  "
         f"{'train warm':>10} {'train full':>10} {'ratio':>6}  {'AUC chain':>9} {'full':>6} {'day k':>6}  "
         f"{'logloss chain':>13} {'full':>6} {'day k':>6}")


def _line(r: dict) -> str:
    return (f"{r['day']:>3}  {r['increment_rows']:>9,} {r['full_rows']:>10,}  {r['increment_prepare_s']:>7.2f}s "
            f"{r['full_prepare_s']:>7.2f}s {r['increment_prepare_s'] / r['full_prepare_s']:>6.2f}  "
            f"{r['warm_train_s']:>9.1f}s {r['full_train_s']:>9.1f}s {r['warm_train_s'] / r['full_train_s']:>6.2f}  "
            f"{r['chain_auc']:>9.4f} {r['full_auc']:>6.4f} {r['day_only_auc']:>6.4f}  "
            f"{r['chain_logloss']:>13.4f} {r['full_logloss']:>6.4f} {r['day_only_logloss']:>6.4f}")


def table(res: dict) -> str:
    lines = [f"The daily loop on {res['days']} days of {res['rows_per_day']:,} rows ({res['epochs']} epoch(s), batch "
             f"{res['batch_size']}, one process, {res['cpus']} CPUs): day k's increment (prepare(since=), warm-started "
             f"chain) beside a full refit and retrain on days 1..k; quality on day k+1's rows", _HEAD]
    lines += [_line(r) for r in res["per_day"]]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = res["per_day"]
    days = [r["day"] for r in d]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(days, [r["increment_prepare_s"] / r["full_prepare_s"] for r in d], "o-", label="fit: increment / full refit")
    a.plot(days, [r["warm_train_s"] / r["full_train_s"] for r in d], "s-", label="train: warm chain / full retrain")
    a.set_xlabel("day k")
    a.set_ylabel("cost ratio")
    a.set_ylim(0, 1.05)
    a.legend()
    a.set_title("What a day costs, against days 1..k from scratch")
    for key, label in (("chain_auc", "warm-started chain"), ("full_auc", "full retrain on days 1..k"),
                       ("day_only_auc", "day k alone")):
        b.plot(days, [r[key] for r in d], "o-", label=label)
    b.set_xlabel("day k (scored on day k+1)")
    b.set_ylabel("ROC AUC")
    b.legend()
    b.set_title("Quality on the next day's rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    from .report import report

    data = args.data or f"data/bench-daily-{args.rows}"
    return report(run(args.days, args.rows, args.epochs, args.batch_size, data), table, plot, args)
