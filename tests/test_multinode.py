"""The whole job on a multi-node Ray cluster, simulated on this machine with `ray.cluster_utils.Cluster`.

A head node (no CPU; one in the node-loss test) and two worker nodes with 2 CPUs each (custom
resources node_a / node_b).
The cluster lives in a SUBPROCESS (a small script written below): this pytest process may already hold
a local Ray from another test module, and a driver can be connected to only one Ray at a time.

What the cluster run must show:
- the two training workers ran on different nodes (placement strategy SPREAD);
- rank r received exactly its contiguous share of the rows (rows [r*N/W, (r+1)*N/W), the validation
  hold-out removed), and drew from it exactly the batches an uninterrupted single-machine run draws;
- every training row is used once per epoch, apart from the reported drop_last remainder;
- every rank ran the same number of steps;
- each rank's share was read and transformed on the rank's own node (locality);
- after a worker node is lost mid-epoch (its raylet and every process on it killed, its objects
  lost), Ray Train restarts the workers from the latest committed mid-epoch checkpoint on the
  remaining nodes and the run continues exactly: the same batches, losses and accuracy as the
  uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from helpers import expected_batches

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ROWS, WORLD, BATCH, EPOCHS = 40_000, 2, 256, 2
ELASTIC_EPOCHS = 4  # long enough for a node to be lost, the run to shrink, a node to come back and the run to grow
TIMEOUT_S = 600  # only catches a hung job: starting three Ray nodes takes minutes on a loaded machine

CLUSTER_SCRIPT = textwrap.dedent('''
    """Start a 3-node Ray cluster, train on it, print a JSON summary on the last line, shut down."""
    import glob, json, os, sys, threading, time

    import ray
    from ray.cluster_utils import Cluster

    data, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    small = dict(object_store_memory=150 * 1024**2)
    # node_loss: the head keeps one CPU, as real heads do. After the loss the restarted training
    # workers hold every CPU of the surviving worker node and the head's; each re-reads its share
    # in its own process (loader.read_share = worker), so none waits for a free CPU.
    head_cpus = 1 if mode == "node_loss" else 0
    # elastic: one CPU a worker node, so losing one leaves room for one training worker, not two
    node_cpus = 1 if mode == "elastic" else 2
    small = {**small, "node_ip_address": "127.0.0.1"}  # loopback only (with LOOPBACK_ONLY in the environment)
    if mode == "plain":  # the first attempt of count reducer 0 kills its own worker (ray_side._fail_once)
        os.environ["PIPELINE_FAIL_ONCE"] = os.path.join(out, "faults")
        os.makedirs(os.environ["PIPELINE_FAIL_ONCE"], exist_ok=True)
    # The GCS declares a removed node dead after 3 failed health checks a second apart, not Ray's default 5
    # every 3 s: until then Ray Train restarts for the workers the lost node had, and waits for them in vain.
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 3000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=head_cpus, include_dashboard=False,
                                                                _system_config=health, **small))
    nodes = {"head": cluster.head_node,
             "a": cluster.add_node(num_cpus=node_cpus, resources={"node_a": 1}, **small),
             "b": cluster.add_node(num_cpus=node_cpus, resources={"node_b": 1}, **small)}
    cluster.wait_for_nodes()
    summary = {"events": []}
    try:
        import ray.train
        from pipeline import config
        from pipeline.job import driver as train
        from pipeline.cluster import runtime

        overrides = {"data.path": data, "run.output": out, "run.name": "mn", "run.ray_address": cluster.address,
                     "train.epochs": %(epochs)d, "train.batch_size": %(batch)d, "train.num_workers": %(world)d,
                     "train.hidden": [32], "train.trace_batches": True}
        if mode == "node_loss":
            overrides.update({"train.checkpoint_every_steps": 10, "train.max_failures": 2})
        elif mode == "elastic":
            overrides.update({"train.checkpoint_every_steps": 20, "train.max_failures": 3, "train.num_workers": [1, 2],
                              "train.elastic_resize_s": 2.0, "train.epochs": %(elastic_epochs)d})
        else:  # the plain run takes the Ray Data path: tasks pinned to each rank's node, through the DataConfig
            overrides["loader.read_share"] = "ray_data"
            overrides["preprocess.vocab_partitions"] = 3  # three count reducers, spread over the nodes
        if "train.placement_strategy" in config.keys():
            overrides["train.placement_strategy"] = "SPREAD"
            summary["spread_by"] = "config"
        else:  # the pipeline has no such key yet: make its ScalingConfig spread the workers
            _scaling = ray.train.ScalingConfig

            def spread(*args, **kwargs):
                kwargs.setdefault("placement_strategy", "SPREAD")
                return _scaling(*args, **kwargs)

            ray.train.ScalingConfig = spread
            summary["spread_by"] = "patched ScalingConfig"
        cfg = config.load(None, overrides)
        runtime.init_ray(cfg)  # joins the cluster: run.ray_address is its address

        def committed(run_dir):
            try:
                with open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) as f:
                    latest = json.load(f).get("latest_checkpoint_result")
                return latest and latest["metrics"]
            except (OSError, ValueError):
                return None

        def last_step(run_dir):
            try:
                with open(os.path.join(run_dir, "trace-rank0.txt")) as f:
                    e, k, _ = f.read().splitlines()[-1].split()
                return int(e), int(k)
            except (OSError, IndexError, ValueError):
                return None

        def lose_a_worker_node():
            """Once a mid-epoch checkpoint is committed and training went past it, remove a worker node
            hosting a training worker: its raylet and every process on it die, its objects are lost."""
            deadline = time.monotonic() + 500
            while time.monotonic() < deadline:
                time.sleep(0.02)
                runs = glob.glob(os.path.join(out, "mn-*"))
                c = committed(runs[0]) if runs else None
                k = last_step(runs[0]) if runs else None
                if c and c.get("mid_epoch") and k and k[0] == c["epoch"] and c["step"] + 2 <= k[1] < 65:
                    hosts = {a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                             if a.get("ActorClassName") == "RayTrainWorker" and a.get("State") == "ALIVE"}
                    name = next(n for n in ("a", "b") if nodes[n].node_id in hosts)
                    cluster.remove_node(nodes[name], allow_graceful=False)
                    summary["events"].append({"lost": name, "committed": [c["epoch"], c["step"]], "traced": list(k)})
                    return

        def worlds_after(run_dir, since):
            try:
                with open(os.path.join(run_dir, "ids-rank0.txt")) as f:
                    return [int(w) for t, _, _, w, *_ in (ln.split(" ", 5) for ln in f) if float(t) > since]
            except (OSError, ValueError):
                return []

        def shrink_then_grow():
            """Lose a worker node mid-epoch (the run goes on with one worker from its last checkpoint), then,
            once that one worker trains, add a node back: the run grows to two workers at its next resize."""
            deadline = time.monotonic() + 400
            lost_at = None
            while time.monotonic() < deadline:
                time.sleep(0.05)
                runs = glob.glob(os.path.join(out, "mn-*"))
                if not runs:
                    continue
                if lost_at is None:
                    c, k = committed(runs[0]), last_step(runs[0])
                    if c and c.get("mid_epoch") and k and k[0] == c["epoch"] and c["step"] + 2 <= k[1]:
                        hosts = {a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                                 if a.get("ActorClassName") == "RayTrainWorker" and a.get("State") == "ALIVE"}
                        name = next(n for n in ("a", "b") if nodes[n].node_id in hosts)
                        cluster.remove_node(nodes[name], allow_graceful=False)
                        lost_at = time.time()
                        summary["events"].append({"lost": name, "committed": [c["epoch"], c["step"]]})
                elif 1 in worlds_after(runs[0], lost_at):
                    nodes["c"] = cluster.add_node(num_cpus=1, resources={"node_c": 1}, **small)
                    summary["events"].append({"added": "c"})
                    return

        if mode == "node_loss":
            threading.Thread(target=lose_a_worker_node, daemon=True).start()
        if mode == "elastic":  # Cluster.add_node starts processes, which only the main thread may do
            # The one-worker attempt must still be training when the node comes back, however fast or slow this
            # machine: once it has trained past two of its own mid-epoch checkpoints it holds (sleeps between
            # steps) until Ray Train, seeing the returned node, restarts the run on two workers and ends it. The
            # driver hands Ray Train this wrapper for the job's loop (pickled by value from this script).
            from pipeline.job import driver

            every = cfg.train.checkpoint_every_steps

            def held_loop(loop_config):
                import time

                import ray.train
                from pipeline.job import loop

                plain_timed = loop.timed

                def timed(loader, stats):
                    steps = 0
                    for batch in plain_timed(loader, stats):
                        yield batch
                        steps += 1
                        while ray.train.get_context().get_world_size() == 1 and steps > 2 * every + 2:
                            time.sleep(0.1)

                loop.timed = timed
                return loop.train_loop_per_worker(loop_config)

            driver.train_loop_per_worker = held_loop

            done = {}
            job = threading.Thread(target=lambda: done.update(result=train.run(cfg)), daemon=True)
            job.start()
            shrink_then_grow()
            job.join()
            result = done["result"]
        else:
            result = train.run(cfg)
        summary["run"] = result
        summary["nodes"] = {name: n.node_id for name, n in nodes.items()}
        summary["train_workers"] = [
            {"pid": a.get("Pid"), "node_id": a["Address"]["NodeID"], "state": a.get("State")}
            for a in ray._private.state.actors().values() if a.get("ActorClassName") == "RayTrainWorker"]
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)
''') % {"epochs": EPOCHS, "batch": BATCH, "world": WORLD, "elastic_epochs": ELASTIC_EPOCHS}


# ---------------------------------------------------------------------------------------------
# Helpers


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def run_on_cluster(tmp_path: Path, mode: str) -> tuple[dict, str, Path]:
    """Run the cluster script; returns (summary, log text, run folder)."""
    from pipeline import demo

    data, out = tmp_path / "data", tmp_path / "runs"
    demo.generate(str(data), rows=ROWS, shards=8, seed=11)
    script = tmp_path / "cluster_run.py"
    script.write_text(CLUSTER_SCRIPT)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           # After a node is lost, elastic training may first ask for the workers it had (its view of the
           # cluster's resources lags) and wait for their placement group in vain: 8 s, not a minute. A group
           # that can be placed is ready in well under a second, even on a loaded machine.
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "8",
           "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING": "0", "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0"}
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # this tree's code
    log = tmp_path / "cluster.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(script), str(data), str(out), mode], cwd=REPO, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(proc.pid), proc.pid]:  # the script and the Ray nodes it started, nothing else
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            pytest.fail(f"cluster run did not finish in {TIMEOUT_S}s; log:\n{log.read_text()[-6000:]}")
    text = log.read_text()
    assert rc == 0, f"exit code {rc}; log:\n{text[-6000:]}"
    line = [ln for ln in text.splitlines() if ln.startswith("SUMMARY ")]
    assert line, text[-6000:]
    summary = json.loads(line[-1][len("SUMMARY "):])
    return summary, text, Path(summary["run"]["run"])


def digest(ids: np.ndarray) -> str:
    return hashlib.sha1(ids.tobytes()).hexdigest()[:16]  # what train.py writes to trace-rank<r>.txt


def read_trace(path: Path) -> list[tuple[int, int, str]]:
    return [(int(e), int(k), h) for e, k, h in (ln.split() for ln in path.read_text().splitlines())]


def rank_nodes(run_dir: Path, summary: dict) -> dict[int, str]:
    """world rank -> node id of its worker in the last attempt, from sources other than the job's own report:
    the pid that wrote the rank's last traced step (ids-rank<r>.txt) and the GCS actor table (pid -> node)."""
    pid_node = {w["pid"]: w["node_id"] for w in summary["train_workers"]}
    out = {}
    for r in range(WORLD):
        last = (run_dir / f"ids-rank{r}.txt").read_text().splitlines()[-1].split()
        out[r] = pid_node[int(last[4])]
    return out


def check_rows_and_steps(text: str, summary: dict, expected, sizes, steps) -> None:
    m = re.search(r"\[train\] (\d+) worker\(s\) .*rows per rank \[([\d, ]+)\]; (\d+) steps/epoch of (\d+); "
                  r"drop_last remainder (\d+) rows/epoch", text)
    assert m, text[-4000:]
    got_sizes = [int(s) for s in m.group(2).split(",")]
    remainder = int(m.group(5))
    # Rank r's rows are its contiguous share of the N rows minus the hold-out (shares differ by <= 1 row).
    assert got_sizes == sizes and int(m.group(3)) == steps and int(m.group(4)) == BATCH
    shares = [ROWS * (r + 1) // WORLD - ROWS * r // WORLD for r in range(WORLD)]
    assert max(shares) - min(shares) <= 1
    epochs = summary["run"]["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    for e in epochs:  # the union of the shares is all the rows; every training row once per epoch
        assert sum(got_sizes) + e["val_rows"] == ROWS == summary["run"]["rows_read"]
        assert e["rows"] == WORLD * steps * BATCH and e["rows"] + remainder == sum(got_sizes), \
            f"epoch {e['epoch']} reports {e['rows']} rows, expected {WORLD * steps * BATCH} (after a mid-epoch " \
            f"resume the epoch's rows must include those trained before the checkpoint): {e}"
    assert summary["run"]["accounting"]["rows_used"] == ROWS
    for epoch in range(EPOCHS):  # ... and the rows the batches name are distinct (none twice in an epoch)
        ids = np.concatenate([expected[(r, epoch, k)] for r in range(WORLD) for k in range(1, steps + 1)])
        assert len(np.unique(ids)) == len(ids) == sum(got_sizes) - remainder


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """One uninterrupted run on the cluster, shared by the tests below."""
    return run_on_cluster(tmp_path_factory.mktemp("plain"), "plain")


def test_cluster_spreads_ranks_and_splits_rows_exactly(plain_run):
    expected, sizes, steps = expected_batches(ROWS, WORLD, BATCH, EPOCHS)
    summary, text, run_dir = plain_run

    nodes = summary["nodes"]
    per_rank = rank_nodes(run_dir, summary)
    assert sorted(per_rank) == list(range(WORLD)), text[-4000:]
    # The two ranks ran on different nodes, both worker nodes (the head has no CPU for them).
    assert len(set(per_rank.values())) == WORLD, (per_rank, nodes, summary["spread_by"])
    assert set(per_rank.values()) == {nodes["a"], nodes["b"]}
    assert summary["run"]["epochs"][0]["node_ids"] == [per_rank[r] for r in range(WORLD)]  # as the job reports it
    # Locality: every row of each rank's share was read and transformed on the rank's own node (its
    # worker node has a CPU to spare for Ray Data tasks), so no transformed block crossed the network.
    first = summary["run"]["epochs"][0]
    assert sum(first["share_rows"]) == ROWS and max(first["share_rows"]) - min(first["share_rows"]) <= 2
    assert first["share_rows_local"] == first["share_rows"], first

    check_rows_and_steps(text, summary, expected, sizes, steps)
    # Every worker's State API is this cluster's, never another Ray on the machine (pipeline.cluster.runtime.setup_worker:
    # the run joined through run.ray_address, whose runtime env names it). Unpinned, Ray Train's placement-group
    # cleaner went to the Ray started last on the machine, saying so on every check.
    assert "Found multiple active Ray instances" not in text, text[-4000:]
    for r in range(WORLD):  # each rank drew exactly the batches of its share, the same number of steps
        trace = read_trace(run_dir / f"trace-rank{r}.txt")
        assert [(e, k) for e, k, _ in trace] == [(e, k) for e in range(EPOCHS) for k in range(1, steps + 1)]
        assert [h for _, _, h in trace] == [digest(expected[(r, e, k)]) for e, k, _ in trace]


def test_a_count_reducer_lost_mid_fit_is_retried_and_the_ids_equal_one_process_fit(plain_run):
    """The plain run's fit ran on the cluster as a partitioned shuffle of the category counts: three
    reducers, the first attempt of one killed (its worker process died, as on a lost node). Ray ran it
    again, and the vocabularies it saved give exactly the ids of the same fit in one process, whatever
    the number of parts."""
    import pyarrow.parquet as pq

    import pipeline

    summary, text, run_dir = plain_run
    assert (run_dir.parent / "faults" / "reduce_counts-0").exists(), "the reducer was never killed"
    assert re.search(r"\[fit\] one pass in [0-9.]+s \(Ray\)", text), text[-4000:]
    on_cluster = pipeline.FittedPreprocessor.load(str(run_dir / "preprocessor.json"))
    assert {v.partitions for v in on_cluster.vocab if len(v)} == {3}
    here = pipeline.prepare(str(run_dir.parent.parent / "data"), use_ray=False, world_size=1, vocab_partitions=1).fitted
    assert [list(v) for v in on_cluster.vocab] == [list(v) for v in here.vocab]
    table = pq.read_table(next((run_dir.parent.parent / "data").glob("*.parquet")))
    np.testing.assert_array_equal(on_cluster.transform(table).x_cat, here.transform(table).x_cat)
    assert on_cluster.stats["categorical"] == here.stats["categorical"]


def test_cluster_node_loss_resumes_mid_epoch_exactly(tmp_path, plain_run):
    expected, sizes, steps = expected_batches(ROWS, WORLD, BATCH, EPOCHS)
    summary, text, run_dir = run_on_cluster(tmp_path, "node_loss")

    assert summary["events"], f"no worker node was removed; log:\n{text[-4000:]}"
    (event,) = summary["events"]
    (ce, ck), (te, tk) = event["committed"], event["traced"]
    nodes = summary["nodes"]
    per_rank = rank_nodes(run_dir, summary)  # the worker group started after the loss
    assert sorted(per_rank) == list(range(WORLD)) and nodes[event["lost"]] not in per_rank.values(), (per_rank, nodes)
    assert summary["run"]["epochs"][-1]["node_ids"] == [per_rank[r] for r in range(WORLD)]  # as the job reports it

    g = lambda e, k: e * steps + k  # noqa: E731 - global step, 1-based within an epoch
    resumed = set()
    for r in range(WORLD):
        trace = read_trace(run_dir / f"trace-rank{r}.txt")
        for e, k, h in trace:  # before and after the restart: exactly the uninterrupted run's batches
            assert h == digest(expected[(r, e, k)]), (r, e, k)
        jumps = [i for i in range(1, len(trace)) if g(*trace[i][:2]) != g(*trace[i - 1][:2]) + 1]
        if not jumps:  # the node went down right after a checkpointed step: the restart goes on at the next step,
            # so the trace shows no jump; the second attempt's start marker (ids-rank<r>.txt) says where it began
            marks = [line.split() for line in (run_dir / f"ids-rank{r}.txt").read_text().splitlines()
                     if len(line.split()) == 5]
            assert len(marks) == 2, f"rank {r}: expected one restart, found attempts {marks}"
            e1, pos = int(marks[1][1]), int(marks[1][2])
            jumps = [next(i for i, (e, k, _) in enumerate(trace) if (e, k) == (e1, pos // (BATCH * WORLD) + 1))]
        assert len(jumps) == 1, f"rank {r}: expected one restart, found jumps at {jumps}"
        i = jumps[0]
        (e0, k0), (e1, k1) = trace[i - 1][:2], trace[i][:2]
        # Resumed right after a checkpoint, no older than the one committed before the loss, and not
        # past the last step traced before it; then every remaining step exactly once.
        assert (k1 - 1) % 10 == 0 and g(ce, ck) < g(e1, k1) <= g(e0, k0), (r, event, trace[i - 1], trace[i])
        assert g(e0, k0) >= g(te, tk) - 1  # the ranks ran in lockstep up to the loss
        assert [g(e, k) for e, k, _ in trace[i:]] == list(range(g(e1, k1), EPOCHS * steps + 1))
        resumed.add((e1, k1))
    assert len(resumed) == 1 and min(resumed)[1] > 1, resumed  # same point on both ranks, mid-epoch
    check_rows_and_steps(text, summary, expected, sizes, steps)
    # Model and optimizer state came back exactly: the same losses and accuracy as the uninterrupted run
    # (the resumed epoch's training loss sums the steps before and after the checkpoint).
    for got, want in zip(summary["run"]["epochs"], plain_run[0]["run"]["epochs"], strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-9), (got, want)
        assert (got["val_loss"], got["val_acc"]) == (want["val_loss"], want["val_acc"]), (got, want)


def consumed_rows(run_dir: Path) -> dict[int, list[int]]:
    """epoch -> the row ids every rank trained on, across restarts and resizes: a step traced by an attempt
    that a later restart went back before (its checkpoint is older than the step) is not counted, since the
    model state it made was lost. Each line: time, epoch, the epoch's position after the step, world size,
    pid (one rank of one attempt), row ids; a line without ids marks where an attempt's rank started
    (epoch and position before its first step)."""
    lines = []
    for path in run_dir.glob("ids-rank*.txt"):
        for ln in path.read_text().splitlines():
            t, e, pos, w, pid, *ids = ln.split()
            # after an epoch's last step the loader is at the next epoch's start (position 0): the epoch's end
            at = float("inf") if ids and int(pos) == 0 else int(pos)
            lines.append((float(t), int(e), at, int(w), int(pid), [int(i) for i in ids]))
    lines.sort()
    # Every rank of every attempt marks where it starts before its first step, and no step of an attempt
    # ends before all its ranks started (the steps are collectives): a step traced before a later start
    # that went back before it was lost. (Inferred from each process's first step instead, a rank that
    # started a moment after another made the other's first step look lost.)
    resumes = [(t, e, pos) for t, e, pos, _, _, ids in lines if not ids]
    out: dict[int, list[int]] = {}
    for t, e, pos, w, pid, ids in lines:
        if ids and not any(t_r > t and (e_r, p_r) < (e, pos) for t_r, e_r, p_r in resumes):
            out.setdefault(e, []).extend(ids)
    return out


def test_elastic_run_shrinks_on_node_loss_and_grows_back_with_every_row_once_per_epoch(tmp_path):
    """train.num_workers = [1, 2] on the 3-node cluster: a worker node is removed mid-epoch, Ray Train goes
    on with one worker from the last checkpoint; a node is added back and the run grows to two workers at
    its next resize, from a checkpoint the one worker saved (the one-worker attempt holds after two of them
    until that resize comes: held_loop in the cluster script). The row ids the ranks consumed show every
    training row exactly once per epoch (less the drop_last remainder of the epoch's last stretch)."""
    from pipeline.feed.plan import holdout_mask

    summary, text, run_dir = run_on_cluster(tmp_path, "elastic")
    assert [next(iter(ev)) for ev in summary["events"]] == ["lost", "added"], (summary["events"], text[-4000:])
    train = np.arange(ROWS)[~holdout_mask(np.arange(ROWS), 0.1, 0)]
    worlds = [int(ln.split()[3]) for ln in (run_dir / "ids-rank0.txt").read_text().splitlines()]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes[:3] == [2, 1, 2], changes  # shrank on the loss, grew back onto the returned node
    rows = consumed_rows(run_dir)
    assert sorted(rows) == list(range(ELASTIC_EPOCHS))
    for e, ids in rows.items():
        assert len(ids) == len(set(ids)), f"epoch {e}: {len(ids) - len(set(ids))} rows trained twice"
        assert set(ids) <= set(train.tolist()) and len(train) - len(ids) < 2 * BATCH, (e, len(train), len(ids))
    assert len(summary["run"]["epochs"]) == ELASTIC_EPOCHS
