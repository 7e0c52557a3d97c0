"""s3:// end to end against an S3-compatible store (moto's server on loopback), configured only
through the standard AWS_* variables, AWS_ENDPOINT_URL included: shards written to and read from the
bucket, and the whole training job with its artifacts (Ray Train checkpoints, preprocessor.json,
metrics.json) written to s3://.

The job runs as `python -m pipeline train` in a subprocess: it starts its own local Ray, whose
workers inherit the variables exactly as on a node configured for S3, and it never shares the test
session's Ray.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUCKET = "pipeline-test"
ROWS, SHARDS = 20_000, 4

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server on loopback and the AWS_* variables pointing at it (restored afterwards)."""
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    cleared = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_S3_ADDRESSING_STYLE")
    saved = {k: os.environ.get(k) for k in (*env, *cleared)}
    for k in cleared:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)  # boto3 honours AWS_ENDPOINT_URL too
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _keys(prefix: str) -> dict[str, int]:
    import boto3

    out = {}
    for page in boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def _get(key: str) -> bytes:
    import boto3

    return boto3.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read()


@pytest.fixture(scope="module")
def s3_demo(s3_env) -> str:
    from pipeline import demo

    uri = f"s3://{BUCKET}/demo"
    paths = demo.generate(uri, rows=ROWS, shards=SHARDS, seed=0)
    assert paths == [f"{BUCKET}/demo/part-{i:05d}.parquet" for i in range(SHARDS)]
    return uri


def test_storage_uses_the_endpoint_from_the_environment(s3_env):
    import pyarrow.fs as pafs

    from pipeline import storage

    fs, path = storage.filesystem(f"s3://{BUCKET}/probe/x.json/")
    assert isinstance(fs, pafs.S3FileSystem) and path == f"{BUCKET}/probe/x.json"
    storage.write_json(f"s3://{BUCKET}/probe/x.json", {"a": 1})
    assert json.loads(_get("probe/x.json")) == {"a": 1}
    assert storage.read_json(f"s3://{BUCKET}/probe/x.json") == {"a": 1}
    assert storage.to_uri(fs, path) == f"s3://{BUCKET}/probe/x.json"
    # Ray Train gets the bucket-relative path and the very same filesystem.
    storage_path, storage_fs = storage.ray_storage(f"s3://{BUCKET}/runs")
    assert storage_path == f"{BUCKET}/runs" and isinstance(storage_fs, pafs.S3FileSystem)
    assert storage.ray_storage("runs") == (os.path.abspath("runs"), None)

    # AWS_ENDPOINT_URL_S3 (service-specific) wins over AWS_ENDPOINT_URL, as in the AWS SDKs.
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    os.environ.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ENDPOINT_URL_S3=endpoint)  # port 9: nothing there
    try:
        assert storage.read_json(f"s3://{BUCKET}/probe/x.json") == {"a": 1}
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        del os.environ["AWS_ENDPOINT_URL_S3"]


def test_source_reads_footers_and_fragments_from_s3(s3_demo):
    """Shard paths come back from the filesystem as bucket/key and are opened as such."""
    from pipeline import config
    from pipeline.read import row_groups, source

    cfg = config.load(None, {"data.path": s3_demo})
    src = source.inspect(cfg)
    assert src.num_rows == ROWS
    assert [s.path for s in src.shards] == [f"{BUCKET}/demo/part-{i:05d}.parquet" for i in range(SHARDS)]
    frag = src.fragments[0]
    table = row_groups.read_fragment(s3_demo, frag, ["num_00", "city", "label"])
    assert table.num_rows == frag.num_rows and table.column_names == ["num_00", "city", "label"]


@pytest.mark.ray
def test_train_from_s3_to_s3(s3_env, s3_demo):
    import torch

    from pipeline import FittedPreprocessor

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, never the session's
    env.update(s3_env, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", "configs/demo.toml", "--data.path", s3_demo,
           "--run.output", f"s3://{BUCKET}/runs", "--run.name", "s3job", "--run.num_cpus", "4",
           "--train.epochs", "1", "--train.batch_size", "256", "--train.hidden", "[32]", "--train.num_workers", "2"]
    cp = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert cp.returncode == 0, f"exit {cp.returncode}\n{cp.stdout[-6000:]}\n{cp.stderr[-6000:]}"

    keys = _keys("runs/")
    runs = sorted({k.split("/")[1] for k in keys if k.split("/")[1]})  # "runs/" itself is a directory marker
    assert len(runs) == 1 and runs[0].startswith("s3job-"), sorted(keys)
    run = f"runs/{runs[0]}"
    assert f"{run}/preprocessor.json" in keys and f"{run}/metrics.json" in keys, sorted(keys)

    metrics = json.loads(_get(f"{run}/metrics.json"))
    assert metrics["rows_read"] == ROWS and len(metrics["epochs"]) == 1
    assert metrics["run"] == f"s3://{BUCKET}/{run}"
    pre = FittedPreprocessor.load(f"s3://{BUCKET}/{run}/preprocessor.json")  # read back through pipeline.storage
    assert pre.num_features > 0

    checkpoints = sorted({k.rsplit("/", 1)[0] for k in keys if k.startswith(f"{run}/checkpoint_") and k.endswith("/state.pt")})
    assert checkpoints, sorted(keys)
    for ckpt in checkpoints:
        assert f"{ckpt}/preprocessor.json" in keys and keys[f"{ckpt}/state.pt"] > 0
    in_ckpt = FittedPreprocessor.load(f"s3://{BUCKET}/{checkpoints[-1]}/preprocessor.json")  # with its vocab file
    assert in_ckpt == pre and any(k.startswith(f"{checkpoints[-1]}/vocab-") for k in keys)
    state = torch.load(io.BytesIO(_get(f"{checkpoints[-1]}/state.pt")), weights_only=False)
    assert {"model", "optimizer", "loader", "history"} <= set(state)
    assert metrics["checkpoint"].rstrip("/").endswith(f"{BUCKET}/{checkpoints[-1]}")


def test_delta_and_iceberg_tables_on_s3_read_their_current_rows(s3_env, tmp_path):
    """Tables in the bucket, written there by deltalake and pyiceberg, read through the same AWS_*
    variables as everything else: exactly the rows each library's own reader returns."""
    from deltalake import DeltaTable, write_deltalake
    from pyiceberg.catalog.sql import SqlCatalog
    from test_tables import batch, own_rows, project_rows

    opts = {"AWS_ENDPOINT_URL": s3_env["AWS_ENDPOINT_URL"], "AWS_ALLOW_HTTP": "true",
            "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
    uri = f"s3://{BUCKET}/tables/delta"
    write_deltalake(uri, batch(0, 800), storage_options=opts)
    write_deltalake(uri, batch(800, 2000), mode="overwrite", storage_options=opts)
    write_deltalake(uri, batch(2000, 2300), mode="append", storage_options=opts)
    DeltaTable(uri, storage_options=opts).delete("id < 900")
    dt = DeltaTable(uri, storage_options=opts)
    # deltalake's pyarrow reader here: its DataFusion reader's range requests do not get through moto
    want = own_rows(dt.to_pyarrow_table(columns=["id", "cat", "y"]))
    assert len(want) == 1400 and project_rows(uri) == want

    cat = SqlCatalog("s3test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"s3://{BUCKET}/tables/wh",
                     **{"s3.endpoint": s3_env["AWS_ENDPOINT_URL"], "s3.region": "us-east-1"})
    cat.create_namespace("ns")
    table = cat.create_table("ns.t", schema=batch(0, 1).schema)
    table.append(batch(0, 500))
    table.overwrite(batch(500, 900))
    table.delete("id < 600")
    table = cat.load_table("ns.t")
    want = own_rows(table.scan().to_arrow())
    assert len(want) == 300 and project_rows(table.location()) == want


def test_deletion_vectors_and_column_mapping_on_s3_read_as_locally(s3_env):
    """Spark-written tables with deletion vectors and column mapping, copied into the bucket: the
    deletion vectors deltalake names by s3:// URI match the files the table lists, so the same rows come
    back as from the local copy (compared after the fitted transform)."""
    import boto3

    import pipeline
    from test_table_conformance import DELTA_RS, packed_rows

    s3 = boto3.client("s3")
    for name in ("table_with_deletion_logs", "table_with_partitioning_mapping"):
        local = DELTA_RS / name
        for f in local.rglob("*"):
            if f.is_file():
                s3.upload_file(str(f), BUCKET, f"corpus/{name}/{f.relative_to(local).as_posix()}")
        keys = dict(label="", use_ray=False, val_fraction=0.0, settings={"train.drop_last": False})
        here = pipeline.prepare(str(local), world_size=1, **keys)
        there = pipeline.prepare(f"s3://{BUCKET}/corpus/{name}", world_size=1, fitted=here.fitted, **keys)
        gone = [f.deleted_rows for f in there.source.table.files]
        assert gone == [f.deleted_rows for f in here.source.table.files]
        assert sum(gone) > 0 or name != "table_with_deletion_logs"
        a, b = (pipeline.rank_data(p, batch_size=1, device="cpu").train for p in (here, there))
        assert packed_rows(a.x_num.numpy(), a.x_cat.numpy()) == packed_rows(b.x_num.numpy(), b.x_cat.numpy())
        assert there.accounting.rows_read == here.accounting.rows_read
