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
