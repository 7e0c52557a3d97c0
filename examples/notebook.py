"""A single process, as in a notebook: no Ray, no launcher. Prepare, train a few epochs, serve.

    python examples/notebook.py --data data/demo --label segment
"""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import torch
from torch import nn

import pipeline


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/demo")
    p.add_argument("--label", default="segment")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()

    # Features inferred from the schema (the other targets excluded), the target kind detected from its type.
    plan = pipeline.prepare(args.data, label=args.label, exclude=[c for c in ("label", "segment", "spend") if c != args.label])
    print("\n".join(plan.describe()))
    data = pipeline.rank_data(plan, batch_size=512)  # rank 0 of 1: every training row
    target = data.fitted.target()
    classes = target.num_classes if target.kind == "multiclass" else 1

    f = data.fitted
    model = nn.Sequential(nn.Linear(f.num_features + len(f.categorical), 64), nn.ReLU(), nn.Linear(64, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def loss_of(out, y):
        if target.kind == "multiclass":
            return nn.functional.cross_entropy(out, y.long())
        if target.kind == "binary":
            return nn.functional.binary_cross_entropy_with_logits(out[:, 0], y)
        return nn.functional.mse_loss(out[:, 0], y)

    features = lambda b: torch.cat([b.x_num, b.x_cat.float()], dim=1)  # noqa: E731
    for epoch in range(args.epochs):
        data.loader.set_epoch(epoch)
        for batch in data.loader:
            loss = loss_of(model(features(batch)), batch.y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            val = data.val.get_batch(torch.arange(len(data.val)))
            out = model(features(val))
            metric = ((out.argmax(1) == val.y.long()).float().mean() if target.kind == "multiclass" else
                      ((out[:, 0] > 0).float() == val.y).float().mean() if target.kind == "binary" else
                      loss_of(out, val.y).sqrt() * target.std)
        print(f"epoch {epoch + 1}: train loss {loss.item():.4f}, validation "
              f"{'accuracy' if target.kind != 'regression' else 'RMSE'} {metric.item():.4f}")

    # Serving: the fitted preprocessing alone, no Ray, on raw rows; predictions back in the data's terms.
    raw = pq.read_table(plan.source.shards[0].path).slice(0, 5)
    t = data.fitted.transform(raw, with_target=False)
    with torch.no_grad():
        out = model(torch.cat([torch.from_numpy(t.x_num), torch.from_numpy(t.x_cat).float()], dim=1))
    pred = out.argmax(1) if target.kind == "multiclass" else (out[:, 0] > 0).long() if target.kind == "binary" else out[:, 0]
    print("served:", list(data.fitted.inverse_target(pred.numpy(), target.name)), "actual:", raw[target.name].to_pylist())


if __name__ == "__main__":
    main()
