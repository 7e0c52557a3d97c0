"""`ray job submit` end to end: a real Ray head on loopback, the real CLI, the jobs/ entrypoints and
jobs/runtime_env.yaml, exactly as an operator submits to a cluster.

The head is private to this module: free ports, its own --temp-dir, its own session (process
group). Teardown kills only the processes of that session or living under that temp dir, never
`ray stop` (which would stop every Ray on the machine, including another test session's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's bin: its `ray`, and the `python` jobs run with
RAY = str(BIN / "ray") if (BIN / "ray").exists() else (shutil.which("ray") or "ray")
ROWS, SHARDS = 20_000, 4
SMALL = ["--train.epochs", "1", "--train.batch_size", "256", "--train.hidden", "[32]", "--train.num_workers", "2"]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Head:
    address: str  # the job submission (dashboard) address
    temp_dir: str
    env: dict[str, str]

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)

    def submit(self, submission_id: str, *job_args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return self.ray("job", "submit", "--address", self.address, "--submission-id", submission_id,
                        "--working-dir", ".", "--runtime-env", "jobs/runtime_env.yaml",
                        "--", "python", "-m", "jobs.train", *job_args, timeout=timeout)

    def status(self, submission_id: str) -> str:
        from ray.job_submission import JobSubmissionClient

        return str(JobSubmissionClient(self.address).get_job_status(submission_id).value)


def _ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               # The head's environment is what a job's entrypoint runs with: `python` must be the
               # interpreter that has the project's dependencies, as in the cluster image.
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def _ours(pid: int, sid: int, temp_dir: str) -> bool:
    """Started by this head: in its session, or working/started under its temp dir (Linux /proc)."""
    try:
        if os.getsid(pid) == sid:
            return True
        if os.readlink(f"/proc/{pid}/cwd").startswith(temp_dir):
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return temp_dir.encode() in f.read()
    except OSError:  # gone, or not ours to inspect
        return False


def _kill_head(proc: subprocess.Popen, temp_dir: str) -> None:
    """Stop this head and everything it started, and nothing else.

    Ray's daemons and workers stay in the session `ray start` was given (start_new_session); a job's
    driver gets a session of its own but runs with its cwd under temp_dir. `ray stop` is not used: it
    stops every Ray on the machine.
    """
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)  # a head drains for up to 30 s on SIGTERM; no need to wait for that
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()
                and _ours(int(d), proc.pid, temp_dir)]
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            proc.wait(timeout=1)  # reap our direct child; the others are reaped by init
        except subprocess.TimeoutExpired:
            pass
    else:
        warnings.warn(f"processes of the test Ray head under {temp_dir} survived SIGKILL: {left}")


class PortTaken(Exception):
    """A port free_ports found was taken by another process before the head bound it."""


def _wait_until_jobs_run(head: Head, proc: subprocess.Popen, log_path: str, timeout: float = 240) -> None:
    """Until a trivial job has run. The dashboard answers HTTP before the head's job agent registers;
    a submission in between fails with 500 "No available agent to submit job" (seen on a loaded machine)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + timeout
    job_id, last_error = None, None
    while job_id is None:
        try:
            job_id = JobSubmissionClient(head.address).submit_job(entrypoint="python -c pass",
                                                                  submission_id=f"warmup-{uuid.uuid4().hex[:8]}")
        except Exception as e:  # connection refused, or 500 until the agent is up
            last_error = e
            if proc.poll() is not None and "address already in use" in Path(log_path).read_text():
                raise PortTaken(log_path) from None
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not accept jobs (exit {proc.poll()}; last error {last_error}):\n"
                            + Path(log_path).read_text()[-4000:])
            time.sleep(1)
    client = JobSubmissionClient(head.address)
    while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            pytest.fail(f"warm-up job still {status} after {timeout:.0f}s")
        time.sleep(1)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job_id)


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rj")  # short: Ray's unix socket paths must stay < 107 chars
    env = _ray_env()
    for attempt in range(3):  # a port found free can be taken before the head binds it: new ports, again
        gcs, dashboard, client, agent = free_ports(4)
        # Inherited by every process of this cluster (jobs' drivers and workers included): Ray code that
        # looks for "the" local cluster (Train's PlacementGroupCleaner uses the state API) must find this
        # one even when another Ray runs on the machine ("Found multiple active Ray instances").
        env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
        cmd = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--include-dashboard", "true",
               "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
               "--num-cpus", "4", "--temp-dir", temp_dir, "--disable-usage-stats"]
        log_path = os.path.join(temp_dir, f"ray-start-{attempt}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        head = Head(f"http://127.0.0.1:{dashboard}", temp_dir, env)
        try:
            _wait_until_jobs_run(head, proc, log_path)
            break
        except PortTaken:
            _kill_head(proc, temp_dir)
        except BaseException:
            _kill_head(proc, temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    else:
        pytest.fail(f"ray start --head found its ports taken 3 times: {Path(log_path).read_text()[-2000:]}")
    try:
        yield head
    finally:
        _kill_head(proc, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def job_data(tmp_path_factory) -> str:
    from pipeline import demo

    path = str(tmp_path_factory.mktemp("jobdata") / "demo")
    demo.generate(path, rows=ROWS, shards=SHARDS, seed=0)
    return path


def _tail(cp: subprocess.CompletedProcess, n: int = 6000) -> str:
    return f"exit {cp.returncode}\n--- stdout ---\n{cp.stdout[-n:]}\n--- stderr ---\n{cp.stderr[-n:]}"


# ------------------------------------------------------------------------------------------------
# No cluster needed


def test_entrypoints_are_the_cli():
    for command in ("train", "fit"):
        cp = subprocess.run([sys.executable, "-m", f"jobs.{command}", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
        assert cp.returncode == 0, _tail(cp)
        assert f"usage: python -m pipeline {command}" in cp.stdout
        assert "--data.path" in cp.stdout


def test_runtime_env_file():
    import yaml

    env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "."
    for big in ("/.venv", "/data", "/runs", "/.git", "__pycache__"):
        assert big in env["excludes"], big
    assert not {"pip", "uv", "conda"} & set(env), "the cluster image carries the dependencies"
    assert all(isinstance(v, str) for v in env["env_vars"].values())


# ------------------------------------------------------------------------------------------------
# Against a real head


@pytest.mark.ray
@pytest.mark.slow
def test_train_job_succeeds(ray_head: Head, job_data: str, tmp_path):
    from pipeline import FittedPreprocessor

    out = tmp_path / "runs"
    job_id = f"pipeline-ok-{uuid.uuid4().hex[:8]}"
    cp = ray_head.submit(job_id, "--config", "configs/demo.toml", "--data.path", job_data,
                         "--run.output", str(out), "--run.name", "jobtest", *SMALL)
    print(cp.stdout, cp.stderr, sep="\n")  # shown with `pytest -rP`: what an operator sees
    assert cp.returncode == 0, _tail(cp)
    assert f"Job '{job_id}' succeeded" in cp.stdout + cp.stderr
    assert ray_head.status(job_id) == "SUCCEEDED"
    status = ray_head.ray("job", "status", "--address", ray_head.address, job_id)
    assert status.returncode == 0 and "succeeded" in (status.stdout + status.stderr).lower(), _tail(status)

    logs = ray_head.ray("job", "logs", "--address", ray_head.address, job_id)
    assert logs.returncode == 0, _tail(logs)
    assert "[train] done" in logs.stdout and re.search(r"^\s+1\s+\d+\.\d+", logs.stdout, re.M), logs.stdout[-4000:]
    if tuple(int(x) for x in ray.__version__.split(".")[:2]) >= (2, 60):  # the workers' own lines reach the job's log (Ray 2.52.1: the closing table only)
        assert "[train] epoch 1/1" in logs.stdout, logs.stdout[-4000:]
    assert "Found multiple active Ray instances" not in logs.stdout  # the job stayed on this cluster
    assert "Requesting resources" not in logs.stdout  # runtime_env's worker_process_setup_hook quiets Ray Train

    # Artifacts: <run.output>/<run.name>-<timestamp>/
    runs = sorted(out.glob("jobtest-*"))
    assert len(runs) == 1, runs
    run = runs[0]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["rows_read"] == ROWS
    assert len(metrics["epochs"]) == 1
    pre = FittedPreprocessor.load(str(run / "preprocessor.json"))
    assert pre.num_features > 0
    checkpoints = sorted(p for p in run.glob("checkpoint_*") if p.is_dir())
    assert checkpoints, sorted(run.iterdir())
    for ckpt in checkpoints:
        assert (ckpt / "state.pt").is_file() and (ckpt / "preprocessor.json").is_file()
    assert FittedPreprocessor.load(str(checkpoints[-1] / "preprocessor.json")).to_dict() == pre.to_dict()
    assert Path(metrics["checkpoint"]).resolve() == checkpoints[-1].resolve()

    # What `--working-dir .` uploaded: the code only (no .venv, data, runs, .git), a few hundred KB.
    packages = [p for p in Path(ray_head.temp_dir).glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
                if p.is_dir()]
    assert packages, "working_dir package not found on the head"
    for pkg in packages:
        files = [p for p in pkg.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        assert (pkg / "jobs" / "train.py").is_file() and (pkg / "pipeline" / "cli.py").is_file()
        for big in (".venv", "data", "runs", ".git"):
            assert not (pkg / big).exists(), f"{big} was uploaded"
        assert size < 5 * 2**20, f"working_dir upload is {size / 2**20:.1f} MiB: {len(files)} files"


@pytest.mark.ray
@pytest.mark.slow
def test_bad_input_job_fails_with_one_paragraph(ray_head: Head, tmp_path):
    missing = str(tmp_path / "no-such-dataset")
    job_id = f"pipeline-bad-{uuid.uuid4().hex[:8]}"
    cp = ray_head.submit(job_id, "--config", "configs/demo.toml", "--data.path", missing,
                         "--run.output", str(tmp_path / "runs"), *SMALL)
    assert cp.returncode != 0, _tail(cp)
    assert ray_head.status(job_id) == "FAILED"
    status = ray_head.ray("job", "status", "--address", ray_head.address, job_id)
    assert "failed" in (status.stdout + status.stderr).lower(), _tail(status)
    assert "exit code 2" in status.stdout + status.stderr, _tail(status)  # the CLI's code for bad input

    logs = ray_head.ray("job", "logs", "--address", ray_head.address, job_id)
    assert logs.returncode == 0, _tail(logs)
    errors = [line for line in logs.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, logs.stdout[-4000:]
    assert f"'{missing}'" in errors[0] and "does not exist" in errors[0] and "data.path" in errors[0]
    assert "Traceback (most recent call last)" not in logs.stdout
    assert not re.search(r"^\s+File \".*\", line \d+", logs.stdout, re.M), logs.stdout[-4000:]
