"""The built-in job's model parts: sparse embedding gradients update only the rows a batch looked up,
with either sparse optimizer, and the optimizers' state round-trips through a checkpoint."""

from __future__ import annotations

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
