"""Fault tolerance with a REAL process killed (SIGKILL) while the job runs: a Ray Data worker in the fit.

The test runs the CLI in a subprocess with its own private local Ray (`address="local"`), finds the
Ray worker process running a fit task among that subprocess's descendants (by the title Ray gives it
while the task runs: `ray::fit_group`), kills it, and checks that the job still finishes with exactly
the right result: Ray Data retries the lost task (its tasks default to max_retries=-1), and the fit
still counts every row exactly once (a retried task's partial statistics are not double-counted).

A Ray Train worker lost mid-epoch is tests/test_multinode.py's node loss: the worker dies with its whole
node (raylet, objects and all), Ray Train restarts from the last committed mid-epoch checkpoint, and every
step after the restart sees exactly the batch an uninterrupted run sees, with the same losses.
examples/ray_train_loop.py's killed rank is tests/test_examples.py.

Only processes under the test's own subprocess are ever signalled: other Ray clusters on the
machine are left alone.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
# Each job takes 1-2 minutes on an idle 2-core machine, most of it starting Ray; on a loaded one
# starting Ray alone can take minutes, so the limits only catch a hung job.
WATCH_S = 420  # from the job's start until the fault is injected
FINISH_S = 300  # from the fault until the job exits


# ---------------------------------------------------------------------------------------------
# Process helpers (Linux /proc)


def _parent_map() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces or parentheses, so split after the last ')'.
        out[int(d)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def _descendants(root: int) -> set[int]:
    parents = _parent_map()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _title(pid: int) -> str:
    """The process title (Ray rewrites argv with setproctitle, e.g. 'ray::fit_group')."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _find(root: int, prefix: str) -> list[int]:
    return sorted(p for p in _descendants(root) if _title(p).startswith(prefix))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")  # a zombie is dead, just not reaped
    except OSError:
        return False


def _kill_and_confirm(pid: int, timeout: float = 10.0) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} survived SIGKILL"
        time.sleep(0.01)


@contextlib.contextmanager
def _cli(args: list[str], log: Path):
    """`python -m pipeline ARGS` with its own local Ray; whatever happens, nothing it started outlives the test."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # a private local Ray, never somebody else's cluster
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # this tree's code
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)


def _kill_tree(root: int) -> None:
    """SIGKILL a process we started and everything under it (its Ray), nothing else."""
    for pid in [*_descendants(root), root]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.wait()
        pytest.fail(f"job did not finish within {timeout}s; log:\n{log.read_text()[-6000:]}")
    out = log.read_text()
    assert rc == 0, f"exit code {rc}; log:\n{out[-6000:]}"
    return out


# ---------------------------------------------------------------------------------------------
# (a) a Ray Data worker killed while the fit pass runs


def test_fit_survives_killed_data_worker(tmp_path):
    import pipeline
    from pipeline import demo
    from pipeline.config import DEMO_CATEGORICAL, DEMO_NUMERIC

    rows = 256_000
    data, out, log = tmp_path / "data", tmp_path / "runs", tmp_path / "fit.log"
    paths = demo.generate(str(data), rows=rows, shards=32, seed=3)
    killed: list[tuple[int, str]] = []
    with _cli(["fit", "--config", "configs/demo.toml", "--run.fit_on", "ray", "--data.path", str(data), "--run.output", str(out),
               "--run.name", "fit"], log) as proc:
        deadline = time.monotonic() + WATCH_S
        while proc.poll() is None and len(killed) < 2 and time.monotonic() < deadline:
            for pid in _find(proc.pid, "ray::fit_group"):
                if pid in (k for k, _ in killed):
                    continue
                title = _title(pid)
                if title.startswith("ray::fit_group"):  # still running the task right now
                    _kill_and_confirm(pid)
                    killed.append((pid, title))
                    break
            time.sleep(0.02)
        text = _finish(proc, log, timeout=FINISH_S)
    assert killed, f"no process titled ray::fit_group was seen under the job; log:\n{text[-4000:]}"

    assert f"[rows] rows read {rows:,} = used {rows:,} + dropped 0" in text, text[-3000:]
    (saved,) = glob.glob(str(out / "fit-*" / "preprocessor.json"))
    fitted = pipeline.FittedPreprocessor.load(saved)
    assert sum(fitted.targets[0].counts) == fitted.stats["rows"] < rows  # training rows: the hold-out is not fitted
    # ... and the statistics are exactly those of a single-process pass over the same files.
    assert len(paths) == 32
    ref = pipeline.prepare(str(data), label="label", numeric=list(DEMO_NUMERIC), categorical=list(DEMO_CATEGORICAL),
                           use_ray=False).fitted
    assert fitted == ref
