"""The daily loop in a user's own code (examples/ray_train_loop.py and examples/torchrun_loop.py with --out
and --since), apart from tests/test_examples.py so that the two test processes share the Ray Train runs."""

from __future__ import annotations

import re
import sys

import pytest

from test_examples import BIN, run


@pytest.mark.slow
@pytest.mark.parametrize("example", ["torchrun", "ray"])
def test_both_loops_run_two_increments_warm_started_from_the_day_before(tmp_path, example):
    """The daily loop in a user's own code: day 1 in full with --out, then day 2 with --since day 1: it plans
    only its day's rows (prepare(since=)), grows the previous model's embeddings (pipeline.grow_embedding: one
    nn.Embedding per column under Ray Train, one nn.EmbeddingBag of blocks under torchrun) and trains on. A
    day with nothing new trains nothing and keeps the model (torchrun). Each launch costs 20 to 40 s (a Ray
    run starts a Ray of its own), so chains of increments are tested in-process (tests/test_increments.py)."""
    import pyarrow.compute as pc
    import torch
    from deltalake import DeltaTable

    from pipeline import demo

    table = str(tmp_path / "daily")
    launch = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "examples/torchrun_loop.py"] \
        if example == "torchrun" else [sys.executable, "examples/ray_train_loop.py", "--workers", "2",
                                       "--checkpoint-every", "0", "--storage", str(tmp_path / "runs")]
    common = [*launch, "--data", table, "--label", "clicked", "--epochs", "1", "--batch-size", "128"]
    sizes = []
    for day in (1, 2):
        demo.generate_daily(table, day, 2500)
        since = ["--since", str(tmp_path / f"day{day - 1}")] if day > 1 else []
        out = run([*common, "--out", str(tmp_path / f"day{day}"), *since], timeout=400)
        rows = DeltaTable(table, version=day - 1).to_pyarrow_table()
        planned = re.search(r"\[fit\] \d+ shards, ([\d,]+) rows", out).group(1)
        assert planned == f"{rows.filter(pc.equal(rows['day'], day)).num_rows:,}"  # only the day's rows planned
        if day > 1:
            assert f"rows added after version {day - 2} up to version {day - 1}" in out, out[-3000:]
        saved = torch.load(tmp_path / f"day{day}" / "model.pt", weights_only=False)["model"]
        sizes.append(sum(v.shape[0] for k, v in saved.items() if k.startswith("embedding")))
    assert all(a < b for a, b in zip(sizes, sizes[1:]))  # the tables grew with the new users and items
    if example == "ray":  # the empty day once is enough (each Ray run starts a Ray of its own)
        return
    out = run([*common, "--out", str(tmp_path / "day3"), "--since", str(tmp_path / "day2")])
    assert "nothing new after version 1" in out
    assert (tmp_path / "day3" / "plan.pkl").exists() and (tmp_path / "day3" / "model.pt").exists()
