"""The built-in job's model parts: sparse embedding gradients update only the rows a batch looked up,
with either sparse optimizer, and the optimizers' state round-trips through a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from pipeline import Config
from pipeline.train import Optimizers, TabularMLP


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
