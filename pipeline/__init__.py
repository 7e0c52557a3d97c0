"""Parquet shards to GPU trainers, on Ray or without it.

The public names (everything a training loop needs; nothing else has to be imported from inside):

- `prepare(path, label=..., world_size=...)` -> `IngestPlan`: validate, fit in one pass, plan every
  rank's share. `plan.trainer_kwargs()` gives TorchTrainer its datasets and DataConfig.
  `prepare(path, since=previous_plan)`: only the rows gained since, the previous fit extended (ids kept).
- `rank_data(plan, batch_size=...)` -> `RankData`: this rank's `train`/`val` rows and a `loader` of
  `Batch`es (Ray Train, torchrun or a single process).
- `FittedPreprocessor` (serving, no Ray, no torch): `.load(path).transform(df)` -> `Transformed`.
- `TabularDataset`, `BatchSampler`, `DeviceLoader`, `WorkerLoader`: the torch side, usable alone.
- `load_config` -> `Config`; `PipelineError`, `ConfigError`, `DataError`, `NoUsableRows`, `StallError`.
- `grow_embedding(module, fitted.growth(previous), optimizer)`: a warm start's embedding table (and its
  optimizer state) grown to an increment's new ids, the known rows kept bit for bit.
- `StepStats`, `timed(loader, stats)`: a loop's data-wait share and rows/s, as the built-in job prints them.
- `pipeline.storage`: local paths and `s3://`/`gs://` URIs through pyarrow filesystems (join, read/write
  JSON and text), as the job uses them for its run folder.

Names are imported lazily so that a Ray task importing one module does not pay for torch.
"""

__all__ = ["Batch", "BatchSampler", "Config", "ConfigError", "DataError", "DeviceLoader", "FittedPreprocessor",
           "IngestPlan", "NoUsableRows", "PipelineError", "RankData", "StallError", "StepStats", "TabularDataset",
           "Transformed", "WorkerLoader", "grow_embedding", "load_config", "prepare", "rank_context", "rank_data", "storage", "timed"]

_WHERE = {
    "Batch": "feed.dataset", "TabularDataset": "feed.dataset", "BatchSampler": "feed.sampler",
    "DeviceLoader": "feed.loader", "WorkerLoader": "feed.loader", "StepStats": "feed.metrics", "timed": "feed.metrics",
    "grow_embedding": "feed.grow", "FittedPreprocessor": "fit.preprocess", "Transformed": "fit.preprocess",
    "IngestPlan": "ingest", "RankData": "ingest", "prepare": "ingest", "rank_data": "ingest", "rank_context": "ingest",
    "PipelineError": "errors", "ConfigError": "errors", "DataError": "errors", "NoUsableRows": "errors",
    "StallError": "errors", "Config": "config",
}


from ._moved import install as _install_moved  # noqa: E402

_install_moved()  # the flat layout's module paths (pickled plans, saved states, hooks) still import


def __getattr__(name: str):
    if name == "load_config":
        from .config import load

        return load
    import importlib

    if name == "storage":
        return importlib.import_module(".storage", __name__)
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'pipeline' has no attribute '{name}'")


def __dir__():
    return sorted(__all__)
