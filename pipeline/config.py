"""Typed, validated configuration: one TOML file for everything, any key overridable by a flag.

Validation happens here, when the config is built, never deep inside a Ray worker: unknown keys,
wrong types, out-of-range values, a column listed twice and a missing label are all reported at load
time, as one paragraph naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

DEMO_NUMERIC = tuple(f"num_{i:02d}" for i in range(12))
DEMO_CATEGORICAL = ("city", "device", "plan", "channel")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TargetKind = Literal["auto", "binary", "multiclass", "regression"]


class DataSection(_Section):
    path: str = Field("data/demo", description="directory or URI (s3://, gs://) holding the Parquet shards, or the "
                                                "root of a Delta Lake or Iceberg table (read as of one version)")
    version: str = Field("", description="a table's version to read: a Delta version number or Iceberg snapshot id, "
                                         "or an ISO timestamp (the version current then); \"\" the latest. The version "
                                         "read is printed and saved in fit.json, and every rank reads it")
    catalog: str = Field("", description="a pyiceberg catalog name (its settings from ~/.pyiceberg.yaml or "
                                         "PYICEBERG_CATALOG__<NAME>__* variables); data.path is then the table's "
                                         "identifier (namespace.table)")
    label: str | tuple[str, ...] = Field(
        "label", description="target column, a list of target columns, or \"\" / [] for none (unlabelled data)")
    target_kind: TargetKind | dict[str, TargetKind] = Field(
        "auto", description="binary | multiclass | regression, or auto: float -> regression, bool or 0/1 "
                            "integers -> binary, other integers and strings -> multiclass (a table sets it per target)")
    weight: str = Field("", description="optional per-row weight column (a non-negative number)")
    numeric: tuple[str, ...] = Field((), description="numeric feature columns (numbers, or fixed-length lists of "
                                                     "numbers such as embeddings); with categorical empty too: inferred")
    categorical: tuple[str, ...] = Field((), description="categorical feature columns (strings, integers, bools)")
    passthrough: tuple[str, ...] = Field((), description="columns carried unchanged beside each row (ids, timestamps, "
                                                         "text), never features: RankData.train.extra[name]")
    exclude: tuple[str, ...] = Field((), description="columns never inferred as features (ids, other targets)")
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="share of rows held out for validation")
    val_seed: int = Field(0, description="seed of the hold-out: a row is held out by a hash of its row id and this")

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("label", mode="before")
    @classmethod
    def _label_list(cls, v):
        return tuple(v) if isinstance(v, list) else v

    @property
    def targets(self) -> tuple[str, ...]:
        """The target columns, in order (empty: unlabelled data)."""
        if isinstance(self.label, str):
            return (self.label,) if self.label else ()
        return tuple(self.label)

    def kind_of(self, target: str) -> str:
        return self.target_kind.get(target, "auto") if isinstance(self.target_kind, dict) else self.target_kind


class QualitySection(_Section):
    on_bad_file: Literal["fail", "quarantine"] = Field(
        "fail", description="a shard (or row group) that cannot be read or has the wrong schema: stop, or set it aside")
    on_bad_value: Literal["fail", "drop_row", "fill"] = Field(
        "fill", description="null/NaN/inf feature, null or out-of-range label: stop, drop the row, or fill "
                            "(features: fitted mean / unknown id; a bad label always drops its row)")
    label_values: tuple[float, ...] = Field((), description="allowed target values (empty: any value the target "
                                                            "kind allows)")


class GenerateSection(_Section):
    dataset: Literal["demo", "criteo"] = Field("demo", description="demo: the embedded demo dataset; criteo: "
                                               "click-through-rate data shaped like Criteo Kaggle (13 counts, 26 "
                                               "hashed categoricals with its cardinalities, a binary label)")
    rows: int = Field(2_000_000, ge=1, description="rows in the demo dataset (with days: rows per day)")
    shards: int = Field(16, ge=1, description="Parquet files the demo dataset is split into")
    seed: int = 0
    days: int = Field(0, ge=0, description="N > 0: the daily table instead, a Delta table at data.path with one commit "
                                           "per day 1..N (click-through-rate events whose users and items drift; "
                                           "the days it already holds are kept, so each call appends the missing "
                                           "ones, as a production table gains a day each morning)")


class ColumnTransform(_Section):
    """How one column (or a group: `columns = [...]`) is transformed; unset keys inherit the role's
    default (preprocess.numeric_transform / categorical_transform), then the built-in defaults."""

    columns: tuple[str, ...] = Field((), description="the group's columns (empty: the section's own name is the column)")
    clip: tuple[float, float] | None = Field(None, description="numeric: [low, high] bounds applied first (inf allowed)")
    clip_quantiles: tuple[float, float] | None = Field(
        None, description="numeric: [low, high] quantiles (0 to 1), fitted in the same pass, as the clip bounds")
    log1p: bool | None = Field(None, description="numeric: log(1 + x) after clipping, values below 0 clipped to 0 first")
    scale: Literal["standardize", "minmax", "bucketize", "none"] | None = Field(
        None, description="numeric: the fitted scaler (default standardize)")
    boundaries: tuple[float, ...] | None = Field(None, description="numeric, bucketize: given boundaries (empty: "
                                                                  "`buckets` quantile buckets fitted in the same pass)")
    buckets: int | None = Field(None, ge=1, description="bucketize: quantile buckets; hash / vocab+hash: hash buckets")
    fill: Literal["mean", "median", "zero", "constant"] | None = Field(
        None, description="numeric: what a missing value becomes before scaling (default mean)")
    fill_value: float | None = Field(None, description="numeric, fill = constant: the value")
    encode: Literal["vocab", "hash", "vocab+hash"] | None = Field(
        None, description="categorical: vocab (default), hash into `buckets`, or vocab+hash (values outside the "
                          "vocabulary hashed into `buckets` extra ids)")
    max_size: int | None = Field(None, ge=1, description="categorical: this column's vocab_max_size")
    min_count: int | None = Field(None, ge=1, description="categorical: this column's vocab_min_count")


class CrossTransform(_Section):
    columns: tuple[str, ...] = Field(..., min_length=2, description="two or more columns, crossed")
    buckets: int = Field(..., ge=1, description="hash buckets of the cross")


class PreprocessSection(_Section):
    vocab_max_size: int = Field(1000, ge=1, description="most frequent values kept per categorical column")
    vocab_min_count: int = Field(1, ge=1, description="values seen fewer times map to the unknown id")
    vocab_partitions: int | Literal["auto"] = Field(
        "auto", description="hash ranges the category counts are split into: on Ray one reducer task each, so no "
                            "process holds every distinct value; \"auto\" is one per 4M rows (1 to 64). It lays "
                            "out the vocabularies in parts; the ids are the same whatever it is")
    missing_indicator: bool = Field(True, description="add a 0/1 column per numeric feature that had nulls")
    refit_numeric: bool = Field(False, description="prepare(since=...): merge the increment into the numeric "
                                                   "statistics (false: keep the previous fit's scaling, as a warm-started "
                                                   "model saw it)")
    standardize_target: bool = Field(True, description="regression targets: train on (y - mean) / std; "
                                                        "FittedPreprocessor.inverse_target undoes it")
    function: str = Field("", description="your own vectorised function, 'package.module:function', pyarrow Table -> "
                                          "Table (adding or replacing columns), run on every batch before the "
                                          "statistics and at serving time (recorded in the fitted state)")
    numeric_transform: ColumnTransform = Field(ColumnTransform(), description="the default for every numeric column")
    categorical_transform: ColumnTransform = Field(ColumnTransform(), description="the default for every categorical "
                                                                                  "column")
    columns: dict[str, ColumnTransform] = Field({}, description="a section per column ([preprocess.columns.NAME]) or "
                                                                "per group of columns (with columns = [...])")
    crosses: tuple[CrossTransform, ...] = Field((), description="hashed crosses of two or more columns, each a "
                                                                "categorical feature named a*b")


class TrainSection(_Section):
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(1024, ge=1)
    lr: float = Field(2e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    hidden: tuple[int, ...] = Field((256, 128), description="hidden layer widths of the MLP")
    embedding_dim: int = Field(8, ge=1)
    sparse_embeddings: Literal["auto", "true", "false"] = Field(
        "auto", description="sparse embedding gradients (SparseAdam for the table, AdamW for the rest): auto uses them "
                            "for tables of 100,000+ rows when training on CPUs (gloo); NCCL cannot all-reduce sparse "
                            "gradients, so GPU training keeps them dense")
    sparse_optimizer: Literal["adam", "sgd"] = Field(
        "adam", description="what updates a sparse embedding table: adam (SparseAdam at lr, adaptive per row) or sgd "
                            "(at embedding_lr, DLRM's recipe: faster steps, slower to learn rare values)")
    embedding_lr: float = Field(0.1, gt=0.0, description="learning rate of the SGD that updates a sparse embedding "
                                                         "table (sparse_optimizer = sgd)")
    num_workers: int | tuple[int, int] = Field(
        2, description="Ray Train workers (one per GPU when GPUs are used), or [min, max] for elastic training "
                       "(Ray 2.60+: the run goes on with fewer workers when nodes are lost and grows again at its "
                       "next restart; every row still once per epoch)")
    elastic_resize_s: float = Field(60.0, gt=0.0, description="elastic training (num_workers = [min, max]): how often "
                                                              "Ray Train considers growing a healthy run onto capacity that "
                                                              "came back (ScalingConfig.elastic_resize_monitor_interval_s)")
    use_gpu: Literal["auto", "true", "false"] = "auto"
    seed: int = 0
    drop_last: bool = Field(True, description="drop each epoch's last partial batch (the remainder is reported)")
    shuffle: Literal["local", "global", "none"] = Field(
        "local", description="local: new permutation within each rank's rows every epoch (free); global: rows "
                             "re-dealt across ranks every epoch (each rank holds all rows: world_size x memory)")
    checkpoint_every_steps: int = Field(0, ge=0, description="also checkpoint mid-epoch every N steps (0: epoch ends only)")
    trace_batches: bool = Field(False, description="write each rank's per-step row-id digests to <run>/trace-rank<r>.txt")
    max_failures: int = Field(0, ge=0, description="Ray Train restarts from the last checkpoint on worker loss")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="where Ray puts the training workers: PACK fills few nodes, SPREAD uses different "
                            "nodes where it can (STRICT_*: or fail to start)")

    @field_validator("use_gpu", "sparse_embeddings", mode="before")
    @classmethod
    def _bool_is_fine(cls, v):
        return str(v).lower() if isinstance(v, bool) else v  # use_gpu = true in TOML or --train.use_gpu true

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers_list(cls, v):
        return tuple(v) if isinstance(v, list) else v  # num_workers = [1, 4] (TOML, or --train.num_workers [1,4])

    @model_validator(mode="after")
    def _hidden_positive(self) -> "TrainSection":
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise ValueError(f"train.hidden must be a non-empty list of positive widths, got {list(self.hidden)}")
        lo, hi = self.workers_range
        if not 1 <= lo <= hi:
            raise ValueError(f"train.num_workers must be a positive number, or [min, max] with 1 <= min <= max; got "
                             f"{self.num_workers!r}")
        return self

    @property
    def workers_range(self) -> tuple[int, int]:
        """(min, max) training workers: equal unless elastic."""
        w = self.num_workers
        return (w, w) if isinstance(w, int) else (int(w[0]), int(w[1]))

    @property
    def workers(self) -> int:
        """The most training workers: what the plan is made for (rank_data re-plans for fewer)."""
        return self.workers_range[1]


CHUNK_MIB = 4.0  # rows gathered per index_select: large enough to amortise the call, small in memory


class LoaderSection(_Section):
    placement: Literal["auto", "host", "device"] = Field(
        "auto", description="device: keep the shard on the GPU; host: pinned host memory; auto: device if it fits"
    )
    prefetch: int = Field(2, ge=1, description="chunks of batches copied to the GPU ahead of use")
    chunk_mib: float = Field(CHUNK_MIB, gt=0.0, description="MiB of rows (whole consecutive batches) fetched per gather; "
                             "one large gather is up to 2x faster than one per batch, and costs about twice this "
                             "much memory")
    device_memory_fraction: float = Field(0.5, gt=0.0, le=1.0, description="share of free GPU memory placement=auto may use")
    spill: Literal["auto", "never", "always"] = Field(
        "auto", description="keep a rank's rows in a memory-mapped file on local disk instead of RAM: always, never, "
                            "or auto (when the rows need more than half of the node's available memory)")
    spill_dir: str = Field("", description="local directory for spilled rows (default: the system temp dir)")
    read_share: Literal["worker", "ray_data"] = Field(
        "worker", description="under Ray Train, who reads and transforms a rank's share: worker (its own training "
                              "process, with threads: no Ray task, nothing crosses the network; about 2x faster "
                              "measured) or ray_data (Ray Data tasks on the rank's node, through the DataConfig)")


class RunSection(_Section):
    output: str = Field("runs", description="directory or URI for checkpoints, fitted preprocessor and metrics")
    name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="run folder is <output>/<name>-<timestamp>")
    resume: bool = Field(False, description="use <output>/<name> exactly and continue from its last checkpoint")
    since: str = Field("", description="a previous run's folder or URI: train on the rows the table gained since that "
                                       "run's version only, its fit extended (known ids kept), warm-started from its final "
                                       "model and optimizer (docs/continuous.md)")
    ray_address: str = Field("", description="'' starts a local Ray; 'auto' or ray://host:port joins a cluster")
    num_cpus: int = Field(0, ge=0, description="CPUs of the local Ray (0: max(cores, workers + 2))")
    dashboard: bool = Field(False, description="start Ray's dashboard (http://127.0.0.1:8265, its State API, job and "
                                               "metrics pages) with the private local Ray; off by default: it costs about "
                                               "1 s of start-up on 2 cores, and that Ray ends with the command anyway")
    fit_on: Literal["auto", "ray", "local"] = Field(
        "auto", description="where the fit pass runs: ray (one task per file, across the cluster), local (threads in "
                            "the driver), auto (ray on a cluster of several nodes, local on one)")
    fit_from: str = Field("", description="a fit.json saved by an earlier fit or train run: skip the fit pass when the "
                                          "data and the data/quality/preprocess settings are unchanged (refused otherwise)")
    start_workers: Literal["auto", "beside_fit", "after_fit"] = Field(
        "auto", description="when `train` starts Ray Train's workers: beside_fit (while the driver validates and fits; "
                            "they take the plan once it exists; needs loader.read_share = worker), after_fit, or auto "
                            "(beside_fit where the driver's machine has more cores than train.num_workers + 1: with "
                            "fewer, the fit threads and the workers' start-up only slow each other down)")
    stall_timeout_s: float = Field(300.0, gt=0.0, description="a stage that makes no progress this long (no row group "
                                   "fitted, no block of a rank's share received) ends the job, saying what it waited for")


class Config(_Section):
    data: DataSection = DataSection()
    quality: QualitySection = QualitySection()
    generate: GenerateSection = GenerateSection()
    preprocess: PreprocessSection = PreprocessSection()
    train: TrainSection = TrainSection()
    loader: LoaderSection = LoaderSection()
    run: RunSection = RunSection()

    @model_validator(mode="after")
    def _columns(self) -> "Config":
        d = self.data
        targets = d.targets
        if len(set(targets)) != len(targets):
            raise ValueError(f"data.label lists a column twice ({list(targets)}); list each target once")
        if isinstance(d.target_kind, dict):
            stray = sorted(set(d.target_kind) - set(targets))
            if stray:
                raise ValueError(f"data.target_kind names {stray}, which are not targets (data.label = "
                                 f"{list(targets)}); name only target columns")
        roles = {t: "data.label" for t in targets}
        if d.weight:
            if d.weight in roles:
                raise ValueError(f"column '{d.weight}' is data.weight and also a target; use another column")
            roles[d.weight] = "data.weight"
        for kind in ("numeric", "categorical"):
            for col in getattr(d, kind):
                if roles.get(col, "").startswith(("data.numeric", "data.categorical")):
                    where = roles[col] + ("" if roles[col] == f"data.{kind}" else f" and data.{kind}")
                    raise ValueError(f"column '{col}' is listed twice in {where}; list each column once")
                if col in roles:
                    raise ValueError(f"column '{col}' is {roles[col]} and also listed in data.{kind}; a target or "
                                     f"weight is never a feature: remove it from data.{kind}")
                roles[col] = f"data.{kind}"
        for col in d.passthrough:  # may also be a feature or target: it is then carried as it was written
            roles.setdefault(col, "data.passthrough")
        if self.run.start_workers == "beside_fit" and self.loader.read_share != "worker":
            raise ValueError("run.start_workers = 'beside_fit' needs loader.read_share = 'worker' (with 'ray_data' the "
                             "plan's DataConfig is part of the trainer, so the plan must come first); set one of them")
        return self

    @property
    def feature_columns(self) -> list[str]:
        return [*self.data.numeric, *self.data.categorical]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def keys() -> dict[str, Any]:
    """Every settable key as 'section.field' -> its pydantic FieldInfo."""
    out = {}
    for section, sfield in Config.model_fields.items():
        for name, finfo in sfield.annotation.model_fields.items():
            out[f"{section}.{name}"] = finfo
    return out


def parse_flag_value(text: str) -> Any:
    """A flag's value is read as a TOML value (3, 0.1, true, [256, 128], "x"); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the config from an optional TOML file and 'section.key' overrides (flags win)."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist; pass --config with the path of a TOML file (see configs/demo.toml)")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}' is not valid TOML: {e}; fix the syntax at that line") from None
    known = keys()
    for section, body in raw.items():
        if not isinstance(body, dict):
            raise ConfigError(_unknown(section, set(Config.model_fields), source, what="section")
                              if section not in Config.model_fields else
                              f"'{section}' in {source} must be a [{section}] table, got {body!r}")
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ConfigError(_unknown(key, set(known), "flags"))
        section, name = key.split(".", 1)
        raw.setdefault(section, {})[name] = value
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, source, known, set(overrides or ()))) from None


def _unknown(key: str, known: set[str], source: str, what: str = "key") -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known {what}s: {', '.join(sorted(known))}"
    return f"unknown config {what} '{key}' in {source}; {hint} Remove or rename it."


def _explain(e: ValidationError, source: str, known: dict[str, Any], from_flags: set[str]) -> str:
    problems = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        if err["type"] == "extra_forbidden":
            problems.append(_unknown(loc, set(known) if "." in loc else set(Config.model_fields), source,
                                     what="key" if "." in loc else "section"))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if loc and err["type"] != "value_error":
            desc = getattr(known.get(loc), "description", None)
            got = err.get("input")
            where = f"flag --{loc}" if loc in from_flags else source
            problems.append(f"config key '{loc}' in {where} is {got!r}: {msg}"
                            + (f" ({loc}: {desc})" if desc else "") + "; set a valid value")
        else:
            problems.append(f"{msg} (in {source})")
    return " ".join(problems)
