"""Every shell command in the README and docs/ works as written, or is run by a test that says so.

The fenced shell blocks are extracted and each command is sorted into what checks it:
- the project's own commands (`python -m pipeline ...`, `python -m jobs.train ...`, also as a `ray job
  submit` entrypoint) are parsed by the real parser and their config flags loaded by the real config
  (unknown keys or values fail here); the quick ones (`--help`, `validate`) are run for real on a
  small generated dataset;
- `make` targets exist in the Makefile (CI runs `make test`);
- the examples are run by tests/test_examples.py, which must name them;
- commands that need a Kubernetes cluster, a registry or a remote Ray head (helm, kubectl, docker, ray
  job submit) cannot run here: the files they name must exist, and tests/test_k8s.py and
  tests/test_jobs.py check the manifests and `ray job submit` against a real local head.
A command of any other kind fails the test until it is given a check.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS_A_CLUSTER = ("helm", "kubectl", "docker", "export")


def shell_commands(path: Path) -> list[str]:
    """The commands of a page's fenced bash/sh blocks (indented ones too), continuation lines joined,
    comments removed."""
    out, block, cmd = [], False, ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("```"):
            block = not block and s[3:].strip() in ("bash", "sh", "shell", "console")
            continue
        if not block:
            continue
        more = s.endswith("\\")
        words = shlex.split(s.rstrip("\\"), comments=True) if s else []
        cmd += " " + shlex.join(words) if words else ""
        if more or not cmd.strip():
            continue
        out.append(cmd.strip())
        cmd = ""
    return out


COMMANDS = [(p.relative_to(REPO).as_posix(), c) for p in PAGES for c in shell_commands(p)]


def test_the_pages_have_commands_and_the_readme_is_a_front_page():
    assert len(COMMANDS) > 20
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 150, f"README.md has {len(readme)} lines: the reference belongs in docs/"
    assert shell_commands(REPO / "README.md")[:2] == ["make demo", "make test"]
    for link in re.findall(r"\]\((docs/[^)#]+)", "\n".join(readme)):
        assert (REPO / link).is_file(), link


def project_argv(words: list[str]) -> list[str] | None:
    """The arguments of `python -m pipeline` for a project command, None for any other command."""
    if words[:1] == ["parquet-pipeline"]:
        return words[1:]
    if len(words) >= 3 and words[0].endswith("python") and words[1] == "-m":
        if words[2] == "pipeline":
            return words[3:]
        if words[2] == "jobs.train":
            return ["train", *words[3:]]
    return None


def checked(page: str, command: str) -> str:
    """How the command is checked (raises when it is wrong or has no check)."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
        words = words[1:]
    if words[0].endswith("/ray"):
        words = ["ray", *words[1:]]
    if words[:3] == ["ray", "job", "submit"]:
        opts, entry = words[:words.index("--")], words[words.index("--") + 1:]
        env = opts[opts.index("--runtime-env") + 1] if "--runtime-env" in opts else None
        assert env is None or (REPO / env).is_file(), f"{page}: {env} is not in the repository"
        assert "ray job submit" in (REPO / "tests" / "test_jobs.py").read_text()
        return checked(page, shlex.join(entry))
    argv = project_argv(words)
    if argv is not None:
        from pipeline.cli import _config_from, build_parser

        try:
            args = build_parser().parse_args(argv)  # SystemExit on an unknown command or flag
        except SystemExit as e:
            assert e.code == 0 and "--help" in argv, f"{page}: `{command}` does not parse"
            return "help"
        if not getattr(args, "no_config", False) and "--help" not in argv:
            _config_from(args)  # ConfigError on an unknown key or a wrong value
        return "parsed"
    if words[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
        assert set(words[1:]) <= targets, f"{page}: `{command}`: no such make target"
        return "make"
    script = next((w for w in words if w.startswith("examples/")), None)
    if script:
        assert (REPO / script).is_file(), f"{page}: {script} does not exist"
        assert Path(script).name in (REPO / "tests" / "test_examples.py").read_text(), \
            f"{page}: {script} is not run by tests/test_examples.py"
        return "example"
    if words[0] in NEEDS_A_CLUSTER or ("|" in words and any(w in NEEDS_A_CLUSTER for w in words)):
        for w in words:
            if re.match(r"^(k8s|jobs|configs)/", w):
                assert (REPO / w).exists(), f"{page}: `{command}` names {w}, which does not exist"
        return "needs a cluster"
    raise AssertionError(f"{page}: `{command}` has no check: run it in a test, or say here how it is checked")


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_every_command_is_checked(page, command):
    checked(page, command)


def test_the_quick_commands_run(tmp_path):
    """`--help` and every `validate` of the pages, run as written, on a small demo dataset."""
    from pipeline import demo

    data = tmp_path / "demo"
    demo.generate(str(data), rows=4_000, shards=2, seed=0)
    quick = [c for _, c in COMMANDS if project_argv(shlex.split(c)) is not None and
             (project_argv(shlex.split(c))[:1] == ["validate"] or "--help" in shlex.split(c))]
    assert len(quick) >= 3
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    for command in dict.fromkeys(quick):
        argv = project_argv(shlex.split(command))
        if argv[:1] == ["validate"]:
            argv = [*argv, "--data.path", str(data)]  # the small dataset instead of the 2M-row demo
        out = subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, f"`{command}` exited {out.returncode}:\n{out.stderr[-2000:]}"


@pytest.mark.slow
def test_the_daily_loop_of_continuous_md_runs_and_each_day_trains_on_its_rows(ray_local, tmp_path):
    """docs/continuous.md's daily loop, its commands as written (parsed by the real CLI and config), run on a
    small table: day 1 in full, then day 2's increment warm-started from day 1 (days 3 to 5 are the same
    command with the next numbers: parsed by test_every_command_is_checked, not run again here). Each run trains on its own day's rows only (metrics.json), the embedding tables grow, and
    the grown tables keep every known row of the previous run's final model bit for bit before the first step."""
    import torch

    from pipeline import storage
    from pipeline.cli import _config_from, build_parser, cmd_generate
    from pipeline.job import warm
    from pipeline.job.model import Optimizers, build_model
    from pipeline.job.driver import run

    loop = [c for p, c in COMMANDS if p == "docs/continuous.md" and "configs/daily.toml" in c]
    assert len(loop) == 6 and all(f"--run.name day-{d} --run.since runs/day-{d - 1}" in loop[d] for d in (2, 3, 4, 5))
    loop = loop[:3]  # generate, day 1, day 2
    small = {"data.path": str(tmp_path / "daily"), "generate.rows": "3000", "run.output": str(tmp_path / "runs"),
             "train.epochs": "1", "train.hidden": "[16]"}
    runs, rows_per_day = [], 3000
    for command in loop:
        argv = project_argv(shlex.split(command))
        for k, v in small.items():
            argv += [f"--{k}", v]
        if "--run.since" in argv:
            at = argv.index("--run.since") + 1
            argv[at] = str(tmp_path / argv[at])  # runs/day-1 under this test's output
        args = build_parser().parse_args(argv)
        cfg = _config_from(args)
        if argv[0] == "generate":
            assert cmd_generate(cfg, args) == 0
            continue
        summary = run(cfg)
        runs.append(summary)
        assert summary["rows_read"] == rows_per_day  # this day's rows only, never the history again
        assert [e["epoch"] for e in summary["epochs"]] == [1] and "clicked:val_auc" in summary["epochs"][0]
    assert [bool(s.get("warm")) for s in runs] == [False, True]
    for day, s in enumerate(runs[1:], start=2):
        w = s["warm"]
        assert w["since_run"] == runs[day - 2]["run"] and w["from_version"] == str(day - 2) and w["to_version"] == str(day - 1)
        assert w["growth"]["user"]["after"] > w["growth"]["user"]["before"]  # new users every day
    # before the first step: day 2's grown model against day 1's final model, row by row
    prev = warm.previous_run(runs[0]["run"])
    plan2 = warm.previous_run(runs[1]["run"])["plan"]
    grown = warm.growth(prev["plan"].fitted, plan2.fitted)
    before, after, tail = ([g[i] for g in grown.values()] for i in range(3))
    cfg = plan2.config
    model, _, _ = warm.warm_model({"checkpoint": prev["checkpoint"], "before": before, "after": after, "tail": tail},
                                  plan2.fitted, cfg, torch.device("cpu"), build_model, Optimizers)
    old = warm.load_state(prev["checkpoint"])["model"]["embedding.weight"]
    new = model.embedding.weight.detach()
    old_at, new_at = 0, 0
    for b, a in zip(before, after):
        assert torch.equal(new[new_at:new_at + b], old[old_at:old_at + b])
        old_at, new_at = old_at + b, new_at + a
    assert storage.exists(*storage.filesystem(storage.join(runs[-1]["run"], "plan.pkl")))  # day 3 starts from here
