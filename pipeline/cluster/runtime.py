"""Starting or joining Ray with only the output a user needs."""

from __future__ import annotations

import logging
import os

from ..config import Config

# Ray internals this module reaches into, each for speed or quieter output only. Every use goes through
# optional(): where an internal is missing or has moved (another Ray release), the project works the
# same without that optimisation and says so once under --debug (PIPELINE_DEBUG=1), never a traceback.
# docs/ray-versions.md lists which speed-up needs which Ray.
_SKIPPED: set[str] = set()


def optional(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), or None where this Ray lacks the internal it uses (said once with --debug)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - an internal that moved: any error means "not available here"
        if what not in _SKIPPED:
            _SKIPPED.add(what)
            if os.environ.get("PIPELINE_DEBUG") == "1":
                import ray

                print(f"[debug] Ray {ray.__version__}: {what} skipped ({type(e).__name__}: {e}); everything else "
                      f"is unchanged", flush=True)
        return None


def ray_at_least(version: str) -> bool:
    """The installed Ray is this release or newer (for internals checked to exist from that release)."""
    import ray

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())

    return parts(ray.__version__) >= parts(version)


# Internal system settings known to exist in this Ray and newer; older Ray refuses unknown keys.
PRESTART_SETTING_SINCE = "2.52.0"


# A private local Ray is for this machine alone: nothing it opens should listen beyond loopback.
# Ray 2.60 binds its GCS, raylet, object manager and workers to every interface (and some agents to the
# node's external address); it binds them to 127.0.0.1 only when it takes the node's address to be
# 127.0.0.1, which this variable makes it do (the code path Ray uses on macOS and Windows). A real
# cluster (run.ray_address, `ray job submit`) is left as its operator set it up: see docs/deploy.md.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def loopback_only() -> None:
    """Make the next private Ray this process starts listen on loopback only (see LOOPBACK_ONLY). Ray
    reads the variable when it is imported, so an already imported Ray gets the same setting directly."""
    import sys

    os.environ.update(LOOPBACK_ONLY)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False
    elif constants is not None:
        optional("binding an already imported Ray to loopback", _missing, "ray_constants.ENABLE_RAY_CLUSTER")


def _missing(name: str) -> None:
    raise AttributeError(f"{name} is not in this Ray")


def private_quiet() -> None:
    """Settings for a private local Ray that change nothing a user relies on, only what it prints.

    - Token authentication stays on (Ray's default for a new local cluster), but Ray's notice of it,
      "... Set RAY_AUTH_MODE=disabled to opt out", printed on every start, invites the wrong fix: it is
      dropped, and nothing else from that logger.
    - Ray Train's PreemptionWatcher watches for nodes being drained (spot instances); one machine has
      none to drain, and creating it prints a core_worker.cc error line (ray-project/ray#53727) on
      every run. It stays on for real clusters (run.ray_address, `ray job submit`). A user's own
      RAY_TRAIN_ENABLE_PREEMPTION_WATCHER wins."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropOptOutNotice) for f in auth.filters):
        auth.addFilter(_DropOptOutNotice())


class _DropOptOutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "to opt out" not in record.getMessage()


# How often Ray Train's controller polls its workers, for a Ray this process starts (a user's own value wins).
# Each worker's ray.train.report waits while its previous report is still unread (Ray Train's result queue
# holds one, and the controller reads it when it polls: every 2 s by default). A job reports at every
# epoch's end and at every mid-epoch checkpoint, so with 2 s a short epoch waited up to 2 s per report
# (measured on a local 3-epoch run: 23.3 s -> 18.5 s with 0.25 s). A poll costs the controller one actor
# call per worker: 0.25 s suits one machine; jobs/runtime_env.yaml and the RayJob set 0.5 s for a cluster.
REPORT_POLL_S = "0.25"


def report_poll_interval() -> None:
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", REPORT_POLL_S)


def address(cfg: Config) -> str:
    """Where init_ray goes: run.ray_address, else RAY_ADDRESS (inside `ray job submit`), else "local"
    (a private local Ray), unless Ray is already initialised in this process (then: "")."""
    import ray

    if ray.is_initialized():
        return ""
    return cfg.run.ray_address or os.environ.get("RAY_ADDRESS") or "local"


def init_ray(cfg: Config, train: bool = False) -> None:
    """Join the cluster named by run.ray_address, or start a private local one. train: a TorchTrainer
    follows (prestart_train_coordinator).

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
    # A runtime_env only for the private Ray: inside `ray job submit` the job's own (jobs/runtime_env.yaml)
    # applies, and Ray refuses to start a driver whose ray.init(runtime_env=...) conflicts with it.
    kwargs = dict(logging_level=logging.WARNING, configure_logging=True)
    where = address(cfg)
    if where == "local":
        cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, cfg.train.workers + 2)
        loopback_only()
        private_quiet()
        report_poll_interval()  # inherited by the Ray this process starts (a cluster's comes from its own env)
        if train and cfg.loader.read_share == "worker" and cfg.run.fit_on != "ray" and \
                ray_at_least(PRESTART_SETTING_SINCE):
            # Ray prestarts idle task workers for a new driver; this job runs no Ray tasks (the driver
            # fits, the ranks read their own shares), and Ray Train's actors each get a process of their
            # own (their runtime_env differs), so those would only take CPU from the start (measured at
            # 10M rows on 2 cores: 0.7 s sooner to the first step without them).
            kwargs["_system_config"] = {"prestart_worker_first_driver": False}
        hook = setup_worker if cfg.run.dashboard else setup_worker_without_dashboard
        ray.init(address="local", num_cpus=cpus, include_dashboard=cfg.run.dashboard,
                 runtime_env={"worker_process_setup_hook": hook}, **kwargs)
    else:
        # Joining a cluster from a plain driver: the same worker setup (by name: the cluster's workers import
        # pipeline anyway). Inside `ray job submit` the job's runtime env names it (jobs/runtime_env.yaml), and
        # a driver's own would conflict with it; Ray Client (ray://) gets none.
        if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ and not where.startswith("ray://"):
            kwargs["runtime_env"] = {"worker_process_setup_hook": "pipeline.runtime.setup_worker"}
        join(where, kwargs)
    quiet_ray_data()
    if train:
        prestart_train_coordinator()


def prestart_train_coordinator() -> None:
    """Create Ray's AutoscalingCoordinator actor now, while the driver still fits, instead of inside
    TorchTrainer.fit: Ray Train's controller creates it (named, detached, one per cluster, the same
    options as here) and waits for it before it starts the workers, a second or more of a new worker
    process on a small machine. Only an earlier start of what Ray Train starts anyway; where this Ray
    has no such actor (another version), nothing happens."""
    def start() -> None:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        get_or_create_autoscaling_coordinator()

    optional("prestarting Ray Train's AutoscalingCoordinator", start)


def join(address: str, kwargs: dict) -> None:
    """ray.init(address) for an existing cluster. Ray turns a loopback host (127.0.0.1, localhost) into
    this machine's network address, which misses a cluster started with --node-ip-address 127.0.0.1;
    so for a loopback host the driver tries as Ray resolves it, then on loopback. A cluster that cannot
    be reached is one paragraph with the address and the fix, never Ray's traceback."""
    import ray

    from ..errors import PipelineError

    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    tries = [False, True] if host in ("127.0.0.1", "localhost", "::1") else [False]
    error: Exception | None = None
    for on_loopback in tries:
        if on_loopback:
            loopback_only()
        try:
            ray.init(address=address, **kwargs)
            return
        except ConnectionError as e:
            error = e
            if ray.is_initialized():
                ray.shutdown()
    raise PipelineError(f"cannot reach the Ray cluster at run.ray_address = '{address}' ({error}). Check that it "
                        f"runs (`ray status --address {address}`), that the address is the head's GCS address "
                        f"(host:port of `ray start --head --port`, or ray://host:10001 for Ray Client) and that "
                        f"this machine can reach it, with the cluster's token where it uses token authentication "
                        f"(RAY_AUTH_TOKEN or ~/.ray/auth_token, the same RAY_AUTH_MODE on both sides); '' starts a "
                        f"private local Ray instead") from error


def setup_worker() -> None:
    """Runs in every Ray worker process (runtime_env worker_process_setup_hook: on the private local Ray, on a
    cluster joined through run.ray_address, and named in jobs/runtime_env.yaml and the RayJob):

    - The State API of this worker is its own cluster's, or none (own_cluster). Ray Train's
      PlacementGroupCleaner asks it every second whether the run's controller still lives, and removes
      the run's placement group when the answer is "no such actor". Unpinned, the State API went to the Ray
      started last on this machine, or to http://127.0.0.1:8265 (what a Ray without a dashboard records as
      its dashboard's address), i.e. to whichever other Ray's dashboard listens there. That one knew no such
      controller, and the live run's placement group was removed: every training worker killed ("Destroying
      worker since its placement group was removed"), the job failed. Reproduced with `ray start --head`
      beside a running `train`, and in a suite run where another test's job had its dashboard on 8265.
    - Ray Train's INFO lines (resources requested, worker group started with each pid, process group set
      up) repeat what the [data] and [train] lines say: turned down to WARNING (its warnings still show)."""
    own_cluster(find_dashboard=True)
    logging.getLogger("ray.train").setLevel(logging.WARNING)


# The State API address of a worker whose cluster serves none: port 0 never listens, so every State API call
# fails at once (Ray Train's cleaner takes that as "unavailable, try again") instead of asking another Ray.
NO_STATE_API = "http://127.0.0.1:0"


def own_cluster(find_dashboard: bool) -> None:
    """RAY_ADDRESS: this worker's own cluster (GCS). RAY_API_SERVER_ADDRESS (the State API): its own
    dashboard once that answers with this cluster's session name, else NO_STATE_API (at once, without
    looking, where the Ray was started without one: find_dashboard=False)."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    found = optional("finding this cluster's own dashboard", _own_dashboard) if find_dashboard else None
    os.environ["RAY_API_SERVER_ADDRESS"] = found or NO_STATE_API


def _own_dashboard() -> str | None:
    import json
    import urllib.request

    import ray
    import ray.experimental.internal_kv as kv
    from ray._private import ray_constants
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    where = kv._internal_kv_get(ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    if not where:
        return None
    url = f"http://{where.decode()}"
    request = urllib.request.Request(f"{url}/api/version", headers=get_auth_headers_if_auth_enabled({}))
    try:
        with urllib.request.urlopen(request, timeout=1.0) as r:
            session = json.loads(r.read()).get("session_name")
    except (OSError, ValueError):  # nothing listens there, or not a Ray dashboard, or refused
        return None
    return url if session == ray._private.worker.global_worker.node.session_name else None


def setup_worker_without_dashboard() -> None:
    """setup_worker, for the private local Ray started without its dashboard (run.dashboard = false).
    Ray Train's PlacementGroupCleaner asks the State API (a dashboard module) every few seconds whether
    the controller still lives, and warns each time it cannot; it is there to free a dead controller's
    placement group on a cluster that outlives the job, and this Ray ends with the command, placement
    groups and all. It has no State API, so none is looked for."""
    own_cluster(find_dashboard=False)
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


# The names runtime envs written before used (jobs/runtime_env.yaml named quiet_worker).
quiet_worker, quiet_worker_without_dashboard = setup_worker, setup_worker_without_dashboard


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
