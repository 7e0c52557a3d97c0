"""Your own DDP loop under torchrun, no Ray: the same public API, the same rows and batches.

    torchrun --standalone --nproc_per_node 2 examples/torchrun_loop.py --data data/demo --label label

Every process calls `pipeline.prepare` (on small data each fits the same statistics in-process; on
large data let rank 0 prepare and `plan.save(path)`, then the others `pipeline.IngestPlan.load(path)`
after a barrier: they map the vocabulary files saved beside it) and `pipeline.rank_data`, which takes rank and world size from torch.distributed and
reads only this rank's pieces with pyarrow. For the same data, seed and world size, rank r gets exactly
the rows and batches it gets under Ray Train.

Daily increments: --out DIR keeps the plan and the final model and optimizer; the next day, --since DIR
plans only the rows gained since (`prepare(since=...)`) and starts from that model, its one EmbeddingBag
(every column's block, one after the other) grown to the new ids by `pipeline.grow_embedding`.

Elastic: with --checkpoint, rank 0 saves the model, optimizer and loader state every --checkpoint-every
steps, and a run that finds the file goes on from it on however many processes it has (torchrun
--nnodes=MIN:MAX restarts with a new WORLD_SIZE; or change --nproc_per_node): the rest of the epoch
is dealt over the new ranks, every row once. --stop-at-step ends the run there (a preemption).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import pipeline


def blocks(cardinalities) -> list[int]:
    """Where each column's block of the one table starts."""
    return [0, *torch.tensor(list(cardinalities)).cumsum(0).tolist()[:-1]] if len(cardinalities) else []


class Model(nn.Module):
    """Standardised features + one EmbeddingBag over every column's block (ids shifted by the blocks before:
    one lookup per batch, the columns' embeddings summed) -> MLP -> one logit."""

    def __init__(self, num_features: int, cardinalities, dim: int = 8):
        super().__init__()
        self.register_buffer("offsets", torch.tensor(blocks(cardinalities)), persistent=False)
        self.embedding = nn.EmbeddingBag(max(1, sum(cardinalities)), dim, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(num_features + dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x_num, x_cat):
        return self.mlp(torch.cat([x_num, self.embedding(x_cat + self.offsets)], dim=1)).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/demo")
    p.add_argument("--label", default="label")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default="")
    p.add_argument("--checkpoint", default="", help="a file: saved every --checkpoint-every steps, resumed from")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--stop-at-step", type=int, default=0, help="end the run after this step of the first epoch")
    p.add_argument("--out", default="", help="a folder: the plan and the final model and optimizer are kept there")
    p.add_argument("--since", default="", help="an earlier run's --out: train on the rows gained since, from its model")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    previous = pipeline.IngestPlan.load(os.path.join(args.since, "plan.pkl")) if args.since else None
    plan = pipeline.prepare(args.data, label=args.label, since=previous)  # world size from torch.distributed
    if plan.empty:  # nothing new after the previous plan's version: the previous model stands
        if dist.get_rank() == 0:
            print("\n".join(plan.describe()))
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                plan.save(os.path.join(args.out, "plan.pkl"))
                shutil.copy(os.path.join(args.since, "model.pt"), os.path.join(args.out, "model.pt"))
        dist.destroy_process_group()
        return
    state = torch.load(args.checkpoint, weights_only=False) if args.checkpoint and os.path.exists(args.checkpoint) \
        else None  # the loader state is the same on every rank and holds no rank count: any world size goes on
    data = pipeline.rank_data(plan, batch_size=args.batch_size, seed=args.seed, resume=state and state["loader"])
    if data.rank == 0:
        print("\n".join(plan.describe()))
    print(data.describe(), flush=True)

    f = data.fitted
    torch.manual_seed(0)
    growth = f.growth(previous.fitted) if previous is not None else None
    sizes = [growth[c][0] for c in f.categorical] if growth and not state else f.cardinalities
    model = Model(f.num_features, sizes).to(data.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if growth and not state:  # day k: yesterday's model and optimizer, the table grown to today's ids, before DDP
        saved = torch.load(os.path.join(args.since, "model.pt"), map_location=data.device, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        pipeline.grow_embedding(model.embedding, growth, optimizer, columns=f.categorical,
                                generator=torch.Generator(device=data.device).manual_seed(0))
        model.offsets = model.offsets.new_tensor(blocks(f.cardinalities))  # where each column's block starts now
    model = DistributedDataParallel(model, device_ids=[data.device.index] if data.device.type == "cuda" else None)
    if state:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    trace = open(os.path.join(args.trace, f"rank{data.rank}.txt"), "a") if args.trace else None
    for epoch in range(data.loader.state_dict()["epoch"], args.epochs):
        data.loader.set_epoch(epoch)
        total = torch.zeros(2, device=data.device)
        for batch in data.loader:
            loss = nn.functional.binary_cross_entropy_with_logits(model(batch.x_num, batch.x_cat), batch.y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=data.device)])
            if trace:
                ids = data.train.row_id[data.loader.last_index.cpu()].numpy()
                trace.write(f"{epoch} {data.loader.delivered} {hashlib.sha1(ids.tobytes()).hexdigest()[:16]}"
                            f" {' '.join(map(str, ids.tolist()))}\n")
                trace.flush()
            step = data.loader.delivered
            if args.checkpoint and step % args.checkpoint_every == 0 and data.rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": data.loader.state_dict()}, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)  # never a half-written checkpoint
            if args.stop_at_step and epoch == 0 and step == args.stop_at_step:
                dist.destroy_process_group()  # every rank stops at the same step, as a preempted job does
                return
        dist.all_reduce(total)
        if data.rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0].item() / total[1].item():.4f} over {int(total[1].item())} steps")
    if args.out and data.rank == 0:  # what the next day's --since starts from
        os.makedirs(args.out, exist_ok=True)
        plan.save(os.path.join(args.out, "plan.pkl"))
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(args.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
