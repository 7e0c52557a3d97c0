"""Starting or joining Ray with only the output a user needs."""

from __future__ import annotations

import logging
import os

from .config import Config


# A private local Ray is for this machine alone: nothing it opens should listen beyond loopback.
# Ray 2.60 binds its GCS, raylet, object manager and workers to every interface (and some agents to the
# node's external address); it binds them to 127.0.0.1 only when it takes the node's address to be
# 127.0.0.1, which this variable makes it do (the code path Ray uses on macOS and Windows). A real
# cluster (run.ray_address, `ray job submit`) is left as its operator set it up: see the README.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def loopback_only() -> None:
    """Make the next private Ray this process starts listen on loopback only (see LOOPBACK_ONLY). Ray
    reads the variable when it is imported, so an already imported Ray gets the same setting directly."""
    import sys

    os.environ.update(LOOPBACK_ONLY)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def init_ray(cfg: Config) -> None:
    """Join the cluster named by run.ray_address, or start a private local one.

    A bare `ray.init()` would join whatever /tmp/ray/ray_current_cluster points at (possibly a dead
    cluster), so a local run asks for address="local" explicitly. Inside `ray job submit` the job's
    driver is already connected through RAY_ADDRESS, which wins.
    """
    import ray

    if ray.is_initialized():
        return
    # Train V2 prints a line per internal state change; a user wants the epoch lines.
    os.environ.setdefault("RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING", "0")
    # No runtime_env here: inside `ray job submit` the job's own (jobs/runtime_env.yaml) applies, and Ray
    # refuses to start a driver whose ray.init(runtime_env=...) sets a variable that one sets too.
    kwargs = dict(logging_level=logging.WARNING, configure_logging=True)
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, cfg.train.num_workers + 2)
        loopback_only()
        ray.init(address="local", num_cpus=cpus, **kwargs)
    else:
        ray.init(address=address, **kwargs)
    quiet_ray_data()


def quiet_ray_data(progress: bool = True) -> None:
    """Driver: one progress bar per stage. Training workers (progress=False): none, their reads of
    an already materialised shard take well under a second."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = progress
    ctx.print_on_execution_start = False
    ctx.enable_rich_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # "Progress bars disabled. To enable, ..." once per process: disabled on purpose here.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR if not progress else logging.WARNING)
    logging.getLogger("ray.train").setLevel(logging.WARNING)
