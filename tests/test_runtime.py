"""A second Ray on the same machine never reaches into the job's own: every worker of a Ray the project
starts (or joins) resolves "the cluster" to its own, not to the one Ray started last on this machine.

Ray Train's PlacementGroupCleaner asks the State API, with no address, whether the run's controller still
lives; Ray resolves no address to the cluster started last on the machine. With a `ray start --head` (or
another job's private Ray) started after the job's, the cleaner asked that other cluster, found no such
controller and removed the live run's placement group: every training worker was killed and the job failed
(reproduced by hand with `ray start --head --include-dashboard=true` beside a running `train`).
pipeline.runtime.setup_worker pins RAY_ADDRESS in every worker to its own cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]
REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, subprocess, sys, time

    import ray
    from ray._private import services, utils

    from pipeline import config, runtime

    cfg = config.load(None, {"run.dashboard": False, "run.num_cpus": 2})
    runtime.init_ray(cfg)  # the job's private Ray, as `train` starts it
    own = ray.get_runtime_context().gcs_address
    # A second Ray, started after the job's the way `ray start --head` and ray.cluster_utils start one: it
    # writes itself as the machine's "latest cluster" (/tmp/ray/ray_current_cluster).
    other = subprocess.Popen([sys.executable, "-c", "import sys; from ray.cluster_utils import Cluster; "
                              "c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, "
                              "node_ip_address='127.0.0.1')); print(c.address, flush=True); sys.stdin.read(); c.shutdown()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        other_address = other.stdout.readline().strip()
        latest = utils.read_ray_address()

        @ray.remote(num_cpus=0)
        def resolves_to():  # what the State API and every address-less lookup in a worker resolve to
            return services.get_ray_address_from_environment(None, None)

        print("RESULT " + json.dumps({"own": own, "other": other_address, "latest": latest,
                                      "worker": ray.get(resolves_to.remote(), timeout=120)}), flush=True)
    finally:
        other.stdin.close()
        other.wait(timeout=120)
        ray.shutdown()
''')


def test_a_worker_resolves_its_own_cluster_when_another_ray_started_later(tmp_path):
    script = tmp_path / "two_rays.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cp = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    import json

    (line,) = [ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    # The machine's "latest cluster" is the other Ray (or a third one a test beside this one started since):
    # what an unpinned worker resolves to.
    assert got["own"] != got["other"] and got["latest"] not in (None, got["own"]), got
    assert got["worker"] == got["own"], got
