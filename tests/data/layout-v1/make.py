"""The saved-layout fixtures: a pickled plan and saved fitted states as users hold them, written by the code
at commit f5db656 (the flat `pipeline/` layout) before the stage-folder move (pipeline/read, pipeline/fit,
pipeline/cluster, pipeline/feed, pipeline/bench); do not regenerate after the move. tests/test_saved_layout.py
loads them with the current code: plans and fitted states saved before the move must still load, and transform
the same rows into the same arrays.

Run from the repository root, once, with the code of that commit (no Ray: the fit runs in this process):

    python tests/data/layout-v1/make.py

What it writes beside itself:

- data/: the demo dataset (pipeline.demo.generate), 3,000 rows in 2 shards, seed 0;
- plan.pkl: `pipeline.prepare(...)` with world_size=2 saved by `IngestPlan.save`, and what the pickle names
  beside it: vocab-<digest>/ (the vocabularies' part files) and counts-<digest>/ (the category counts);
- fitted/preprocessor.json: `plan.fitted.save(...)`, with its vocabulary folder and counts folder beside it;
- fitted/fit.json: `plan.save_fit(...)` (shares the vocabulary and counts folders with preprocessor.json);
- expected.npz: `plan.fitted.transform(FRAME)`'s arrays (x_num, x_cat, y; w is None: no weight column);
- expected.json: the plan's row counts and shares' sizes (and those of `plan.for_world(3)`), each categorical
  column's vocabulary in id order (these are small), the column names, every class the pickle names
  (module.qualname: the module paths that must keep resolving after the move), and the folder plan.pkl was saved from (`IngestPlan.save` makes its
  path absolute, so the pickle names the vocabulary and counts files, and the data, by absolute path: the test
  points them at wherever the fixtures are when it runs).

FRAME (below) is also what the test transforms: a handful of rows with a category value the fit never saw,
nulls in numeric and categorical columns, and the targets.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
ROWS, SHARDS, SEED, WORLD = 3_000, 2, 0, 2
NUMERIC = ("num_00", "num_01", "num_02", "num_03")
CATEGORICAL = ("city", "device", "plan", "channel")
LABEL = ("label", "segment")  # a binary and a multiclass target
# 'channel' is hashed into 16 buckets (no vocabulary); 'city' keeps its 20 most frequent values and hashes the rest
# into 8 extra ids; 'device' and 'plan' keep plain vocabularies.
COLUMNS = {"channel": {"encode": "hash", "buckets": 16}, "city": {"encode": "vocab+hash", "buckets": 8, "max_size": 20}}


def frame() -> pd.DataFrame:
    """The rows the test transforms (kept here so the test and this script use the same ones)."""
    return pd.DataFrame({
        "num_00": [0.5, -3.25, None, 12.0, 0.0, 7.75],
        "num_01": [1.0, None, -2.5, 40.0, 3.5, -0.125],
        "num_02": [10.0, 20.0, 30.0, None, -5.0, 0.25],
        "num_03": [-1.0, 0.0, 1.0, 2.0, None, 100.0],
        "city": ["city_000", "city_001", "city_never_seen", None, "city_150", "city_005"],
        "device": ["device_000", "device_004", "device_002", "device_never_seen", None, "device_001"],
        "plan": ["plan_003", None, "plan_000", "plan_001", "plan_002", "plan_never_seen"],
        "channel": ["channel_000", "channel_029", None, "channel_never_seen", "channel_007", "channel_012"],
        "label": pd.array([0, 1, 1, 0, 1, 0], dtype="int8"),
        "segment": ["bronze", "silver", "gold", "platinum", "gold", "bronze"],
    })


def pickled_classes(data: bytes) -> list[str]:
    """Every module.qualname a pickle's GLOBAL / STACK_GLOBAL opcodes name, as the unpickler asks for them."""
    import io
    import pickle

    seen: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return sorted(seen)


def main() -> None:
    import pipeline
    from pipeline import demo

    assert "ray" not in sys.modules, "the fixtures are fitted in this process, without Ray"
    for name in ("data", "fitted"):
        shutil.rmtree(HERE / name, ignore_errors=True)
    for p in HERE.iterdir():
        if p.name.startswith(("vocab-", "counts-")) and p.is_dir():
            shutil.rmtree(p)
        elif p.name in ("plan.pkl", "expected.npz", "expected.json"):
            p.unlink()

    demo.generate(str(HERE / "data"), ROWS, SHARDS, seed=SEED)
    plan = pipeline.prepare(str(HERE / "data"), world_size=WORLD, use_ray=False, label=list(LABEL),
                            numeric=list(NUMERIC), categorical=list(CATEGORICAL), columns=COLUMNS)
    assert plan.timings["fit_on"] == "this process", plan.timings
    plan.save(str(HERE / "plan.pkl"))
    (HERE / "fitted").mkdir()
    plan.fitted.save(str(HERE / "fitted" / "preprocessor.json"))
    plan.save_fit(str(HERE / "fitted" / "fit.json"))

    out = plan.fitted.transform(frame())
    assert out.w is None
    np.savez(HERE / "expected.npz", x_num=out.x_num, x_cat=out.x_cat, y=out.y)
    expected = {
        "commit": os.environ.get("LAYOUT_COMMIT", ""),
        "saved_from": str(HERE),
        "world_size": plan.world_size,
        "num_rows": plan.source.num_rows,
        "train_rows": plan.train_rows,
        "train_sizes": plan.train_sizes,
        "val_sizes": plan.val_sizes,
        "world3_train_sizes": plan.for_world(3).train_sizes,
        "world3_val_sizes": plan.for_world(3).val_sizes,
        "numeric": list(plan.fitted.numeric),
        "categorical": list(plan.fitted.categorical),
        "targets": [[t.name, t.kind, list(t.classes)] for t in plan.fitted.targets],
        "num_features": plan.fitted.num_features,
        "vocab": {c: list(v) for c, v in zip(plan.fitted.categorical, plan.fitted.vocab)},
        "pickled_classes": pickled_classes((HERE / "plan.pkl").read_bytes()),
    }
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    print(f"wrote {HERE} ({size:,} bytes): {plan.describe()[1]}")


if __name__ == "__main__":
    main()
