"""The built-in job on the driver: the run folder, the fit (beside starting the workers), the checks
before a run (resume, elastic, cluster size), TorchTrainer, and what the run prints and saves."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

import pipeline
from pipeline import Config, DataError, NoUsableRows, PipelineError, storage

from .loop import CHECKPOINT_FILE, FIT_FILE, PREPROCESSOR_FILE, QUARANTINE_FILE, train_loop_per_worker
from .warm import PLAN_FILE, check_shape, growth, previous_run, run_folder, warm_line


# ---------------------------------------------------------------------------------------------
# On the driver


def plan_run(cfg: Config, out_uri: str, use_ray: bool | None = None) -> "pipeline.IngestPlan":
    plan = prepare_run(cfg, out_uri, cfg.train.workers, use_ray=use_ray)
    if not plan.accounting.balanced:
        raise DataError(f"row accounting does not balance: {plan.accounting.summary()}; was data.path modified "
                        f"during the run?")
    return plan


def workers_beside_fit(cfg: Config) -> bool:
    """run.start_workers. auto: measured on a 2-core machine with 2 workers, starting them beside the
    fit made both slower (fit 2.8 -> 3.9 s, workers 7.7 -> 10.5 s) for no gain; with cores to spare the
    fit's seconds disappear behind the workers' start-up."""
    if cfg.run.start_workers == "auto":
        return cfg.loader.read_share == "worker" and (os.cpu_count() or 1) > cfg.train.workers + 1
    return cfg.run.start_workers == "beside_fit"


def fit_beside(trainer, box, make_plan: Callable[[], "pipeline.IngestPlan"]):
    """trainer.fit() in a thread while make_plan() runs here; the plan goes into the box the workers
    wait on. A failed make_plan raises at once (the workers find None in the box and end)."""
    fit = Background(trainer.fit)
    try:
        plan = make_plan()
    except BaseException:
        box.put.remote(None)
        raise
    box.put.remote(plan)
    return plan, fit.result()


class Background:
    """fn(*args) in a daemon thread (a failure while Ray starts ends the command without waiting for
    it); result() re-raises its exception in the caller's thread."""

    def __init__(self, fn: Callable, *args) -> None:
        import threading

        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name="plan", daemon=True)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self._out["result"] = fn(*args)
        except BaseException as e:  # re-raised by result(), in the caller's thread
            self._out["error"] = e

    def result(self):
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)  # in slices, so that Ctrl-C reaches the main thread
        if "error" in self._out:
            raise self._out["error"]
        return self._out["result"]


class PlanBox:
    """Hands the IngestPlan to training workers that were started before it existed, so that Ray
    Train's worker group (several seconds: a controller and a process per rank, each importing torch)
    starts while the driver validates and fits. A Ray actor (num_cpus=0) owned by the driver: if the
    driver dies, so does the box, and a waiting worker's get() fails instead of waiting."""

    def __init__(self) -> None:
        import asyncio

        self._ready, self._plan = asyncio.Event(), None

    async def put(self, plan) -> None:  # None: prepare failed, the workers end at once
        self._plan = plan
        self._ready.set()

    async def get(self):
        await self._ready.wait()
        return self._plan


def run_name(cfg: Config) -> str:
    """A fresh folder per run, unless resuming: re-running a command never silently continues an old run."""
    return cfg.run.name if cfg.run.resume else f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


RESUME_KEYS = ("batch_size", "seed", "shuffle", "drop_last")  # any number of workers resumes (sampler.py)


def check_resume(cfg: Config, out_uri: str) -> None:
    """With run.resume, refuse up front (not inside every worker, after Ray Train retries) a run whose
    settings could not continue the checkpoint's batch order exactly."""
    snapshot = storage.join(out_uri, "checkpoint_manager_snapshot.json")
    if not cfg.run.resume or not storage.exists(*storage.filesystem(snapshot)):
        return
    latest = (storage.read_json(snapshot) or {}).get("latest_checkpoint_result") or {}
    if not latest.get("checkpoint_dir_name"):
        return
    saved_uri = storage.join(out_uri, latest["checkpoint_dir_name"], "config.json")
    saved = Config.model_validate(storage.read_json(saved_uri))
    diff = [f"train.{k} = {getattr(saved.train, k)!r} there, {getattr(cfg.train, k)!r} now" for k in RESUME_KEYS
            if getattr(saved.train, k) != getattr(cfg.train, k)]
    if diff:
        raise PipelineError(f"cannot resume run '{out_uri}' exactly: its last checkpoint ({saved_uri}) was written "
                            f"with {'; '.join(diff)}. Each rank's rows and batch order depend on these, so the run "
                            f"would not continue where it stopped. Resume with the checkpoint's values, or start a new "
                            f"run (run.resume = false)")


def check_elastic(cfg: Config, scaling_config: type, ray_version: str) -> bool:
    """Whether the run is elastic (train.num_workers = [min, max]); refused in one paragraph where this
    Ray Train has no elastic ScalingConfig."""
    lo, hi = cfg.train.workers_range
    if lo != hi and not hasattr(scaling_config, "elasticity_enabled"):  # Ray Train V2's elastic ScalingConfig
        raise PipelineError(f"train.num_workers = {[lo, hi]} asks for elastic training, which Ray Train has from Ray "
                            f"2.60 (ScalingConfig(num_workers=(min, max))); this is Ray {ray_version}. Upgrade Ray, "
                            f"or give train.num_workers one number")
    return lo != hi


def check_cluster_fits(workers: int, use_gpu: bool) -> None:
    """Stop at once, in one paragraph, when the cluster could never place the training workers (Ray
    Train would wait for them forever)."""
    import ray

    kind = "GPU" if use_gpu else "CPU"  # a GPU worker takes one GPU and no CPU; a CPU worker one CPU
    total = ray.cluster_resources().get(kind, 0.0)
    if total < workers:
        raise PipelineError(f"train.num_workers = {workers} needs {workers} {kind}s (one per training worker) but the "
                            f"Ray cluster has {total:g}; lower train.num_workers to {int(total) or 1}, "
                            + ("or set train.use_gpu = false" if use_gpu else "or give the local Ray more CPUs "
                               "(run.num_cpus) or join a larger cluster (run.ray_address)"))
    if not use_gpu and total == workers:
        print(f"[train] the {workers} training workers take all {total:g} CPUs of the cluster: each rank reads and "
              f"transforms its share inside its own worker process", flush=True)


def prepare_run(cfg: Config, out_uri: str, world_size: int, use_ray: bool | None = None) -> "pipeline.IngestPlan":
    """Validate, fit (or, resuming, reuse the run's preprocessor), plan; save the preprocessor and the
    quarantine manifest to the run folder and print what was decided."""
    saved = storage.join(out_uri, PREPROCESSOR_FILE)
    earlier = cfg.run.resume and storage.exists(*storage.filesystem(saved))
    manifest = storage.join(out_uri, QUARANTINE_FILE)
    plan_file = storage.join(out_uri, PLAN_FILE)
    prev = previous_run(cfg.run.since) if cfg.run.since else None
    try:
        if prev is not None and earlier and storage.exists(*storage.filesystem(plan_file)):
            plan = pipeline.IngestPlan.load(plan_file)  # a resumed increment: exactly the rows it planned
        else:
            plan = pipeline.prepare(config=cfg, world_size=world_size, fitted=saved if earlier and prev is None else None,
                                    use_ray=use_ray, **({"since": prev["plan_uri"]} if prev is not None else {}))
    except NoUsableRows as e:  # nothing to train on: the manifest still says what was set aside, and why
        if not e.manifest_jsonl:
            raise
        storage.write_text(manifest, e.manifest_jsonl)
        raise DataError(f"{e} Every file and row group set aside is listed in {manifest}", e.details) from None
    warm = ""
    if prev is not None:
        check_shape(prev, cfg, plan)
        warm, plan.timings["warm"] = warm_line(prev, plan, growth(prev["plan"].fitted, plan.fitted))
    if earlier:
        print(f"[fit] resuming: using the preprocessor fitted earlier, {saved}", flush=True)
    else:
        plan.fitted.save(saved)
        plan.save(plan_file)  # the next day's --run.since starts from this plan's version and fitted state
    fit_json = storage.join(out_uri, FIT_FILE)
    plan.save_fit(fit_json)  # `--run.fit_from` this file skips the fit pass next time, while the data is unchanged
    if plan.accounting.quarantined:
        storage.write_text(manifest, plan.accounting.manifest_jsonl())
    lines = plan.describe()
    if plan.accounting.quarantined:
        lines[2] += f"; manifest {manifest}"
    lines += [warm] if warm else []
    print("\n".join(lines) + f"\n[fit] saved {saved} and {fit_json} (reuse it with --run.fit_from)", flush=True)
    return plan


def first_step_line(started: float, ray_s: float, plan, history: list) -> tuple[str, dict]:
    """'[time] first training step N s after the command started: ...' and its figures. started: the
    command's wall-clock start; the workers' clock marks come from rank 0's first epoch. Stages that
    ran at the same time are said together, with the seconds until both were done."""
    clock = history[0].get("clock", {}) if history else {}
    if "first_step" not in clock:
        return "", {}
    t = plan.timings
    ready = clock.get("plan_ready", clock["loop_start"])  # the rank had both its process and the plan
    beside = t["trainer_started_at"] < t["planned_at"]  # the workers started while the driver fitted
    ray_span = t.get("ray_span")  # Ray started while the driver validated and fitted
    total = clock["first_step"] - started
    fig = {"start Ray": ray_s, "validate": t["validate_s"], "fit pass": t["fit_s"],
           "start the training workers": clock["loop_start"] - t["trainer_started_at"]}
    if ray_span:
        fig["Ray and the plan both ready"] = max(ray_span[1], t["planned_at"]) - ray_span[0]
    if beside:
        fig["plan and workers both ready"] = ready - t["trainer_started_at"]
    fig["read this rank's share"] = clock["data_ready"] - ready
    fig["first step (model, DDP, one batch)"] = clock["first_step"] - clock["data_ready"]
    s = {k: f"{k} {v:.1f}s" for k, v in fig.items()}
    fit = f"{s['validate']} + {s['fit pass']}"
    if ray_span and beside:  # Ray, then the workers, both while the driver fitted
        said = [f"{s['start Ray']} beside {fit}",
                f"{s['start the training workers']} beside the rest of the fit "
                f"({fig['plan and workers both ready']:.1f}s for both)"]
        path = ["start Ray", "plan and workers both ready"]
    elif ray_span:
        said = [f"{s['start Ray']} beside {fit} ({fig['Ray and the plan both ready']:.1f}s for both)",
                s["start the training workers"]]
        path = ["Ray and the plan both ready", "start the training workers"]
    elif beside:
        said = [s["start Ray"], f"{fit} beside {s['start the training workers']} "
                                f"({fig['plan and workers both ready']:.1f}s for both)"]
        path = ["start Ray", "plan and workers both ready"]
    else:
        said = [s["start Ray"], s["validate"], s["fit pass"], s["start the training workers"]]
        path = ["start Ray", "validate", "fit pass", "start the training workers"]
    path += ["read this rank's share", "first step (model, DDP, one batch)"]
    fig["other (imports, config)"] = total - sum(fig[k] for k in path)
    said += [s["read this rank's share"], s["first step (model, DDP, one batch)"],
             f"other (imports, config) {fig['other (imports, config)']:.1f}s"]
    line = f"[time] first training step {total:.1f}s after the command started: " + ", ".join(said)
    return line, {"total_s": round(total, 2), **{k: round(v, 2) for k, v in fig.items()}}


def run(cfg: Config, started: float | None = None, ray_s: float = 0.0,
        start_ray: Callable[[Config], None] | None = None, starts_private_ray: bool = False) -> dict[str, Any]:
    """The whole job; returns the summary that is also written to <output>/<name>/metrics.json.
    start_ray(cfg), when given, connects to or starts Ray (the CLI's runtime.init_ray). When it starts
    a private local Ray (starts_private_ray) and the fit runs in this process (run.fit_on local, or
    auto on that one node), the fit needs no Ray and runs while Ray starts: Ray's processes spend most
    of their seconds being spawned and importing, the fit's threads in pyarrow and numpy."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not cfg.data.targets:
        raise PipelineError("data.label is empty, so there is nothing for the built-in train job to learn; name the "
                            "target column(s) with data.label, or read unlabelled rows through pipeline.prepare and "
                            "pipeline.rank_data in your own loop (docs/api.md)")
    if cfg.run.since:  # resolved once (runs/<name>: its newest finished run), so every worker reads that run
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"since": run_folder(cfg.run.since)})})
    name = run_name(cfg)
    out_uri = storage.join(cfg.run.output, name)
    t_start = time.perf_counter()
    started = started or time.time()
    check_resume(cfg, out_uri)
    early = None  # the plan, made while Ray starts
    if start_ray is not None:
        if starts_private_ray and cfg.run.fit_on != "ray":
            early = Background(plan_run, cfg, out_uri, False)
        t0 = time.time()
        start_ray(cfg)
        ray_s = time.time() - t0
        if early is not None:
            early.ray_span = (t0, t0 + ray_s)
    use_gpu = cfg.train.use_gpu == "true" or (cfg.train.use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
    check_cluster_fits(cfg.train.workers_range[0], use_gpu)
    elastic = check_elastic(cfg, ScalingConfig, ray.__version__)
    # Ray Train writes through the filesystem pipeline.storage builds (same endpoint, addressing style
    # and credentials as every other read and write), pickled to its controller and workers.
    storage_path, storage_filesystem = storage.ray_storage(cfg.run.output)

    def trainer(plan, **data) -> TorchTrainer:
        return TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"plan": plan, "stall_timeout_s": cfg.run.stall_timeout_s,
                               "run_dir": os.path.abspath(out_uri) if storage.is_local(out_uri) else None},
            scaling_config=ScalingConfig(num_workers=cfg.train.workers_range if elastic else cfg.train.workers,
                                         **({"elastic_resize_monitor_interval_s": cfg.train.elastic_resize_s}
                                            if elastic else {}),
                                         use_gpu=use_gpu,
                                         resources_per_worker=None if use_gpu else {"CPU": 1},
                                         placement_strategy=cfg.train.placement_strategy),
            run_config=RunConfig(name=name, storage_path=storage_path, storage_filesystem=storage_filesystem,
                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                 failure_config=FailureConfig(max_failures=cfg.train.max_failures)),
            **data)

    if workers_beside_fit(cfg):
        # The trainer needs nothing from the plan but the plan itself (the ranks read their own shares),
        # so Ray Train starts its workers now and they take the plan from a PlanBox once it exists.
        box = ray.remote(num_cpus=0)(PlanBox).remote()
        started_at = time.time()
        plan, result = fit_beside(trainer(box), box, early.result if early else lambda: plan_run(cfg, out_uri))
    else:  # ray_data: the plan's DataConfig is part of the trainer, so the plan comes first
        plan = early.result() if early else plan_run(cfg, out_uri)
        started_at = time.time()
        result = None if plan.empty else \
            trainer(plan, **plan.trainer_kwargs(cpus_per_worker=0.0 if use_gpu else 1.0)).fit()
    plan.timings["trainer_started_at"] = started_at
    if early is not None:
        plan.timings["ray_span"] = early.ray_span
    acct = plan.accounting
    history = getattr(result, "return_value", None) or []  # Ray 2.52 has no return_value: then the last checkpoint's
    if not history and result is not None and result.checkpoint is not None:
        with result.checkpoint.as_directory() as d:
            history = torch.load(os.path.join(d, CHECKPOINT_FILE), weights_only=False)["history"]
    missing = sorted(set(range(1, cfg.train.epochs + 1)) - {int(e["epoch"]) for e in history}) if history else []
    if plan.empty:  # nothing new after the previous run's version: its model stands, and this run moves since= on
        print(f"[warm] nothing new: the model stays the previous run's ({plan.timings['warm']['previous_checkpoint']}); "
              f"the next --run.since may name this run", flush=True)
    if missing:  # a defect, never expected: say so rather than report fewer epochs quietly
        print(f"[train] warning: the run trained {cfg.train.epochs} epochs but its final history lacks the metrics "
              f"of epoch(s) {missing}; its checkpoints are in {out_uri}", flush=True)
    summary = {"run": out_uri, "rows_read": acct.rows_read, "missing_epoch_metrics": missing, "accounting": acct.as_dict(),
               "accounting_summary": acct.summary(), "epochs": history,
               "coverage": plan.fitted.stats.get("categorical", {}),
               "targets": [{"name": t.name, "kind": t.kind, "classes": len(t.classes)} for t in plan.fitted.targets],
               "checkpoint": storage.to_uri(result.checkpoint.filesystem, result.checkpoint.path)
               if result is not None and result.checkpoint else
               plan.timings["warm"]["previous_checkpoint"] if plan.empty else None,
               "preprocessor": storage.join(out_uri, PREPROCESSOR_FILE), "use_gpu": use_gpu,
               **({"warm": plan.timings["warm"]} if "warm" in plan.timings else {}),
               "wall_s": round(time.perf_counter() - t_start, 2)}
    line, figures = first_step_line(started, ray_s, plan, history) if not cfg.run.resume else ("", {})
    if line:
        print(line, flush=True)
        summary["time_to_first_step"] = figures
    storage.write_json(storage.join(out_uri, "metrics.json"), summary)
    return summary
