"""Fault tolerance with REAL processes killed (SIGKILL) while the job runs.

Each test runs the CLI in a subprocess with its own private local Ray (`address="local"`), finds the
Ray worker process doing the work among that subprocess's descendants (by the process title Ray
sets: `ray::fit_group` while a fit task runs, `ray::RayTrainWorker...` for a Ray
Train worker), kills it, and checks that the job still finishes with exactly the right result:

- preprocessing: Ray Data retries the lost task (its tasks default to max_retries=-1), and the fit
  still counts every row exactly once (a retried task's partial statistics are not double-counted);
- training: Ray Train (FailureConfig.max_failures) restarts the worker group from the latest
  checkpoint, the loader resumes at the step after that checkpoint, and every step after the restart
  sees exactly the batch an uninterrupted run sees.

Only processes under the test's own subprocess are ever signalled: other Ray clusters on the
machine are left alone.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import expected_batches

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


# ---------------------------------------------------------------------------------------------
# (b) a Ray Train worker killed mid-epoch, after a mid-epoch checkpoint


def expected_trace(n: int, world: int, batch: int, epochs: int, seed: int = 0, val_fraction: float = 0.1):
    """What an uninterrupted run writes to trace-rank<r>.txt: {(rank, epoch, step): digest}, the ranks'
    training-row counts and the steps per epoch."""
    batches, sizes, steps = expected_batches(n, world, batch, epochs, seed, val_fraction)
    return {k: hashlib.sha1(ids.tobytes()).hexdigest()[:16] for k, ids in batches.items()}, sizes, steps


def _read_trace(path: str) -> list[tuple[int, int, str]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines()
    return [(int(e), int(k), h) for e, k, h in (ln.split() for ln in lines if len(ln.split()) == 3)]


def _committed_checkpoint(run_dir: str) -> dict | None:
    """Metrics of the latest checkpoint Ray Train has committed (its checkpoint manager's snapshot)."""
    try:
        with open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) as f:
            latest = json.load(f).get("latest_checkpoint_result")
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None
    return latest["metrics"] if latest else None


def test_training_survives_killed_train_worker(tmp_path):
    from pipeline import demo

    rows, world, batch, epochs, every = 40_000, 2, 256, 2, 10
    data, out, log = tmp_path / "data", tmp_path / "runs", tmp_path / "train.log"
    demo.generate(str(data), rows=rows, shards=8, seed=5)
    expected, sizes, steps = expected_trace(rows, world, batch, epochs)
    args = ["train", "--data.path", str(data), "--run.output", str(out), "--run.name", "ft",
            "--train.epochs", str(epochs), "--train.batch_size", str(batch), "--train.hidden", "[32]",
            "--train.num_workers", str(world), "--train.max_failures", "2",
            "--train.checkpoint_every_steps", str(every), "--train.trace_batches", "true"]
    with _cli(args, log) as proc:
        # Wait until a mid-epoch checkpoint is committed (Ray Train registers a checkpoint only once the
        # controller has collected every rank's report of it, polling every 2 s; a report still queued in
        # a worker that dies is lost) and rank 0 has trained a few steps past it; then kill a worker.
        killed = committed = None
        deadline = time.monotonic() + WATCH_S
        while proc.poll() is None and killed is None and time.monotonic() < deadline:
            time.sleep(0.02)
            runs = glob.glob(str(out / "ft-*"))
            if not runs:
                continue
            committed = _committed_checkpoint(runs[0])
            last = _read_trace(os.path.join(runs[0], "trace-rank0.txt"))[-1:]
            if not (committed and committed.get("mid_epoch") and last):
                continue
            (e, k, _), ce, ck = last[0], committed["epoch"], committed["step"]
            if e == ce and ck + 2 <= k < steps - 5:
                workers = _find(proc.pid, "ray::RayTrainWorker")
                if len(workers) == world:
                    _kill_and_confirm(workers[-1])
                    killed = (workers[-1], (e, k), (ce, ck))
        text = _finish(proc, log, timeout=FINISH_S)
    assert killed is not None, f"never saw {world} RayTrainWorker processes a few steps past a committed " \
                               f"mid-epoch checkpoint (last committed {committed}); log:\n{text[-4000:]}"
    _, (e_kill, k_kill), (e_ckpt, k_ckpt) = killed

    (run_dir,) = glob.glob(str(out / "ft-*"))
    metrics = json.loads(Path(run_dir, "metrics.json").read_text())
    assert f"[rows] rows read {rows:,} = used {rows:,} + dropped 0" in text
    assert [e["epoch"] for e in metrics["epochs"]] == list(range(1, epochs + 1))

    g = lambda e, k: e * steps + k  # noqa: E731 - global step number, 1-based within an epoch
    restart_points = set()
    for r in range(world):
        trace = _read_trace(os.path.join(run_dir, f"trace-rank{r}.txt"))
        # Every line, before and after the restart, is the batch an uninterrupted run sees at that step.
        for e, k, h in trace:
            assert h == expected[(r, e, k)], f"rank {r} epoch {e} step {k}: {h} != {expected[(r, e, k)]}"
        back = [i for i in range(1, len(trace)) if g(*trace[i][:2]) != g(*trace[i - 1][:2]) + 1]
        assert len(back) == 1, f"rank {r}: expected exactly one restart in the trace, found jumps at {back}"
        i = back[0]
        (e0, k0), (e1, k1) = trace[i - 1][:2], trace[i][:2]
        # The restart resumes right after a checkpoint (every `every` steps, or an epoch end) no older
        # than the one committed before the kill, and not after the last step traced before it.
        assert (k1 - 1) % every == 0, f"rank {r}: resumed at epoch {e1} step {k1}, not right after a checkpoint"
        assert g(e_ckpt, k_ckpt) < g(e1, k1) <= g(e0, k0), (r, killed, trace[i - 1], trace[i])
        assert g(e0, k0) >= g(e_kill, k_kill) - 1
        restart_points.add((e1, k1))
        # Before the kill: steps 1.. in order; after the restart: every remaining step exactly once.
        assert [g(e, k) for e, k, _ in trace[:i]] == list(range(1, g(e0, k0) + 1))
        assert [g(e, k) for e, k, _ in trace[i:]] == list(range(g(e1, k1), epochs * steps + 1))
    assert len(restart_points) == 1, f"the ranks resumed at different steps: {restart_points}"
    (e1, k1), = restart_points
    assert k1 > 1, f"resumed at the start of epoch {e1}: the mid-epoch checkpoint was not used"
    # Every epoch, the interrupted one included, trained on world * steps * batch rows (drop_last): the
    # epoch's rows (and loss, timings) must include the steps trained before the checkpoint it resumed from.
    assert [e["rows"] for e in metrics["epochs"]] == [world * steps * batch] * epochs, \
        f"resumed at epoch {e1} step {k1}; per-epoch rows {[e['rows'] for e in metrics['epochs']]}"
