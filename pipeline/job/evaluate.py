"""The built-in job's evaluation: per-target figures over every rank's validation rows (loss, accuracy,
AUC from score histograms summed over ranks, log loss, RMSE) beside their baselines, and how they print."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .model import _target_columns, head_widths, per_row_loss


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
