"""The embedded demo dataset: Parquet shards with numeric and categorical columns, nulls, and three
targets with learnable signal, so that a trained model beats its baseline by a clear margin:

- `label`: binary (int8 0/1), a known logistic model plus an interaction and per-category effects;
- `segment`: multiclass (4 strings), the arg-max of noisy linear scores;
- `spend`: regression (float64, about 1% null: such rows are dropped, never filled), a non-linear
  function of a few features and the plan, plus noise.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from . import storage
from .config import DEMO_CATEGORICAL, DEMO_NUMERIC

_CARDINALITY = {"city": 200, "device": 5, "plan": 4, "channel": 30}
_VERSION = "pipeline-demo/3"  # the marker holds it: a dataset from another version is written anew
SEGMENTS = ("bronze", "silver", "gold", "platinum")
_NULL_SHARE = 0.03  # in every other numeric column and in 'city' and 'channel'


def _shard(rows: int, seed: int, shard: int) -> pa.Table:
    rng = np.random.default_rng([seed, shard])
    x = rng.standard_normal((rows, len(DEMO_NUMERIC)))
    # Varied scales and offsets so that standardisation matters.
    scale = np.linspace(0.5, 50.0, len(DEMO_NUMERIC))
    offset = np.linspace(-10.0, 100.0, len(DEMO_NUMERIC))
    coef = np.array([1.2, -0.8, 0.6, 0.0, 0.9, -1.1, 0.3, 0.0, 0.5, -0.4, 0.0, 0.7])
    logit = x @ coef + 1.5 * x[:, 0] * x[:, 1] - 1.2

    cols: dict[str, pa.Array] = {}
    cat_rng = np.random.default_rng([seed, 10_000])  # per-category effects shared by all shards
    for name in DEMO_CATEGORICAL:
        k = _CARDINALITY[name]
        effect = cat_rng.normal(0.0, 0.8, size=k)
        p = 1.0 / np.arange(1, k + 1) ** 1.1  # Zipf-like: some rare values, a long tail
        ids = rng.choice(k, size=rows, p=p / p.sum())
        logit += effect[ids]
        values = np.array([f"{name}_{i:03d}" for i in range(k)], dtype=object)[ids]
        mask = rng.random(rows) < _NULL_SHARE if name in ("city", "channel") else None
        cols[name] = pa.array(values, type=pa.string(), mask=mask)

    for j, name in enumerate(DEMO_NUMERIC):
        mask = rng.random(rows) < _NULL_SHARE if j % 2 == 1 else None
        cols[name] = pa.array(x[:, j] * scale[j] + offset[j], type=pa.float64(), mask=mask)

    label = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
    cols["label"] = pa.array(label)
    # Drawn after everything above, so the older columns stay exactly as they were.
    w_seg = np.random.default_rng([seed, 20_000]).normal(0.0, 1.0, size=(len(DEMO_NUMERIC), len(SEGMENTS)))
    scores = x @ w_seg + rng.gumbel(0.0, 0.7, size=(rows, len(SEGMENTS)))
    cols["segment"] = pa.array(np.array(SEGMENTS, dtype=object)[scores.argmax(1)], type=pa.string())
    plan_ids = pa.compute.index_in(cols["plan"], value_set=pa.array([f"plan_{i:03d}" for i in range(4)])).to_numpy()
    spend = 50.0 + 12.0 * x[:, 0] - 6.0 * x[:, 2] + 8.0 * np.sin(2.0 * x[:, 3]) + 15.0 * plan_ids \
        + rng.normal(0.0, 5.0, rows)
    cols["spend"] = pa.array(spend, type=pa.float64(), mask=rng.random(rows) < 0.01)
    order = [*DEMO_NUMERIC, *DEMO_CATEGORICAL, "label", "segment", "spend"]
    return pa.table({k: cols[k] for k in order})


def generate(uri: str, rows: int, shards: int, seed: int = 0, overwrite: bool = False) -> list[str]:
    """Write the demo dataset to `uri` (any pyarrow filesystem) unless it is already complete there.

    Shards are written under a temporary name and renamed last, so an interrupted run never leaves
    a dataset that looks complete.
    """
    fs, root = storage.filesystem(uri)
    marker = f"{root}/_SUCCESS"
    stamp = f"{_VERSION} rows={rows} shards={shards} seed={seed}\n".encode()
    if not overwrite and storage.exists(fs, marker):
        with fs.open_input_stream(marker) as f:
            if f.read() == stamp:  # complete, and written by this generator with these settings
                return sorted(p for p in storage.list_files(fs, root) if p.endswith(".parquet"))
        for p in storage.list_files(fs, root):  # an older demo (or other settings): write it anew
            fs.delete_file(p)
    fs.create_dir(root, recursive=True)
    bounds = np.linspace(0, rows, shards + 1).astype(np.int64)
    paths = []
    for i in tqdm(range(shards), desc=f"generate {rows:,} rows", unit="shard"):
        table = _shard(int(bounds[i + 1] - bounds[i]), seed, i)
        final = f"{root}/part-{i:05d}.parquet"
        tmp = final + ".tmp"
        with fs.open_output_stream(tmp) as out:
            pq.write_table(table, out, row_group_size=65_536, compression="snappy", write_page_checksum=True)
        fs.move(tmp, final)
        paths.append(final)
    with fs.open_output_stream(marker) as out:
        out.write(stamp)
    return paths
