"""The built-in job's model parts: sparse embedding gradients update only the rows a batch looked up,
with either sparse optimizer, and the optimizers' state round-trips through a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from pipeline import Config
from pipeline.job.model import Optimizers, TabularMLP


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_sparse_embeddings_update_only_the_rows_looked_up(optimizer):
    torch.manual_seed(0)
    cfg = Config.model_validate({"train": {"sparse_optimizer": optimizer}})
    model = TabularMLP(3, (50, 70), 4, (8,), 1, sparse=True)
    opt = Optimizers(model, cfg, sparse=True)
    assert set(opt.parts) == {"dense", "sparse"}
    before = model.embedding.weight.detach().clone()
    x_num, x_cat = torch.randn(16, 3), torch.stack([torch.randint(0, 5, (16,)), torch.randint(0, 7, (16,))], 1).int()
    loss = nn.functional.binary_cross_entropy_with_logits(model(x_num, x_cat)[:, 0], torch.ones(16))
    opt.zero_grad()
    loss.backward()
    assert model.embedding.weight.grad.is_sparse
    opt.step()
    changed = (model.embedding.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    assert changed and set(changed) <= set(range(5)) | set(range(50, 57))  # column 1's ids are offset by 50
    state = opt.state_dict()
    again = Optimizers(TabularMLP(3, (50, 70), 4, (8,), 1, sparse=True), cfg, sparse=True)
    again.load_state_dict(state)
    assert again.state_dict()["sparse"]["param_groups"] == state["sparse"]["param_groups"]


def test_a_checkpoint_is_whole_while_reported_and_leaves_no_copy_behind(monkeypatch, tmp_path):
    """Ray Train copies a reported checkpoint into the run's storage; the worker's own directory must not
    outlive the report (one per checkpoint, vocabularies included, would fill a long run's /tmp)."""
    import ray.train

    from helpers import numbered_dataset
    from pipeline import BatchSampler, WorkerLoader
    from pipeline.job import loop
    from test_preprocess import fit_local, frame

    fitted = fit_local(frame(300, 1))
    model = TabularMLP(3, (50, 70), 4, (8,), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = WorkerLoader(numbered_dataset(64), BatchSampler(64, 16, seed=0))
    seen = []

    def report(metrics, checkpoint=None):
        d = checkpoint.path if checkpoint is not None else None
        seen.append((metrics, d, sorted(os.listdir(d)) if d else None))
        if d:
            state = torch.load(os.path.join(d, loop.CHECKPOINT_FILE), weights_only=False)
            assert state["history"] == [{"epoch": 1}] and state["partial"] == {"sums": [1.0]}

    monkeypatch.setattr(ray.train, "report", report)
    loop._report({"epoch": 1}, True, model, opt, loader, [{"epoch": 1}], fitted, "{}", {"sums": [1.0]})
    loop._report({"epoch": 1}, False, model, opt, loader, [], fitted, "{}")
    (m, d, files), (m2, d2, _) = seen
    assert {loop.CHECKPOINT_FILE, loop.PREPROCESSOR_FILE, "config.json"} <= set(files)
    assert not os.path.exists(d) and d2 is None  # removed once reported; rank > 0 writes nothing


@pytest.mark.parametrize("label,kind", [("segment", "multiclass"), ("spend", "regression")])
def test_a_single_target_model_learns_in_one_process(demo_dir, label, kind):
    """The job's model, loss and evaluation for one multiclass or one regression target, through the public
    API in this process (test_integration runs the whole job under Ray Train with both kinds as the targets of
    one model): the kind is detected, the head and loss follow it, the first target's figures are the
    unprefixed ones, and the model learns well beyond its baseline. Rows without a target are dropped and
    said, never trained on."""
    import pipeline
    from conftest import make_config
    from pipeline.job.evaluate import evaluate
    from pipeline.job.model import batch_loss, build_model

    cfg = make_config(demo_dir, **{"train.batch_size": 256, "train.hidden": [64, 32], "data.label": label})
    plan = pipeline.prepare(config=cfg, use_ray=False, world_size=1)
    assert [t.kind for t in plan.fitted.targets] == [kind]
    acct = plan.accounting.as_dict()
    if kind == "regression":  # the demo's spend has nulls; each is a dropped row, with its reason
        assert acct["dropped_by_reason"] == {"null or NaN target in 'spend'": 24_000 - acct["rows_used"]} and \
            acct["rows_used"] < 24_000, acct
    data = pipeline.rank_data(plan, rank=0, world_size=1, device="cpu")
    torch.manual_seed(0)
    model = build_model(plan.fitted, cfg)
    opt = Optimizers(model, cfg, sparse=False)
    first = None
    for epoch in range(3):
        data.loader.set_epoch(epoch)
        for batch in data.loader:
            loss = batch_loss(plan.fitted, model(batch.x_num, batch.x_cat), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            first = loss.item() if first is None else first
    assert loss.item() < first
    last = evaluate(model, data.val, plan.fitted, torch.device("cpu"))
    if kind == "regression":  # RMSE in the target's units, well under predicting the mean
        assert last["metric"] == "val_rmse" and last["val_rmse"] < 0.6 * last["baseline_rmse"], last
        assert last["spend:val_rmse"] == last["val_rmse"]
    else:
        assert last["metric"] == "val_acc" and last["val_acc"] > last["baseline_acc"] + 0.05, last
        assert last["segment:val_acc"] == last["val_acc"] and "val_auc" not in last
