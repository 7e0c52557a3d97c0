"""The README's user loops, run as a user runs them, on small data:

- examples/torchrun_loop.py under `torchrun --nproc_per_node 2` (gloo, no Ray);
- examples/ray_train_loop.py on a private local Ray, with rank 0 killed mid-epoch once: Ray Train
  restarts the group from the last mid-epoch checkpoint;
- examples/notebook.py in one process.

Both distributed runs trace each batch's row ids; the Ray run, resumed after the kill, must have seen
exactly the batches the torchrun run saw, rank by rank, step by step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    e = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
         "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    e.pop("RAY_ADDRESS", None)  # a private local Ray, never somebody else's cluster
    return e


def run(args: list[str], timeout: int = 300, clean: bool = True) -> str:
    """Run an example: it must exit 0, and (clean) print no traceback and nothing after its last epoch
    line but serving's result. Every torchrun and notebook run of this module checks the clean exit (three
    torchrun runs: 2 processes, 2 stopped mid-epoch, 3 resuming; three notebook runs):
    the torchrun example used to abort after its last epoch in about 1 run of 5 on a busy machine (gloo's
    worker thread releasing a collective's tensor during interpreter finalization: SIGABRT, `terminate
    called without an active exception`); rank_data ends the process group before finalization
    (ingest.end_process_group_at_exit)."""
    cp = subprocess.run(args, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=timeout)
    out = cp.stdout
    assert cp.returncode == 0, out[-6000:]
    if clean:
        assert "Traceback" not in out, out[-6000:]
        lines = out.splitlines()
        epochs = [i for i, line in enumerate(lines) if line.startswith("epoch ")]
        if epochs:  # a run stopped mid-epoch (--stop-at-step) has none
            after = [line for line in lines[epochs[-1] + 1:] if line.strip() and not line.startswith("served:")]
            assert after == [], out[-6000:]
    return out


def trace(d: Path, rank: int) -> dict[tuple[int, int], str]:
    """(epoch, step) -> digest; after a restart the replayed steps overwrite the lost attempt's."""
    out = {}
    for line in (d / f"rank{rank}.txt").read_text().splitlines():
        e, k, h = line.split()[:3]
        out[(int(e), int(k))] = h
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    from pipeline import demo

    path = str(tmp_path_factory.mktemp("demo"))
    demo.generate(path, rows=12_000, shards=3, seed=2)
    return path


@pytest.mark.slow
def test_torchrun_and_resumed_ray_train_see_the_same_batches(data, tmp_path):
    tr, ry = tmp_path / "torchrun", tmp_path / "ray"
    tr.mkdir(), ry.mkdir()
    common = ["--data", data, "--label", "label", "--epochs", "2", "--batch-size", "128"]
    out = run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "examples/torchrun_loop.py", *common,
               "--trace", str(tr)])
    assert "rank 1/2 (torch.distributed)" in out and "epoch 2:" in out
    out = run([sys.executable, "examples/ray_train_loop.py", *common, "--workers", "2", "--checkpoint-every", "10",
               "--fail-at-step", "25", "--trace", str(ry), "--storage", str(tmp_path / "runs")], timeout=400,
              clean=False)  # Ray logs the deliberately killed worker's traceback
    assert (ry / "failed-once").exists(), out[-4000:]  # rank 0 really died once
    assert "rank 1/2 (ray)" in out or "done:" in out
    for r in (0, 1):
        lines = (ry / f"rank{r}.txt").read_text().splitlines()
        ray_batches, torch_batches = trace(ry, r), trace(tr, r)
        assert len(lines) > len(ray_batches)  # steps after the last checkpoint were replayed
        assert ray_batches == torch_batches and len(torch_batches) > 40


def traced_ids(d: Path, ranks: int, last_step: int | None = None) -> dict[int, list[int]]:
    """epoch -> the row ids every rank traced in it (steps up to last_step of the first epoch only)."""
    out: dict[int, list[int]] = {}
    for r in range(ranks):
        for line in (d / f"rank{r}.txt").read_text().splitlines():
            e, k, _, *ids = line.split()
            if last_step is None or int(k) <= last_step:
                out.setdefault(int(e), []).extend(map(int, ids))
    return out


@pytest.mark.slow
def test_torchrun_resumes_on_another_number_of_processes_with_every_row_once(data, tmp_path):
    """--nnodes=MIN:MAX restarts with a new WORLD_SIZE: 2 processes stop at step 25 (checkpoint at 20),
    3 go on from the checkpoint; the first epoch still gives every training row once, the second is
    the plain 3-process epoch."""
    import numpy as np

    from pipeline.feed.plan import holdout_mask

    ids = np.arange(12_000)
    train = set(ids[~holdout_mask(ids, 0.1, 0)].tolist())
    ckpt, batch = str(tmp_path / "ckpt.pt"), 128
    common = ["examples/torchrun_loop.py", "--data", data, "--epochs", "2", "--batch-size", str(batch),
              "--checkpoint", ckpt, "--checkpoint-every", "10"]
    first, second = tmp_path / "two", tmp_path / "three"
    first.mkdir(), second.mkdir()
    run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *common, "--stop-at-step", "25",
         "--trace", str(first)])
    out = run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "3", *common, "--trace", str(second)])
    assert "resumed at epoch 0, position 5,120 (saved on 2 ranks)" in out, out[-3000:]
    before, after = traced_ids(first, 2, last_step=20), traced_ids(second, 3)
    epoch0 = before[0] + after[0]
    assert len(epoch0) == len(set(epoch0)) and set(epoch0) <= train and len(train) - len(epoch0) < 3 * batch
    assert len(after[1]) == len(set(after[1])) and len(train) - len(after[1]) < 3 * batch


@pytest.mark.slow
@pytest.mark.parametrize("label,metric", [("label", "accuracy"), ("segment", "accuracy"), ("spend", "RMSE")])
def test_notebook_example_trains_and_serves(data, label, metric):
    out = run([sys.executable, "examples/notebook.py", "--data", data, "--label", label])
    assert f"validation {metric}" in out and "served:" in out
    kind = {"label": "binary", "segment": "multiclass (4 classes)", "spend": "regression"}[label]
    assert f"targets: '{label}' {kind}" in out


JOB = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "pipeline" / "job").glob("*.py"))


@pytest.mark.parametrize("path", [*JOB, "examples/ray_train_loop.py", "examples/torchrun_loop.py",
                                  "examples/notebook.py"])
def test_the_job_and_the_examples_use_only_the_public_api(path):
    """The built-in job (pipeline/job/) is one client of the API, like the examples: every name they
    take from the package is one of `pipeline.__all__`, and no module inside it is imported (no
    `pipeline.x`); the job's own modules import each other (`from .model import ...`) and nothing else."""
    import ast

    import pipeline

    tree = ast.parse((REPO / path).read_text())
    used = []  # (line, what)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipeline":
            if node.module != "pipeline":
                used.append((node.lineno, f"from {node.module} import ..."))
            used += [(node.lineno, a.name) for a in node.names if a.name not in pipeline.__all__]
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: inside the package
            if not (path in JOB and node.level == 1 and f"pipeline/job/{node.module}.py" in JOB):
                used.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import ..."))
        elif isinstance(node, ast.Import):
            used += [(node.lineno, a.name) for a in node.names if a.name.startswith("pipeline.")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pipeline"
              and node.attr not in pipeline.__all__):
            used.append((node.lineno, f"pipeline.{node.attr}"))
    assert not used, f"{path} reaches inside the package: {used}"
    for name in pipeline.__all__:  # and every public name resolves
        assert getattr(pipeline, name) is not None, name
