"""The built-in job's model: an MLP over the features and per-column embeddings, a head per target, the
losses, and the optimizers (sparse embedding tables beside dense layers)."""

from __future__ import annotations


import numpy as np
import torch
from torch import nn

import pipeline
from pipeline import Config


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
