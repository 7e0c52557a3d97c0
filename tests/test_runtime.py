"""A second Ray on the same machine never reaches into the job's own: every worker of a Ray the project
starts (or joins) resolves "the cluster" to its own, not to the one Ray started last on this machine.

Ray Train's PlacementGroupCleaner asks the State API, with no address, whether the run's controller still
lives; Ray resolves no address to the cluster started last on the machine. With a `ray start --head` (or
another job's private Ray) started after the job's, the cleaner asked that other cluster, found no such
controller and removed the live run's placement group: every training worker was killed and the job failed
(reproduced by hand with `ray start --head --include-dashboard=true` beside a running `train`).
pipeline.cluster.runtime.setup_worker pins RAY_ADDRESS in every worker to its own cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.cluster import runtime

pytestmark = [pytest.mark.ray]
REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, subprocess, sys

    import ray
    from ray._private import services, utils
    from ray.dashboard.utils import get_address_for_submission_client

    from pipeline import config

    from pipeline.cluster import runtime

    @ray.remote(num_cpus=0)
    def resolves_to():  # what every address-less lookup in a worker resolves to: the cluster, the State API
        return services.get_ray_address_from_environment(None, None), get_address_for_submission_client(None)

    # A second Ray, started the way `ray start --head` and ray.cluster_utils start one: it writes itself as
    # the machine's "latest cluster" (/tmp/ray/ray_current_cluster).
    other = subprocess.Popen([sys.executable, "-c", "import sys; from ray.cluster_utils import Cluster; "
                              "c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, "
                              "node_ip_address='127.0.0.1')); print(c.address, flush=True); sys.stdin.read(); c.shutdown()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        other_address = other.stdout.readline().strip()
        for dashboard in (False, True):  # the job's private Ray, as `train` starts it, without and with its dashboard
            runtime.init_ray(config.load(None, {"run.dashboard": dashboard, "run.num_cpus": 2}))
            context = ray.get_runtime_context()
            cluster, state_api = ray.get(resolves_to.remote(), timeout=120)
            print("RESULT " + json.dumps({"dashboard": dashboard, "own": context.gcs_address, "other": other_address,
                                          "latest": utils.read_ray_address(), "worker": cluster,
                                          "state_api": state_api,
                                          "own_dashboard": ray._private.worker.global_worker.node.webui_url}),
                  flush=True)
            ray.shutdown()
    finally:
        other.stdin.close()
        other.wait(timeout=120)
''')


def test_a_worker_resolves_its_own_cluster_when_another_ray_started_later(tmp_path):
    script = tmp_path / "two_rays.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cp = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]

    results = [json.loads(ln[len("RESULT "):]) for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")]
    assert [r["dashboard"] for r in results] == [False, True], cp.stdout[-3000:]
    for got in results:
        # The machine's "latest cluster" is the other Ray (or a third one a test beside this one started
        # since): what an unpinned worker resolves to.
        assert got["own"] != got["other"] and got["latest"] not in (None, got["own"]), got
        assert got["worker"] == got["own"], got
    # The State API: none without a dashboard (never http://127.0.0.1:8265, whoever listens there), the
    # Ray's own dashboard with one.
    assert results[0]["state_api"] == runtime.NO_STATE_API, results[0]
    assert results[1]["state_api"] == f"http://{results[1]['own_dashboard']}", results[1]
