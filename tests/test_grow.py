"""Warm start (pipeline.grow_embedding): an embedding table grown to an increment's id counts keeps every
known row bit for bit at its column's new place, starts the new rows as a fresh module would, and carries
the optimizer's per-row state the same way, for dense and sparse optimizers alike; then it trains on."""

import pytest
import torch
from torch import nn

import pipeline
from pipeline.errors import PipelineError

BEFORE, AFTER = [4, 1, 6], [7, 1, 9]  # rows per column block (column b did not grow)


def trained(module, opt, steps: int = 3):
    for s in range(steps):
        ids = torch.tensor([[0, 4, 5], [3, 4, 10], [1, 4, 7]])
        out = module(ids)  # a bag: each row of ids is one bag
        opt.zero_grad()
        out.pow(2).sum().backward()
        opt.step()


def placed(before, after):
    """(old row, new row) of every known row: a column's ids stay, its block moves by the growth before it."""
    out, old_at, new_at = [], 0, 0
    for b, a in zip(before, after):
        out += [(old_at + i, new_at + i) for i in range(b)]
        old_at, new_at = old_at + b, new_at + a
    return out


OPTIMIZERS = {
    "adam": (False, lambda p: torch.optim.Adam(p, lr=0.1)),
    "adamw": (False, lambda p: torch.optim.AdamW(p, lr=0.1)),
    "sgd-momentum": (False, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "adagrad": (False, lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.5)),
    "sparse-adam": (True, lambda p: torch.optim.SparseAdam(p, lr=0.1)),
    "sparse-sgd": (True, lambda p: torch.optim.SGD(p, lr=0.1)),
}


@pytest.mark.parametrize("kind", ["embedding", "bag"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_known_rows_and_their_optimizer_state_are_kept_bit_for_bit_before_the_first_step(kind, name):
    sparse, make = OPTIMIZERS[name]
    torch.manual_seed(0)
    module = nn.Embedding(sum(BEFORE), 5, sparse=sparse) if kind == "embedding" else \
        nn.EmbeddingBag(sum(BEFORE), 5, mode="sum", sparse=sparse)
    opt = make(module.parameters())
    trained(module, opt)
    old_w = module.weight.detach().clone()
    old_state = {k: v.clone() for k, v in opt.state[module.weight].items() if torch.is_tensor(v)}
    gen = torch.Generator().manual_seed(7)
    assert pipeline.grow_embedding(module, (BEFORE, AFTER), opt, generator=gen) is module
    w = module.weight.detach()
    assert w.shape == (sum(AFTER), 5) and module.num_embeddings == sum(AFTER)
    moved = placed(BEFORE, AFTER)
    for o, n in moved:
        assert torch.equal(w[n], old_w[o])  # bit for bit
    fresh = sorted(set(range(sum(AFTER))) - {n for _, n in moved})
    assert torch.equal(w[fresh], torch.randn(len(fresh), 5, generator=torch.Generator().manual_seed(7)))
    state = opt.state[module.weight]
    for k, v in old_state.items():
        if v.dim() == 0:
            assert torch.equal(state[k], v)  # Adam's step count
            continue
        for o, n in moved:
            assert torch.equal(state[k][n], v[o])
        start = 0.5 if k == "sum" else 0.0  # Adagrad starts a row at its initial accumulator, the rest at zero
        assert torch.all(state[k][fresh] == start)
    trained(module, opt, steps=2)  # the optimizer steps on the grown table
    assert torch.isfinite(module.weight).all()


def test_a_vocab_hash_columns_buckets_follow_its_grown_vocabulary():
    """vocab+hash: ids 0..V are the vocabulary (0 unknown), then B hash buckets; a grown vocabulary moves the
    buckets to the block's new end, each bucket's row with them."""
    module = nn.Embedding(3 + 4 + 2, 3)  # column a: 2 values + unknown, then 4 buckets; column b: 2 rows
    old = module.weight.detach().clone()
    pipeline.grow_embedding(module, {"a": (7, 9, 4), "b": (2, 2)})
    w = module.weight.detach()
    assert torch.equal(w[:3], old[:3]) and torch.equal(w[5:9], old[3:7]) and torch.equal(w[9:], old[7:])


def test_a_growth_by_column_name_picks_the_tables_blocks_and_a_shrink_or_another_model_is_refused():
    growth = {"a": (4, 7), "b": (1, 1), "c": (6, 9), "unused": (3, 5)}
    module = nn.Embedding(11, 2)
    pipeline.grow_embedding(module, growth, columns=["a", "b", "c"])
    assert module.weight.shape[0] == 17
    with pytest.raises(PipelineError, match="has 17 rows but"):
        pipeline.grow_embedding(module, growth)  # all four columns: not this table
    with pytest.raises(PipelineError, match="would shrink"):
        pipeline.grow_embedding(nn.Embedding(10, 2), ([4, 6], [5, 5]))


def test_the_daily_table_gains_one_commit_per_day_with_drifting_users_and_keeps_its_days(tmp_path):
    """`generate --generate.days N`: a Delta table, day k at version k-1, each call appending the days it lacks
    (the days before untouched); every day brings users no earlier day had, and some old ones stop coming."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from pipeline import demo

    uri = str(tmp_path / "daily")
    assert demo.generate_daily(uri, 2, 4000) == [1, 2]
    first = DeltaTable(uri).to_pyarrow_table().sort_by("user")
    assert demo.generate_daily(uri, 4, 4000) == [3, 4] and demo.generate_daily(uri, 4, 4000) == []
    t = DeltaTable(uri)
    assert t.version() == 3 and [h["operation"] for h in t.history()].count("WRITE") == 4
    again = DeltaTable(uri, version=1).to_pyarrow_table().sort_by("user")
    assert again.equals(first)  # the days before are what they were
    rows = t.to_pyarrow_table()
    users = [set(rows.filter(pc.equal(rows["day"], d))["user"].to_pylist()) for d in range(1, 5)]
    assert all(len(users[d] - set().union(*users[:d])) > 0.3 * len(users[d]) for d in range(1, 4))  # new users
    assert len(users[0] - users[3]) > 0.3 * len(users[0])  # faded
    rate = pc.mean(rows["clicked"].cast("float64")).as_py()
    assert 0.05 < rate < 0.5
    with pytest.raises(PipelineError, match="other settings"):
        demo.generate_daily(uri, 5, 3000)
