"""The public API: describe the data once on the driver, get each rank's rows and a loader in the loop.

Driver (or every torchrun process, or a notebook):

    plan = pipeline.prepare("data/demo", label="label", world_size=2)   # validate, fit, plan every rank's share
    trainer = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2), **plan.trainer_kwargs())

Worker (inside the loop, under Ray Train, torchrun or none):

    data = pipeline.rank_data(plan, batch_size=1024)     # this rank's training/validation rows + a loader
    for epoch in range(epochs):
        data.loader.set_epoch(epoch)
        for batch in data.loader: ...                    # pipeline.Batch(x_num, x_cat, y, w) on the device

`prepare` runs the fit pass on Ray when Ray is initialised (one task per row group, across the
cluster) and in this process otherwise; both give the same fitted state and the same plan. Under Ray
Train each rank's rows are read and transformed by Ray Data tasks on the rank's own node; elsewhere
the rank reads them itself with pyarrow. Either way rank r sees exactly the same rows and batches.

The package in three modules, one per side of the hand-off: plan.py (the IngestPlan object, saved and
loaded), driver.py (prepare), worker.py (rank_data and rank_context). Their names are here.
"""

from .driver import build_config, prepare
from .plan import IngestPlan, load_fit, read_spec
from .worker import RankData, end_process_group_at_exit, rank_context, rank_data, read_rank

__all__ = ["IngestPlan", "RankData", "build_config", "end_process_group_at_exit", "load_fit", "prepare", "rank_context",
           "rank_data", "read_rank", "read_spec"]
