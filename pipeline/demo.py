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


# Click-through-rate data shaped like the Criteo Kaggle (Display Advertising Challenge) set: 13 integer
# count columns with nulls, negatives and heavy tails, 26 categorical columns of 8-hex-digit hashes with
# the set's cardinalities (as DLRM lists them), Zipf-like frequencies, and a binary label (about 25%
# positive) with signal in the counts and in the categories.
CRITEO_NUMERIC = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
CRITEO_CARDINALITY = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                      5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
_CRITEO_NULLS = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)  # per count column
_CRITEO_VERSION = "pipeline-criteo/1"
_HEX = np.array([f"{i:02x}".encode() for i in range(256)], dtype="S2").view(np.uint16)


def _hex8(ids: np.ndarray) -> pa.Array:
    """uint32 ids as 8-hex-digit strings, vectorised (Criteo's categories look like '68fd1e64')."""
    pairs = _HEX[ids.astype(">u4").view(np.uint8).reshape(-1, 4)]  # [n, 4] two-character codes
    return pa.array(np.ascontiguousarray(pairs).view("S8").ravel(), type=pa.binary(8)).cast(pa.string())


def _criteo_shard(rows: int, seed: int, shard: int) -> pa.Table:
    rng = np.random.default_rng([seed, shard, 7])
    cols: dict[str, pa.Array] = {}
    logit = np.full(rows, -1.6)
    for j, name in enumerate(CRITEO_NUMERIC):
        counts = np.floor(rng.pareto(0.9 + 0.1 * (j % 5), rows) * (1 + 3 * j)).astype(np.int64)
        if j == 1:
            counts -= rng.integers(0, 4, rows) * (rng.random(rows) < 0.1)  # I2 holds a few negatives, as in Criteo
        logit += (0.35 if j % 3 == 0 else -0.2) * np.log1p(np.maximum(counts, 0)) / 3
        cols[name] = pa.array(counts, mask=rng.random(rows) < _CRITEO_NULLS[j])
    for j, (name, k) in enumerate(zip(CRITEO_CATEGORICAL, CRITEO_CARDINALITY)):
        # log-uniform ranks: P(rank r) ~ 1/(r + 1) over [0, k): a few values in most rows, a long tail
        ranks = np.minimum(np.exp(rng.random(rows) * np.log(k + 1)).astype(np.int64) - 1, k - 1)
        if k <= 200_000 and j % 2 == 0:  # learnable per-category effects in half of the columns
            logit += (((ranks * 2654435761 + j) % 1009) / 1009.0 - 0.5) * 1.2
        ids = (ranks * 2654435761 + j * 40503) % 2**32  # scrambled, as hashed ids look
        values = _hex8(ids)
        nulls = rng.random(rows) < 0.02 * (j % 4)  # some columns have a few nulls
        cols[name] = pa.compute.if_else(pa.array(nulls), pa.scalar(None, pa.string()), values) if nulls.any() else values
    cols["label"] = pa.array((rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8))
    return pa.table({k: cols[k] for k in ("label", *CRITEO_NUMERIC, *CRITEO_CATEGORICAL)})


def generate_criteo(uri: str, rows: int, shards: int, seed: int = 0, overwrite: bool = False) -> list[str]:
    """Write the Criteo-shaped dataset to `uri` unless it is already complete there."""
    return generate(uri, rows, shards, seed, overwrite, shard=_criteo_shard, version=_CRITEO_VERSION)


def generate(uri: str, rows: int, shards: int, seed: int = 0, overwrite: bool = False, shard=_shard,
             version: str = _VERSION) -> list[str]:
    """Write the demo dataset to `uri` (any pyarrow filesystem) unless it is already complete there.

    Shards are written under a temporary name and renamed last, so an interrupted run never leaves
    a dataset that looks complete.
    """
    fs, root = storage.filesystem(uri)
    marker = f"{root}/_SUCCESS"
    stamp = f"{version} rows={rows} shards={shards} seed={seed}\n".encode()
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
        table = shard(int(bounds[i + 1] - bounds[i]), seed, i)
        final = f"{root}/part-{i:05d}.parquet"
        tmp = final + ".tmp"
        with fs.open_output_stream(tmp) as out:
            pq.write_table(table, out, row_group_size=65_536, compression="snappy", write_page_checksum=True)
        fs.move(tmp, final)
        paths.append(final)
    with fs.open_output_stream(marker) as out:
        out.write(stamp)
    return paths


# ---------------------------------------------------------------------------------------------
# The daily table: click-through-rate events, one Delta commit per day, with categories that drift

DAILY_NUMERIC = ("position", "price", "hour", "user_age_days")
DAILY_CATEGORICAL = ("user", "item", "site", "device")
_DAILY_VERSION = "pipeline-daily/1"
_FADE = 0.55  # share of a day's users (items: its square root) drawn from that day's cohort; older cohorts fade


def _effect(ids: np.ndarray, salt: int, scale: float) -> np.ndarray:
    """A value's lasting effect on the click rate, the same every day it appears (a warm-started model keeps
    what it learnt of it): a hash of its id, centred."""
    return (((ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(salt)) % np.uint64(1009)).astype(np.float64)
            / 1009.0 - 0.5) * scale


def _cohorts(rng: np.random.Generator, day: int, rows: int, fade: float) -> np.ndarray:
    """The day (1..day) each row's value was first seen: today's cohort with probability `fade`, yesterday's
    with fade*(1-fade), ...: new users and items every day, old ones fading."""
    back = np.minimum(rng.geometric(fade, rows) - 1, day - 1)
    return day - back


def _daily_rows(day: int, rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, day, 31])
    per_user, per_item = max(500, rows // 8), max(100, rows // 80)  # values a cohort brings
    cols: dict[str, pa.Array] = {}
    users_day = _cohorts(rng, day, rows, _FADE)
    users = users_day * per_user + np.minimum(rng.zipf(1.4, rows) - 1, per_user - 1)
    items_day = _cohorts(rng, day, rows, np.sqrt(_FADE))
    items = items_day * per_item + np.minimum(rng.zipf(1.3, rows) - 1, per_item - 1)
    sites = np.minimum(rng.zipf(1.5, rows) - 1, 49)
    devices = rng.choice(4, rows, p=[0.55, 0.3, 0.1, 0.05])
    position = rng.integers(1, 11, rows)
    price = np.round(rng.lognormal(3.0, 0.8, rows), 2)
    hour = rng.integers(0, 24, rows)
    logit = (-1.2 + _effect(users, 1, 2.4) + _effect(items, 2, 2.0) + _effect(sites, 3, 1.0)
             + np.array([0.2, 0.0, -0.3, 0.4])[devices] - 0.12 * position - 0.25 * np.log(price / 20.0)
             + 0.3 * np.sin(hour * np.pi / 12))
    cols["day"] = pa.array(np.full(rows, day, np.int32))
    cols["position"] = pa.array(position.astype(np.int32))
    cols["price"] = pa.array(price, mask=rng.random(rows) < 0.02)
    cols["hour"] = pa.array(hour.astype(np.int32))
    cols["user_age_days"] = pa.array((day - users_day).astype(np.int32))
    cols["user"] = pa.array(np.char.add("u", users.astype(str)).astype(object), pa.string())
    cols["item"] = pa.array(np.char.add("i", items.astype(str)).astype(object), pa.string())
    cols["site"] = pa.array(np.char.add("s", sites.astype(str)).astype(object), pa.string())
    cols["device"] = pa.array(np.array(["mobile", "desktop", "tablet", "tv"], dtype=object)[devices], pa.string())
    cols["clicked"] = pa.array((rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8))
    return pa.table(cols)


def generate_daily(uri: str, days: int, rows_per_day: int, seed: int = 0, overwrite: bool = False) -> list[int]:
    """A Delta table at `uri` with one commit per day (days 1..`days`), click-through-rate shaped (a `clicked`
    label from lasting user, item and site effects, position, price and hour) with categories that drift: every
    day brings new users and items, older ones fade. Days already in the table are kept (a table written with
    other settings is refused, or written anew with overwrite): each call appends the days it lacks, as a
    production table gains a day each morning. Returns the days appended."""
    from .errors import DataError

    try:
        from deltalake import DeltaTable, write_deltalake
    except ImportError:
        raise DataError("the daily table is a Delta Lake table; writing it needs the deltalake package: pip install "
                        "'parquet-ray-pipeline[delta]' (or pip install deltalake)") from None

    stamp = f"{_DAILY_VERSION} rows_per_day={rows_per_day} seed={seed}"
    fs, root = storage.filesystem(uri)
    have = 0
    if storage.exists(fs, f"{root}/_delta_log"):
        table = DeltaTable(uri)
        if (table.metadata().description or "") != stamp:
            if not overwrite:
                raise DataError(f"'{uri}' holds a Delta table written with other settings ({table.metadata().description!r}, "
                                f"this is {stamp!r}); pass --overwrite to write it anew, or point data.path elsewhere")
        else:
            have = table.version() + 1  # one commit per day, day 1 at version 0
    if overwrite and have == 0 and storage.exists(fs, root):
        fs.delete_dir_contents(root)
    added = []
    for day in tqdm(range(have + 1, days + 1), desc=f"generate {rows_per_day:,} rows a day", unit="day"):
        write_deltalake(uri, _daily_rows(day, rows_per_day, seed), mode="append", description=stamp, name="daily")
        added.append(day)
    return added
