"""Ray internals are optional: a missing one is skipped, said once under --debug, never a traceback. The
settings the project gives Ray by name are still Ray's on this version."""

import os
from pathlib import Path

import pytest

from pipeline.cluster import runtime


def _moved():
    from ray.data._internal import no_such_module  # noqa: F401 - an internal that moved


@pytest.mark.parametrize("debug", [True, False])
def test_a_missing_internal_is_skipped_and_said_once_with_debug(debug, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_DEBUG", "1" if debug else "0")
    monkeypatch.setattr(runtime, "_SKIPPED", set())
    assert runtime.optional("a speed-up", _moved) is None
    assert runtime.optional("a speed-up", _moved) is None
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if "a speed-up" in line]
    assert out.err == "" and "Traceback" not in out.out
    assert len(lines) == (1 if debug else 0), out.out
    if debug:
        assert lines[0].startswith("[debug] Ray ") and "skipped (ImportError" in lines[0]
    assert runtime.optional("works", lambda x: x + 1, 1) == 2


def test_the_installed_ray_is_in_the_declared_range():
    import re
    import tomllib
    from pathlib import Path

    import ray

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    (lo, hi), = [re.search(r">=([\d.]+),<([\d.]+)", d).groups() for d in deps if d.startswith("ray[")]
    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert key(lo) <= key(ray.__version__) < key(hi)
    assert runtime.ray_at_least(lo) and not runtime.ray_at_least(hi)


def test_elastic_training_is_refused_in_one_paragraph_where_this_ray_has_none():
    """On this Ray: elastic where its ScalingConfig has it (2.60), else the paragraph (2.52.1 has none)."""
    import ray
    from ray.train import ScalingConfig

    from pipeline import PipelineError, config
    from pipeline.job import driver as train

    elastic = config.load("configs/demo.toml", {"train.num_workers": [1, 2]})
    assert train.check_elastic(config.load("configs/demo.toml", {}), ScalingConfig, ray.__version__) is False
    if hasattr(ScalingConfig, "elasticity_enabled"):
        assert train.check_elastic(elastic, ScalingConfig, ray.__version__) is True
        assert ScalingConfig(num_workers=elastic.train.workers_range).elasticity_enabled
    else:
        with pytest.raises(PipelineError, match=rf"elastic training.*this is Ray {ray.__version__}"):
            train.check_elastic(elastic, ScalingConfig, ray.__version__)
    with pytest.raises(PipelineError, match="train.num_workers = \\[1, 2\\] asks for elastic training"):
        train.check_elastic(elastic, object, "2.0.0")


def test_the_report_poll_is_ray_trains_own_setting_and_a_users_value_wins(monkeypatch):
    """pipeline.cluster.runtime sets how often Ray Train's controller polls its workers (a rank's next report waits
    for the poll) through Ray Train's own environment variable: it must still be that variable on this Ray,
    and the job's runtime env and the RayJob set the same one."""
    import yaml

    from ray.train.v2._internal import constants

    name = constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR
    assert name == "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    monkeypatch.delenv(name, raising=False)
    runtime.report_poll_interval()
    assert os.environ[name] == runtime.REPORT_POLL_S
    monkeypatch.setenv(name, "3")
    runtime.report_poll_interval()
    assert os.environ[name] == "3"
    repo = Path(__file__).resolve().parents[1]
    job_env = yaml.safe_load((repo / "jobs" / "runtime_env.yaml").read_text())["env_vars"]
    rayjob = yaml.safe_load((repo / "k8s" / "rayjob-gpu.yaml").read_text())
    assert float(job_env[name]) == float(yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"][name]) <= 1.0
