"""Your own Ray Train loop, your own model, optimizer and checkpoints, on the pipeline's public API.

    python examples/ray_train_loop.py --data data/demo --label label --workers 2

The driver calls `pipeline.prepare` (validate, one fit pass on the cluster, plan every rank's share)
and hands the plan to TorchTrainer; each worker calls `pipeline.rank_data` for its rows and loader.
A checkpoint every --checkpoint-every steps holds the model, the optimizer and the loader's state, so
a worker lost mid-epoch (--fail-at-step makes rank 0 die once, to show it) resumes with exactly the
batches an uninterrupted run would have seen. --trace writes each batch's row ids, to check that.

Daily increments: --out DIR keeps the plan and the final model and optimizer there; the next day,
--since DIR plans only the rows the table gained since that plan's version (`prepare(since=...)`: known
ids never move) and starts from that model, each embedding grown to the new ids with
`pipeline.grow_embedding(embedding, {column: growth}, optimizer)`: the known rows stay as they were.

Elastic: --workers 1:4 runs Ray Train's elastic training (Ray 2.60+): when nodes are lost the group
restarts on fewer workers from the last checkpoint, and grows again when capacity comes back. The
loader state holds no rank count, so `rank_data(plan, resume=state)` deals the rest of the epoch over
however many workers there are now: every row once per epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile

import ray
import ray.train
import torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
from torch import nn

import pipeline


class Model(nn.Module):
    """Any model: here standardised features + summed category embeddings (one table per column) -> MLP."""

    def __init__(self, num_features: int, cardinalities: tuple[int, ...], dim: int = 8):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(n, dim) for n in cardinalities)
        self.mlp = nn.Sequential(nn.Linear(num_features + dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x_num, x_cat):
        emb = sum(e(x_cat[:, j]) for j, e in enumerate(self.embeddings))
        return self.mlp(torch.cat([x_num, emb], dim=1)).squeeze(1)


def loop(config: dict) -> None:
    plan: pipeline.IngestPlan = config["plan"]
    state, checkpoint = None, ray.train.get_checkpoint()
    if checkpoint:  # resuming: model, optimizer and the exact position in the data
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
    # The plan is re-planned for this many workers (elastic: maybe fewer or more than it was made for), and
    # the loader goes on from the saved position: the same dict on every rank, saved on any number of them.
    data = pipeline.rank_data(plan, batch_size=config["batch_size"], seed=config["seed"],
                              resume=state["loader"] if state else None)
    loader = data.loader
    torch.manual_seed(0)
    f, warm = data.fitted, config["warm"]
    if warm and not state:  # day k: yesterday's final model and optimizer, each table grown to today's ids
        before = {c: b for c, (b, _) in warm["growth"].items()}
        model = Model(f.num_features, tuple(before[c] for c in f.categorical))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        saved = torch.load(warm["model"], weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        for c, table in zip(f.categorical, model.embeddings):  # before DDP, which fixes the parameters' sizes
            pipeline.grow_embedding(table, {c: warm["growth"][c]}, optimizer, generator=torch.Generator().manual_seed(0))
        model = prepare_model(model)
    else:
        model = prepare_model(Model(f.num_features, f.cardinalities))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if state:
        model.module.load_state_dict(state["model"]) if hasattr(model, "module") else model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if data.rank == 0:
                inner = model.module if hasattr(model, "module") else model
                torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict()}, os.path.join(d, "state.pt"))
                ckpt = Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ckpt)  # every rank reports

    trace = open(os.path.join(config["trace"], f"rank{data.rank}.txt"), "a") if config["trace"] else None
    for epoch in range(loader.state_dict()["epoch"], config["epochs"]):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(model(batch.x_num, batch.x_cat), batch.y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step = loader.delivered
            if trace:
                ids = data.train.row_id[loader.last_index.cpu()].numpy()
                trace.write(f"{epoch} {step} {hashlib.sha1(ids.tobytes()).hexdigest()[:16]}\n")
                trace.flush()
            marker = os.path.join(config["trace"] or tempfile.gettempdir(), "failed-once")
            if data.rank == 0 and step == config["fail_at_step"] and epoch == 0 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # a lost worker: Ray Train restarts the group from the last checkpoint
            if config["every"] and step % config["every"] == 0 and step < len(loader):
                save({"epoch": epoch, "step": step, "loss": loss.item()})
        save({"epoch": epoch + 1, "step": 0, "loss": loss.item()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/demo")
    p.add_argument("--label", default="label")
    p.add_argument("--workers", default="2", help="N, or MIN:MAX for elastic training")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--fail-at-step", type=int, default=0)
    p.add_argument("--trace", default="")
    p.add_argument("--storage", default=os.path.abspath("runs"))
    p.add_argument("--out", default="", help="a folder: the plan and the final model and optimizer are kept there")
    p.add_argument("--since", default="", help="an earlier run's --out: train on the rows gained since, from its model")
    args = p.parse_args()

    workers = tuple(int(w) for w in args.workers.split(":")) if ":" in args.workers else int(args.workers)
    most = workers[-1] if isinstance(workers, tuple) else workers
    # Ray Train reads each rank's report when its controller polls (every 2 s by default), and a rank's next
    # report waits for that: at every checkpoint. A Ray started here inherits this (docs/usage.md: Reports).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    if "RAY_ADDRESS" in os.environ:  # inside `ray job submit`: the job's runtime env names the worker setup
        ray.init()
    else:  # every worker's State API is this Ray's, never another on the machine (docs/api.md)
        ray.init(address="local", num_cpus=max(4, most + 2),
                 runtime_env={"worker_process_setup_hook": "pipeline.cluster.runtime.setup_worker"})
    warm = None
    if args.since:  # only what the table gained after the previous plan's version; its ids kept
        previous = pipeline.IngestPlan.load(os.path.join(args.since, "plan.pkl"))
        plan = pipeline.prepare(args.data, label=args.label, world_size=most, since=previous)
        warm = {"model": os.path.join(os.path.abspath(args.since), "model.pt"), "growth": plan.fitted.growth(previous.fitted)}
    else:
        plan = pipeline.prepare(args.data, label=args.label, world_size=most)  # rank_data re-plans for fewer
    print("\n".join(plan.describe()))
    if plan.empty:  # nothing new: the previous model stands; the plan still moves the next --since on
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            plan.save(os.path.join(args.out, "plan.pkl"))
            shutil.copy(warm["model"], os.path.join(args.out, "model.pt"))
        return
    trainer = TorchTrainer(
        loop,
        train_loop_config={"plan": plan, "batch_size": args.batch_size, "seed": args.seed, "epochs": args.epochs,
                           "every": args.checkpoint_every, "fail_at_step": args.fail_at_step, "trace": args.trace,
                           "warm": warm},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=args.storage, checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=2)),
        **plan.trainer_kwargs(),  # the plan's datasets and DataConfig; pass yours as trainer_kwargs(datasets=...)
    )
    result = trainer.fit()
    print(f"done: {result.metrics}")
    if args.out:  # what the next day's --since starts from
        os.makedirs(args.out, exist_ok=True)
        plan.save(os.path.join(args.out, "plan.pkl"))
        with result.checkpoint.as_directory() as d:
            shutil.copy(os.path.join(d, "state.pt"), os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
