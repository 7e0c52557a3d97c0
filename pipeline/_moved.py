"""The module paths of the flat layout (before the stage folders), kept importable.

Plans pickled and fitted states saved by the earlier layout name their classes by these paths
(`pipeline.preprocess.FittedPreprocessor`, `pipeline.source.Fragment`, `pipeline.vocab_parts.Parts`), and
users' code and Ray runtime_env hooks import them (`pipeline.runtime.setup_worker`). Each old path is a
view that finds its names in the module(s) that hold them now; nothing else imports through it, and a
new pickle names the new paths. Installed by pipeline/__init__.py, after Python's own finders, so a real
module of that name always wins.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

# old module -> the modules its names live in now, looked up in this order
MOVED: dict[str, tuple[str, ...]] = {
    "pipeline.source": ("pipeline.read.source", "pipeline.read.files", "pipeline.read.schema", "pipeline.read.row_groups"),
    "pipeline.tables": ("pipeline.read.tables", "pipeline.read.snapshot", "pipeline.read.delta", "pipeline.read.iceberg"),
    "pipeline.quality": ("pipeline.read.quality",),
    "pipeline.increments": ("pipeline.read.increments",),
    "pipeline.columns": ("pipeline.fit.columns",),
    "pipeline.transforms": ("pipeline.fit.transforms",),
    "pipeline.stats": ("pipeline.fit.stats",),
    "pipeline.counts": ("pipeline.fit.counts",),
    # Parts and PartedVocabulary were in vocab.py before vocab_parts.py (plans pickled then name them here)
    "pipeline.vocab": ("pipeline.fit.vocab", "pipeline.fit.vocab_parts"),
    "pipeline.vocab_parts": ("pipeline.fit.vocab_parts",),
    "pipeline.fitted": ("pipeline.fit.fitted",),
    "pipeline.apply": ("pipeline.fit.apply",),
    "pipeline.fitted_io": ("pipeline.fit.fitted_io",),
    "pipeline.preprocess": ("pipeline.fit.preprocess",),
    "pipeline.history": ("pipeline.fit.history",),
    "pipeline.tasks": ("pipeline.cluster.tasks",),
    "pipeline.ray_side": ("pipeline.cluster.ray_side",),
    "pipeline.local_side": ("pipeline.cluster.local_side",),
    "pipeline.runtime": ("pipeline.cluster.runtime",),
    "pipeline.plan": ("pipeline.feed.plan",),
    "pipeline.sampler": ("pipeline.feed.sampler",),
    "pipeline.dataset": ("pipeline.feed.dataset",),
    "pipeline.loader": ("pipeline.feed.loader",),
    "pipeline.metrics": ("pipeline.feed.metrics",),
    "pipeline.grow": ("pipeline.feed.grow",),
    "pipeline.train": ("pipeline.job.driver", "pipeline.job.evaluate", "pipeline.job.loop", "pipeline.job.model"),
    "pipeline.bench_preprocess": ("pipeline.bench.preprocess",),
    "pipeline.bench_scale": ("pipeline.bench.scale",),
    "pipeline.bench_increments": ("pipeline.bench.increments",),
    "pipeline.bench_report": ("pipeline.bench.report",),
}


class _Moved(types.ModuleType):
    """An old module path: its names, found in the modules that hold them now (imported on first use)."""

    def __init__(self, name: str, homes: tuple[str, ...]):
        super().__init__(name, f"moved to {', '.join(homes)}")
        self.__homes = homes

    def __getattr__(self, name: str):
        if name == "__all__":  # `from <old path> import *`: every home's public names
            return sorted({n for h in self.__homes for n in _public(importlib.import_module(h))})
        if name.startswith("__"):
            raise AttributeError(name)
        for home in self.__homes:
            module = importlib.import_module(home)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module '{self.__name__}' (moved to {', '.join(self.__homes)}) has no attribute '{name}'")

    def __dir__(self):
        return sorted({n for h in self.__homes for n in dir(importlib.import_module(h))})


def _public(module) -> list[str]:
    return list(getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")])


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _Moved(spec.name, MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, _Loader())
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
