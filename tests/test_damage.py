"""Damaged files, as a disk or a network damages them: every outcome is the values as written, a
clean one-paragraph error, or quarantine with every row accounted for; never a traceback, a hang, or
changed values that the row group's footer statistics could have told.

Runs without Ray (pipeline.prepare / rank_data in this process), so hundreds of seeded damages take
seconds; the Ray path shares the same per-row-group code (pipeline/cluster/tasks.py).
"""

from __future__ import annotations

import base64
import shutil
import signal
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.parquet.encryption as pe
import pytest

import pipeline
from pipeline.config import DEMO_CATEGORICAL, DEMO_NUMERIC
from pipeline.demo import _shard

ROWS, GROUP = 2000, 500
ALL = [*DEMO_NUMERIC, *DEMO_CATEGORICAL, "label"]


def prepare(path: str, **kw):
    opts = dict(label="label", target_kind="binary", numeric=list(DEMO_NUMERIC), categorical=list(DEMO_CATEGORICAL),
                passthrough=ALL, val_fraction=0.0, on_bad_file="quarantine", use_ray=False)
    return pipeline.prepare(path, **(opts | kw))


def pristine(tmp_path, checksums: bool) -> tuple[str, pa.Table]:
    table = _shard(ROWS, 0, 3).select(ALL)
    path = str(tmp_path / "pristine.parquet")
    pq.write_table(table, path, row_group_size=GROUP, write_page_checksum=checksums, compression="snappy")
    return path, table


def damage(data: bytes, rng: np.random.Generator, kind: str) -> bytes:
    b = bytearray(data)
    n = len(b)
    footer = int.from_bytes(data[-8:-4], "little")
    pages = (4, n - footer - 8)  # the column chunks; the footer (thrift) follows
    if kind == "flip_pages":
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(*pages))] ^= 1 << int(rng.integers(8))
    elif kind == "flip_footer":
        b[int(rng.integers(pages[1], n - 8))] ^= 1 << int(rng.integers(8))
    elif kind == "truncate":
        return bytes(b[:int(rng.integers(8, n))])
    elif kind == "zero_range":
        start, k = int(rng.integers(*pages)), int(rng.integers(1, 200))
        b[start:start + k] = bytes(len(b[start:start + k]))
    elif kind == "swap_ranges":
        k = int(rng.integers(8, 256))
        i, j = sorted(int(x) for x in rng.integers(pages[0], pages[1] - k, 2))
        if j - i >= k:
            b[i:i + k], b[j:j + k] = b[j:j + k], b[i:i + k]
    return bytes(b)


def _same(a, b) -> bool:
    return a == b or (a is None and b is None) or (isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b))


def _stats_agree(path: str, group: int, column: str) -> bool:
    """Independently of the pipeline (numpy, not its checks): do the decoded column's null count, min
    and max equal the footer's?"""
    pf = pq.ParquetFile(path)
    stats = pf.metadata.row_group(group).column(pf.schema_arrow.get_field_index(column)).statistics
    col = pf.read_row_group(group, columns=[column])[column]
    if stats is None:
        return True
    if stats.has_null_count and col.null_count != stats.null_count:
        return False
    if stats.has_min_max and (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
        vals = col.drop_null().to_numpy().astype(float)
        vals = vals[~np.isnan(vals)]
        return vals.size == 0 or (vals.min() == float(stats.min) and vals.max() == float(stats.max))
    return True


def trial(tmp_path, src: str, table: pa.Table, seed: int, kind: str, policy: str) -> str:
    rng = np.random.default_rng(seed)
    d = tmp_path / f"{kind}-{seed}-{policy}"
    d.mkdir()
    bad = str(d / "part-0.parquet")
    with open(src, "rb") as f:
        damaged = damage(f.read(), rng, kind)
    with open(bad, "wb") as f:
        f.write(damaged)
    shutil.copy(src, d / "part-1.parquet")  # a good file beside it: the run can go on without the bad one
    try:
        plan = prepare(str(d), on_bad_file=policy)
        data = pipeline.rank_data(plan, device="cpu", batch_size=64)
    except pipeline.PipelineError as e:
        msg = str(e)
        assert "\n" not in msg and "Traceback" not in msg and ("part-0.parquet" in msg or "part-1" in msg), msg
        return "error"
    acct = plan.accounting
    assert acct.balanced, acct.summary()
    # Rows of the good file come first in no particular place: compare every surviving row of the bad
    # file (global ids below its row count) with what was written.
    offsets = {s.path: sum(x.num_rows for x in plan.source.shards[:i]) for i, s in enumerate(plan.source.shards)}
    start = offsets.get(bad)
    ids = data.train.row_id.numpy()
    differ = set()
    if start is not None:
        mine = (ids >= start) & (ids < start + ROWS)
        rows = ids[mine] - start
        for c in ALL:
            got = data.train.extra[c][mine]
            want = table[c].to_numpy(zero_copy_only=False)[rows]
            equal = np.asarray(got == want)  # elementwise `==`, the first test of _same, at numpy speed
            if equal.shape != got.shape:
                equal = np.zeros(len(got), dtype=bool)
            for i in np.flatnonzero(~equal):  # the rest: nulls and NaNs, or a real difference
                g_val, w_val = got[i], want[i]
                if not _same(g_val.item() if hasattr(g_val, "item") else g_val, w_val.item() if hasattr(w_val, "item") else w_val):
                    differ.add((int(rows[i]) // GROUP, c))
    if differ:  # allowed only where the footer's statistics could not have told
        for group, c in differ:
            assert _stats_agree(bad, group, c), f"seed {seed} {kind}: row group {group} column {c} changed and its " \
                                                f"statistics disagree, but the pipeline used it"
        return "differs, statistics could not tell"
    if acct.quarantined:
        return "quarantined"
    return "exact"


@pytest.mark.parametrize("checksums", [True, False])
def test_fuzzed_damage_never_tracebacks_hangs_or_passes_detectable_changes(tmp_path, checksums, capsys):
    src, table = pristine(tmp_path, checksums)
    outcomes: Counter = Counter()
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("a damaged file hung the pipeline")))
    try:
        for seed in range(40):
            for kind in ("flip_pages", "flip_footer", "truncate", "zero_range", "swap_ranges"):
                policy = "quarantine" if seed % 4 else "fail"
                signal.alarm(30)
                outcomes[(kind, trial(tmp_path, src, table, seed, kind, policy))] += 1
                signal.alarm(0)
    finally:
        signal.alarm(0)
    with capsys.disabled():
        print(f"\n[fuzz] page checksums {'on' if checksums else 'off'}: " +
              ", ".join(f"{k}/{o}: {n}" for (k, o), n in sorted(outcomes.items())))
    assert sum(outcomes.values()) == 200
    assert outcomes[("truncate", "exact")] == 0  # a truncated file is never read as if whole


def plain_file(path: str, table: pa.Table) -> None:
    """No compression, no dictionary, no checksums: a changed byte changes a value and nothing else."""
    pq.write_table(table, path, row_group_size=GROUP, compression="none", use_dictionary=False,
                   write_page_checksum=False)


def test_values_changed_behind_a_valid_page_are_caught_by_the_footer_statistics(tmp_path):
    table = _shard(ROWS, 0, 5).select(ALL)
    d = tmp_path / "data"
    d.mkdir()
    path = str(d / "part-0.parquet")
    plain_file(path, table)
    col = table["num_00"].to_numpy(zero_copy_only=False)
    top = float(np.nanmax(col[GROUP:2 * GROUP]))  # row group 1's maximum, stored as 8 plain bytes
    data = open(path, "rb").read()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    # Every copy before the footer (the value, and its page header's statistics if any): the page stays
    # self-consistent and decodes; only the footer still knows the row group's true maximum.
    pages = data[:footer].replace(np.float64(top).tobytes(), np.float64(top + 1000.0).tobytes())
    open(path, "wb").write(pages + data[footer:])
    assert pq.read_table(path)["num_00"][GROUP:2 * GROUP].to_numpy(zero_copy_only=False).max() == top + 1000.0
    plan = prepare(str(d))
    (entry,) = plan.accounting.quarantined
    assert entry["row_group"] == 1 and "disagree with the footer's statistics" in entry["reason"], entry
    assert "column 'num_00'" in entry["reason"] and plan.accounting.balanced
    with pytest.raises(pipeline.DataError, match=r"row group 1 .* is damaged: decoded values disagree"):
        prepare(str(d), on_bad_file="fail")


def test_everything_quarantined_names_each_file_and_writes_the_manifest(tmp_path, capsys, ray_local):
    from pipeline import cli

    d = tmp_path / "data"
    d.mkdir()
    (d / "a.parquet").write_bytes(b"")
    (d / "b.parquet").write_bytes(b"PAR1 not really")
    (d / "c.parquet").write_bytes(b"PARE" + bytes(100) + b"PARE")
    out = tmp_path / "runs"
    rc = cli.main(["train", "--data.path", str(d), "--run.output", str(out), "--quality.on_bad_file", "quarantine",
                   "--data.numeric", "[\"x\"]"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for name, reason in [("a.parquet", "file is empty"), ("b.parquet", "truncated"), ("c.parquet", "encrypted Parquet file")]:
        assert f"{name}': {reason}" in err, err
    (manifest,) = out.glob("*/quarantine.jsonl")
    assert len(manifest.read_text().splitlines()) == 3 and str(manifest) in err


class _Kms(pe.KmsClient):
    """A toy key service: keys 'wrapped' by base64 (a test needs no real KMS)."""

    def __init__(self, config):
        super().__init__()

    def wrap_key(self, key_bytes, master_key_identifier):
        return base64.b64encode(key_bytes)

    def unwrap_key(self, wrapped_key, master_key_identifier):
        return base64.b64decode(wrapped_key)


@pytest.mark.parametrize("plaintext_footer", [False, True])
def test_encrypted_files_are_reported_as_encrypted(tmp_path, plaintext_footer):
    d = tmp_path / "data"
    d.mkdir()
    table = _shard(300, 0, 1).select(ALL)
    crypto = pe.CryptoFactory(lambda cfg: _Kms(cfg))
    enc = pe.EncryptionConfiguration(footer_key="k1", column_keys={"k2": ["num_00", "city"]},
                                     plaintext_footer=plaintext_footer, double_wrapping=False)
    props = crypto.file_encryption_properties(pe.KmsConnectionConfig(), enc)
    with pq.ParquetWriter(str(d / "secret.parquet"), table.schema, encryption_properties=props) as w:
        w.write_table(table)
    pq.write_table(table, str(d / "open.parquet"))
    plan = prepare(str(d))
    reasons = [e["reason"] for e in plan.accounting.quarantined]
    assert len(reasons) == 1 and "encrypted" in reasons[0] and "decryption keys" in reasons[0], reasons
    assert "damaged" not in reasons[0] and "not a Parquet file" not in reasons[0]
    assert plan.accounting.balanced and plan.accounting.rows_used == 300


@pytest.mark.ray
def test_a_row_group_damaged_after_the_fit_reaches_the_rank_as_one_paragraph(tmp_path, ray_local):
    """A Ray Data task's error arrives as our DataError (not Ray's nested task errors), naming the file."""
    from pipeline.cluster import ray_side

    d = tmp_path / "data"
    d.mkdir()
    path = str(d / "part-0.parquet")
    pq.write_table(_shard(ROWS, 0, 6).select(ALL), path, row_group_size=GROUP, write_page_checksum=True)
    plan = prepare(str(d), on_bad_file="fail", use_ray=True)
    data = bytearray(open(path, "rb").read())
    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = col.data_page_offset + 40  # inside the first data page, past its header
    data[start:start + 64] = bytes(64)
    open(path, "wb").write(bytes(data))
    with pytest.raises(pipeline.DataError) as e:
        ray_side.receive(ray_side.share_dataset(plan.spec, plan.fitted, plan.pieces(0)).iterator(),
                         lambda part, val: None, 0, ROWS, 60)
    assert path in str(e.value) and "row group 0" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_validate_deep_decodes_every_page_and_names_damaged_row_groups(tmp_path, capsys):
    from pipeline import cli

    d = tmp_path / "data"
    d.mkdir()
    table = _shard(ROWS, 0, 7).select(ALL)
    pq.write_table(table, str(d / "good.parquet"), row_group_size=GROUP, write_page_checksum=True)
    bad = str(d / "bad.parquet")
    pq.write_table(table, bad, row_group_size=GROUP, write_page_checksum=True)
    raw = bytearray(open(bad, "rb").read())
    start = pq.ParquetFile(bad).metadata.row_group(2).column(3).data_page_offset + 40
    raw[start:start + 32] = bytes(32)  # a page of row group 2, behind its checksum
    open(bad, "wb").write(bytes(raw))
    args = ["validate", "--deep", "--config", "configs/demo.toml", "--data.path", str(d)]
    assert cli.main(args) == 2  # quality.on_bad_file = fail
    out, err = capsys.readouterr()
    assert f"BAD {bad} row group 2" in out and "cannot be decoded" in out and "7 of 8 row groups" in out
    assert "1 damaged row groups" in err and "Traceback" not in err
    assert cli.main([*args, "--quality.on_bad_file", "quarantine"]) == 0
    assert "0 files and 1 row groups would be set aside" in capsys.readouterr().out


def test_the_footer_check_takes_a_float_columns_bounds_as_pyarrow_does():
    """statistics_problem's bounds of a float column (numpy's fmin / fmax, for speed) are pyarrow's min_max:
    NaN passed over, NaN where every value is NaN, nothing where every value is null, infinities and signed
    zeros kept, over several chunks."""
    import pyarrow.compute as pc

    from pipeline.read.row_groups import _min_max

    rng = np.random.default_rng(3)
    pool = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, None, 1.5, -2.25]
    for t in (pa.float64(), pa.float32(), pa.int32()):
        for trial in range(200):
            n = int(rng.integers(0, 6))
            vals = [pool[i] for i in rng.integers(0, len(pool), n)] + list(rng.normal(size=int(rng.integers(0, 3))))
            if t == pa.int32():
                vals = [None if v is None or v != v or abs(v) == float("inf") else int(v) for v in vals]
            cut = int(rng.integers(0, len(vals) + 1))
            col = pa.chunked_array([pa.array(vals[:cut], t), pa.array(vals[cut:], t)])
            mm = pc.min_max(col)
            want, got = (mm["min"].as_py(), mm["max"].as_py()), _min_max(col)
            assert [None if x is None else ("nan" if x != x else x) for x in got] == \
                   [None if x is None else ("nan" if x != x else x) for x in want], (vals, t)
