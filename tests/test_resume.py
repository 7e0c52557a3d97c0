"""Exact mid-epoch resume after a real stop: the training process is SIGKILLed after a mid-epoch
checkpoint, a new process resumes the run, and from the checkpoint on every rank sees exactly the
batches an uninterrupted run sees (compared by per-step digests of the row ids)."""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import expected_batches
from pipeline import demo

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cmd(data, out, name):
    return [sys.executable, "-m", "pipeline", "train", "--data.path", data, "--run.output", out, "--run.name", name,
            "--run.resume", "true", "--train.epochs", "2", "--train.batch_size", "128", "--train.hidden", "[16]",
            "--train.num_workers", "2", "--train.checkpoint_every_steps", "10", "--train.trace_batches", "true"]


def env():
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": ROOT}


def read_trace(run_dir, rank):
    path = os.path.join(run_dir, f"trace-rank{rank}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(line.split()) for line in f if line.strip()]


def test_killed_run_resumes_exactly(tmp_path):
    data = str(tmp_path / "data")
    demo.generate(data, rows=12_000, shards=4, seed=3)
    out = str(tmp_path / "runs")

    # What an uninterrupted run traces, computed without Ray from the same dataset and sampler code
    # (tests/test_multinode.py checks this against a real uninterrupted run).
    batches, _, steps_per_epoch = expected_batches(12_000, 2, 128, 2)
    expected = {r: [(str(e), str(k), hashlib.sha1(batches[(r, e, k)].tobytes()).hexdigest()[:16])
                    for e in range(2) for k in range(1, steps_per_epoch + 1)] for r in (0, 1)}
    assert steps_per_epoch > 20

    run_dir = os.path.join(out, "cut")
    log = tmp_path / "killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(train_cmd(data, out, "cut"), env=env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + 300
    while len(read_trace(run_dir, 0)) < 25 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended (exit code {proc.poll()}) before it could be killed; its log:\n" \
                                f"{log.read_text()[-6000:]}"
    # A real stop: driver, local Ray and training workers. Ray starts its workers in process groups of
    # their own, so the whole tree is killed, and waited for: a worker that outlived its raylet for a
    # moment would otherwise go on writing trace lines after `before` is read.
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"processes of the killed run still alive: {alive}"
    before = {r: read_trace(run_dir, r) for r in (0, 1)}
    assert 25 <= len(before[0]) < 2 * steps_per_epoch
    assert all(before[r] == expected[r][: len(before[r])] for r in (0, 1))  # the killed run was on track

    resumed = subprocess.run(train_cmd(data, out, "cut"), env=env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for r in (0, 1):
        after = read_trace(run_dir, r)[len(before[r]):]
        first = (int(after[0][0]), int(after[0][1]))
        # It continued from a mid-epoch checkpoint (step 10, 20, ... + 1), not from the start of the run.
        assert first[1] % 10 == 1 and first != (0, 1), first
        start = next(i for i, (e, s, _) in enumerate(expected[r]) if (int(e), int(s)) == first)
        assert after == expected[r][start:], f"rank {r} saw different batches after resuming at {first}"
    metrics = json.load(open(os.path.join(run_dir, "metrics.json")))
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert metrics["accounting"]["balanced"]

    # Resuming with another batch size could not continue the same batches: refused up front, in one
    # paragraph, with no traceback and nothing trained. (Another number of workers goes on: test_elastic.)
    other = subprocess.run([*train_cmd(data, out, "cut"), "--train.batch_size", "64"], env=env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 2, other.stderr[-3000:]
    assert "cannot resume run" in other.stderr and "train.batch_size = 128 there, 64 now" in other.stderr
    assert "Traceback" not in other.stderr and "[train]" not in other.stdout
