"""Parquet shards to GPU trainers on Ray.

Serving needs only `FittedPreprocessor` (no Ray, no torch): `FittedPreprocessor.load(path).transform(table)`.
Names are imported lazily so that a Ray task importing one module does not pay for torch.
"""

__all__ = ["Batch", "FittedPreprocessor", "TabularDataset"]


def __getattr__(name: str):
    if name in ("Batch", "TabularDataset"):
        from . import dataset

        return getattr(dataset, name)
    if name == "FittedPreprocessor":
        from .preprocess import FittedPreprocessor

        return FittedPreprocessor
    raise AttributeError(name)
