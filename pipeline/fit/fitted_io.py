"""Saving and loading a fitted state: a small JSON (repr() of every float64, so a load gives
bit-identical arrays) and its vocabularies beside it (vocab_parts.py: a folder of parts; vocab.py: one Arrow
file). Every format version this package wrote still loads. `preprocess.FittedPreprocessor` has
these as methods (`save`, `load`, `to_dict`, `from_dict`, `state`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import storage
from . import vocab as vocab_file
from ..errors import DataError
from .fitted import FittedTarget
from .stats import categorical_ops, numeric_ops
from .transforms import CategoricalOp, NumericOp, user_function
from .vocab import Vocabulary
from .vocab_parts import Parts, PartedVocabulary, part_tag

FORMAT = "pipeline.FittedPreprocessor"
VERSION = 5  # 5: vocabularies in parts by hash range, a folder beside the JSON; 4: one Arrow IPC file (older: inline)


def to_dict(fp, vocab_file: str | None = None) -> dict[str, Any]:
    """The fitted state as JSON-able data. vocab_file: the name (beside the JSON) of the Arrow file that
    holds the vocabularies (see state); None lists them inline (small fits, tests)."""
    numeric = []
    for i, (c, d, op) in enumerate(zip(fp.numeric, fp.dims, numeric_ops(fp))):
        entry = {"name": c, "missing_indicator": c in fp.indicators}
        slots = fp.slots(i)
        one = (lambda xs: xs) if d else (lambda xs: xs[0])  # noqa: E731 - a list per slot for a vector
        if d:
            entry["dim"] = d
        entry.update(mean=one([f.shift for f in slots]), std=one([f.scale for f in slots]))
        if not op.is_default:
            entry.update(transform=_op_dict(op), fill=one([f.fill for f in slots]),
                         boundaries=one([list(f.boundaries) for f in slots]))
            if op.clip_quantiles:
                entry["clip"] = one([list(f.clip) for f in slots])
        numeric.append(entry)
    cats = []
    for c, v, op in zip(fp.categorical, fp.vocab, categorical_ops(fp)):
        entry = {"name": c, "unknown_id": 0, **({"vocab_size": len(v)} if vocab_file else {"vocab": list(v)})}
        if vocab_file and isinstance(v, PartedVocabulary):
            entry.update(vocab_parts=list(v.sizes), vocab_digest=v.digest)
        if op != CategoricalOp():
            entry["transform"] = _op_dict(op)
        cats.append(entry)
    return {
        "format": FORMAT, "version": VERSION, "numeric": numeric, "categorical": cats,
        "targets": [{"name": t.name, "kind": t.kind, "classes": list(t.classes), "mean": t.mean, "std": t.std,
                     "counts": list(t.counts)} for t in fp.targets],
        "weight": fp.weight, "stats": fp.stats, **({"function": fp.function} if fp.function else {}),
        **({"vocab_file": {"name": vocab_file, "digest": fp.vocab_digest}} if vocab_file else {}),
    }


def state(fp, uri: str) -> dict[str, Any]:
    """to_dict for a JSON saved at `uri`, the vocabularies written beside it, named by their digest
    (written once: a fit.json and a preprocessor.json in one folder share them): a fit's parts as a
    folder of part files (each written by a task where the part is, under Ray), vocabularies built
    otherwise as one Arrow IPC file."""
    if not any(len(v) for v in fp.vocab):
        return to_dict(fp)
    parted = [v for v in fp.vocab if isinstance(v, PartedVocabulary) and len(v)]
    if parted and len({id(v.parts) for v in parted}) == 1 and all(
            isinstance(v, PartedVocabulary) or not len(v) for v in fp.vocab):
        name = f"vocab-{fp.vocab_digest}"
        folder = _beside(uri, name)
        last = storage.join(folder, f"part-{parted[0].partitions - 1:05d}")
        if part_tag(last) != fp.vocab_digest:
            parted[0].parts.write(folder, [v.name for v in parted], fp.vocab_digest)
        return to_dict(fp, vocab_file=name)
    whole = tuple(v.whole() if isinstance(v, PartedVocabulary) else v for v in fp.vocab)
    name = vocab_file.file_name(fp.vocab_digest)
    fs, path = storage.filesystem(_beside(uri, name))
    if not storage.exists(fs, path):
        vocab_file.write(_beside(uri, name), whole, fp.categorical, fp.vocab_digest)
    return to_dict(fp, vocab_file=name)


def from_dict(cls, d: dict[str, Any], uri: str | None = None):
    """The inverse of to_dict / state; uri: where the JSON was read from (its vocabulary file is
    beside it)."""
    if d.get("format") != FORMAT or not isinstance(d.get("version"), int):
        raise ValueError(f"not a fitted preprocessor (format {d.get('format')!r}); expected {FORMAT!r}")
    if d["version"] > VERSION:
        raise ValueError(f"fitted preprocessor version {d['version']} is newer than this code reads "
                         f"({VERSION}); upgrade the pipeline package")
    num = d["numeric"]
    flat = lambda key: tuple(float(x) for e in num for x in (e[key] if isinstance(e[key], list) else [e[key]]))  # noqa: E731
    if d["version"] == 1:  # one binary label
        targets = (FittedTarget(d["label"], "binary", classes=("0", "1")),)
    else:
        targets = tuple(FittedTarget(t["name"], t["kind"], tuple(t["classes"]), float(t["mean"]), float(t["std"]),
                                     tuple(t.get("counts", ()))) for t in d["targets"])
    ops = tuple(_op_of(NumericOp, e.get("transform")) for e in num)
    default = all(op.is_default for op in ops)
    slots = lambda e, key, empty: (e.get(key, empty) if e.get("dim") else [e.get(key, empty)])  # noqa: E731
    cat_ops = tuple(_op_of(CategoricalOp, e.get("transform")) for e in d["categorical"])
    return cls(
        numeric=tuple(e["name"] for e in num), dims=tuple(int(e.get("dim", 0)) for e in num),
        mean=flat("mean"), std=flat("std"),
        indicators=tuple(e["name"] for e in num if e["missing_indicator"]),
        categorical=tuple(e["name"] for e in d["categorical"]),
        vocab=_vocabularies(d, uri), targets=targets, weight=d.get("weight"),
        stats=d.get("stats", {}),
        numeric_ops=() if default else ops,
        fills=() if default else tuple(float(x) for e in num for x in slots(e, "fill", 0.0)),
        boundaries=() if default else tuple(tuple(float(b) for b in x) for e in num for x in slots(e, "boundaries", [])),
        clips=tuple(tuple(float(b) for b in x) for e in num for x in slots(e, "clip", []))
        if any("clip" in e for e in num) else (),
        categorical_ops=() if all(op == CategoricalOp() for op in cat_ops) else cat_ops,
        function=_importable(d.get("function", "")),
    )


def save(fp, uri: str) -> None:
    # repr() of a float64 round-trips exactly through JSON, so load() gives bit-identical arrays.
    storage.write_json(uri, state(fp, uri))


def load(cls, uri: str):
    return cls.from_dict(storage.read_json(uri), uri)


def _beside(uri: str, name: str) -> str:
    return uri.rsplit("/", 1)[0] + "/" + name if "/" in uri else name


def _vocabularies(d: dict[str, Any], uri: str | None) -> tuple:
    cats = d["categorical"]
    if "vocab_file" not in d:
        return tuple(Vocabulary(e["vocab"]) for e in cats)
    ref = d["vocab_file"]
    if uri is None:
        raise ValueError(f"this fitted state keeps its vocabularies in {ref['name']!r} beside its JSON: load it with "
                         f"FittedPreprocessor.load(path) (or from_dict(d, path)) so the file can be found")
    if not any("vocab_parts" in e for e in cats):
        return vocab_file.read(_beside(uri, ref["name"]), [int(e["vocab_size"]) for e in cats], ref["digest"], uri)
    folder = _beside(uri, ref["name"])
    n = max(len(e.get("vocab_parts", ())) for e in cats)
    paths = [storage.join(folder, f"part-{q:05d}") for q in range(n)]
    if part_tag(paths[-1]) != ref["digest"]:
        raise DataError(f"'{uri}' keeps its vocabularies in the folder '{folder}', whose parts are missing or belong "
                        f"to another fit (digest {part_tag(paths[-1])!r}, expected {ref['digest']!r}): the ids "
                        f"would be wrong. Copy the folder saved with that JSON beside it, or fit again")
    parts = Parts(paths)
    return tuple(PartedVocabulary(e["name"], parts, e["vocab_parts"], e["vocab_digest"]) if "vocab_parts" in e
                 else Vocabulary() for e in cats)


def _importable(function: str) -> str:
    """A saved preprocessor that runs the user's function is refused where it cannot be imported (one
    paragraph, at load), never at the first request."""
    if function:
        user_function(function)
    return function


def _op_dict(op) -> dict[str, Any]:
    """A transform op as JSON (infinite clip bounds as null, tuples as lists)."""
    out = {}
    for k, v in op.__dict__.items():
        if isinstance(v, float) and not np.isfinite(v):
            v = None
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _op_of(kind, d: dict[str, Any] | None):
    if not d:
        return kind()
    d = dict(d)
    for k in ("clip_min", "clip_max"):
        if k in d and d[k] is None:
            d[k] = -np.inf if k == "clip_min" else np.inf
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def on_files(fp, uri: str):
    """The fitted state with its vocabulary parts written beside `uri` (as `state` writes them) and read
    from there: pickled, it names the files instead of carrying the values, and every process that
    loads it maps the same pages (the processes of a torchrun node, IngestPlan.load)."""
    d = state(fp, uri)
    if not any("vocab_parts" in e for e in d["categorical"]):
        return fp.unshared()
    return replace(fp, vocab=_vocabularies(d, uri))
