"""Your own DDP loop under torchrun, no Ray: the same public API, the same rows and batches.

    torchrun --standalone --nproc_per_node 2 examples/torchrun_loop.py --data data/demo --label label

Every process calls `pipeline.prepare` (on small data each fits the same statistics in-process; on
large data let rank 0 prepare and `plan.save(path)`, then the others `pipeline.IngestPlan.load(path)`
after a barrier: they map the vocabulary files saved beside it) and `pipeline.rank_data`, which takes rank and world size from torch.distributed and
reads only this rank's pieces with pyarrow. For the same data, seed and world size, rank r gets exactly
the rows and batches it gets under Ray Train.

Elastic: with --checkpoint, rank 0 saves the model, optimizer and loader state every --checkpoint-every
steps, and a run that finds the file goes on from it on however many processes it has (torchrun
--nnodes=MIN:MAX restarts with a new WORLD_SIZE; or change --nproc_per_node): the rest of the epoch
is dealt over the new ranks, every row once. --stop-at-step ends the run there (a preemption).
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import pipeline


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
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    plan = pipeline.prepare(args.data, label=args.label)  # world size from torch.distributed
    state = torch.load(args.checkpoint, weights_only=False) if args.checkpoint and os.path.exists(args.checkpoint) \
        else None  # the loader state is the same on every rank and holds no rank count: any world size goes on
    data = pipeline.rank_data(plan, batch_size=args.batch_size, seed=args.seed, resume=state and state["loader"])
    if data.rank == 0:
        print("\n".join(plan.describe()))
    print(data.describe(), flush=True)

    f = data.fitted
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(f.num_features + len(f.categorical), 64), nn.ReLU(), nn.Linear(64, 1)).to(data.device)
    model = DistributedDataParallel(model, device_ids=[data.device.index] if data.device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if state:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    trace = open(os.path.join(args.trace, f"rank{data.rank}.txt"), "a") if args.trace else None
    for epoch in range(data.loader.state_dict()["epoch"], args.epochs):
        data.loader.set_epoch(epoch)
        total = torch.zeros(2, device=data.device)
        for batch in data.loader:
            x = torch.cat([batch.x_num, batch.x_cat.float()], dim=1)  # ids as numbers: a deliberately tiny model
            loss = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), batch.y)
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
