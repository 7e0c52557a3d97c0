"""Nothing waits forever: a cluster whose CPUs the training workers fill still trains (each rank reads
its share in its own worker), a cluster too small for the workers stops at once in one paragraph, and
a stage that stops making progress ends with a message saying what it waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeline
from pipeline.cluster.ray_side import watched

REPO = Path(__file__).resolve().parents[1]


def cli(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    from pipeline import demo

    path = str(tmp_path_factory.mktemp("small"))
    demo.generate(path, rows=6000, shards=2, seed=4)
    return path


COMMON = ["--config", "configs/demo.toml", "--train.epochs", "1", "--train.batch_size", "256", "--train.hidden", "[16]"]


@pytest.mark.slow
def test_workers_that_fill_every_cpu_still_train(small, tmp_path):
    t0 = time.monotonic()
    cp = cli(["train", *COMMON, "--data.path", small, "--run.output", str(tmp_path), "--run.num_cpus", "2",
              "--train.num_workers", "2", "--loader.read_share", "ray_data"])  # Ray Data tasks would find no CPU
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out[-4000:]
    assert "take all 2 CPUs of the cluster" in out and "read in this worker" in out, out[-4000:]
    assert "[train] done" in out and "may hang forever" not in out
    assert time.monotonic() - t0 < 200


@pytest.mark.slow
def test_a_cluster_too_small_for_the_workers_stops_at_once(small, tmp_path):
    cp = cli(["train", *COMMON, "--data.path", small, "--run.output", str(tmp_path), "--run.num_cpus", "2",
              "--train.num_workers", "3"], timeout=120)
    assert cp.returncode == 2, (cp.stdout + cp.stderr)[-3000:]
    assert "train.num_workers = 3 needs 3 CPUs" in cp.stderr and "has 2" in cp.stderr
    assert cp.stderr.count("\n") == 1 and "Traceback" not in cp.stderr


def test_a_stalled_stage_ends_saying_what_it_waited_for():
    def slow():
        yield 1
        time.sleep(5)
        yield 2

    got = []
    with pytest.raises(pipeline.StallError, match="waited for the answer"):
        for x in watched(slow(), 0.5, lambda: f"waited for the answer after {got}"):
            got.append(x)
    assert got == [1]

    def failing():
        yield 1
        raise RuntimeError("wrapped") from pipeline.DataError("the real problem")

    with pytest.raises(pipeline.DataError, match="the real problem"):
        list(watched(failing(), 5, lambda: "never"))
