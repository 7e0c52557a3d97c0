"""Shared fixtures: one local Ray per test session (started only if a test needs it), small datasets."""

from __future__ import annotations

import os

import pytest

from pipeline.cluster.runtime import LOOPBACK_ONLY, report_poll_interval  # noqa: E402

# Every Ray a test starts (here, in subprocesses, `ray start`, Cluster) listens on loopback only, so
# token authentication can be off for them: `ray job submit` and the clusters must agree on it.
os.environ.update(LOOPBACK_ONLY)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Ray Train's report poll as the job sets it for a Ray it starts (pipeline.cluster.runtime.REPORT_POLL_S): the Rays
# the tests start (ray_local, Cluster, `ray start`) inherit it.
report_poll_interval()


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the inner loop (make test-quick): leave out every test that starts Ray or runs a whole job")


# `make test` runs two test processes (pytest-xdist, --dist loadscope): each module runs whole in one of
# them, so a module's expensive fixture (the 3-node cluster's plain run, the Ray head of `ray job submit`,
# the S3 server, a baseline run) is built once. The longest modules go first, so that neither process is
# left with one of them at the end while the other idles; the many short modules fill in behind them.
FIRST = ["test_multinode", "test_integration", "test_examples", "test_daily", "test_loopback", "test_resume", "test_jobs", "test_docs",
         "test_tables", "test_cluster_limits", "test_s3", "test_damage", "test_faults"]


def pytest_collection_modifyitems(config, items):
    place = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: place.get(item.module.__name__ if item.module else "", len(FIRST)))  # stable
    if not config.getoption("--quick"):
        return
    keep, left = [], []
    for item in items:
        needs_ray = "ray_local" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray") \
            or item.get_closest_marker("slow")
        (left if needs_ray else keep).append(item)
    config.hook.pytest_deselected(items=left)
    items[:] = keep


@pytest.fixture(scope="session")
def ray_local():
    """A private local Ray (address='local': never joins a leftover cluster), shut down at the end; its workers
    set up as those of the job's private Ray without a dashboard (pipeline.cluster.runtime)."""
    import ray

    from pipeline.cluster.runtime import quiet_ray_data

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"worker_process_setup_hook": "pipeline.cluster.runtime.setup_worker_without_dashboard"})
    quiet_ray_data(progress=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> str:
    """A small demo dataset (same generator as the real one): 24k rows in 4 shards."""
    from pipeline import demo

    path = str(tmp_path_factory.mktemp("demo"))
    demo.generate(path, rows=24_000, shards=4, seed=1)
    return path


def make_config(data_path: str, **overrides):
    """A config for a demo-like dataset: its feature columns and binary label unless overridden."""
    from helpers import demo_columns
    from pipeline import config

    return config.load(None, {"data.path": data_path, **demo_columns(), **overrides})
