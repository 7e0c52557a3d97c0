"""The bench command runs end to end on small data and writes consistent figures (no timing asserted)."""

import json

from pipeline import cli


def test_bench_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = cli.main(["bench", "--rows", "20000", "--features", "8", "--categorical", "2", "--batch-sizes", "64,512",
                   "--budget", "0.2", "--repeats", "1", "--no-ray", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    for b in ("64", "512"):
        r = res["by_batch"][b]
        for k in ("a_textbook_w0", "a_textbook_w2", "c_loader", "d_limit"):
            assert r[k] > 0
        assert abs(r["ratio_c_over_d"] - r["c_loader"] / r["d_limit"]) < 1e-9
    assert res["bulk_gather"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "c/d" in capsys.readouterr().out


def test_preprocess_bench_times_both_sides_and_a_ranks_memory(tmp_path, capsys, ray_local):
    out = tmp_path / "prep.json"
    rc = cli.main(["bench", "--mode", "preprocess", "--rows", "20000", "--shards", "2", "--data", str(tmp_path / "d"),
                   "--out", str(out), "--plot", str(tmp_path / "prep.png")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "(h) hand-written" in text and "p/h = " in text and "rank 1:" in text
    res = json.loads(out.read_text())
    best = res["best"]
    assert best["handwritten"]["rows"] == 20_000 and sum(r["rows"] for r in best["project"]["ranks"]) == 20_000
    assert best["ratio_project_over_handwritten"] > 0 and (tmp_path / "prep.png").stat().st_size > 0
    assert all(r["packed_bytes"] > 0 and r["uss_peak_extra"] >= 0 for r in best["project"]["ranks"])


def test_preprocess_bench_on_criteo_shaped_data_says_the_fitted_states_size(tmp_path, capsys, ray_local):
    out = tmp_path / "ctr.json"
    rc = cli.main(["bench", "--mode", "preprocess", "--dataset", "criteo", "--rows", "20000", "--shards", "2",
                   "--data", str(tmp_path / "d"), "--out", str(out), "--plot", ""])
    assert rc == 0
    text = capsys.readouterr().out
    assert "DLRM recipe" in text and "fitted state:" in text and "p/h = " in text
    p = json.loads(out.read_text())["best"]["project"]
    assert p["state_bytes"]["preprocessor.json"] > 0 and p["vocab_values"] > 0
    assert sum(r["rows"] for r in p["ranks"]) == 20_000


def test_preprocess_bench_runs_several_cases_side_by_side(tmp_path, capsys, ray_local):
    out = tmp_path / "cases.json"
    rc = cli.main(["bench", "--mode", "preprocess", "--dataset", "demo,criteo", "--rows", "12000,20000", "--shards", "2",
                   "--data", str(tmp_path / "d"), "--out", str(out), "--plot", str(tmp_path / "cases.png")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ratio per repetition" in text and "criteo 20,000" in text and "demo 12,000" in text
    res = json.loads(out.read_text())
    assert [(c["dataset"], c["rows"]) for c in res["cases"]] == [("demo", 12_000), ("demo", 20_000),
                                                                 ("criteo", 12_000), ("criteo", 20_000)]
    for c in res["cases"]:
        p = c["best"]["project"]
        assert c["best"]["handwritten"]["rows"] == c["rows"] == sum(r["rows"] for r in p["ranks"])
        assert c["best"]["ratio_project_over_handwritten"] == p["seconds"] / c["best"]["handwritten"]["seconds"]
    assert (tmp_path / "cases.png").stat().st_size > 0


def test_increments_bench_compares_the_chain_with_the_full_refit_day_by_day(tmp_path, capsys):
    """bench --mode increments on 4 small days: each day's increment reads that day only, the full refit every
    day so far; the three models are scored on the next day (figures only, no timing asserted)."""
    out, png = tmp_path / "inc.json", tmp_path / "inc.png"
    rc = cli.main(["bench", "--mode", "increments", "--days", "4", "--rows", "3000", "--data", str(tmp_path / "d"),
                   "--out", str(out), "--plot", str(png)])
    assert rc == 0
    assert "AUC chain" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["day"] for r in res["per_day"]] == [2, 3]
    for r in res["per_day"]:
        assert r["increment_rows"] == 3000 and r["full_rows"] == 3000 * r["day"]
        assert all(0.0 <= r[f"{m}_auc"] <= 1.0 and r[f"{m}_logloss"] > 0 for m in ("chain", "full", "day_only"))
        assert all(after >= before for before, after in r["growth"].values())
    assert png.stat().st_size > 10_000


def test_the_scale_bench_children_find_its_functions():
    """bench --mode preprocess --scale runs each measurement in a child process of its own, which imports the
    bench's module by name (a path that once moved, and the children then found nothing)."""
    from pipeline.bench import scale

    got = scale._child("import json; print('RESULT ' + json.dumps([callable(handwritten_counts), "
                       "callable(driver), callable(one_process)]))", 120)
    assert got == [True, True, True]
