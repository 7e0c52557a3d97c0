"""`python -m pipeline bench`: the benchmarks, each beside the alternative it is measured against, in
one run (ratios, never timed tests). Modes:

  loader      (loader.py)      this project's loader beside a per-row DataLoader, Ray Data and the memory
                               system's limit, on the same rows in the same order
  preprocess  (preprocess.py)  fit plus every rank's share beside a hand-written one-thread script
              (scale.py)       --scale: the fit's driver memory and time as the rows grow
  increments  (increments.py)  a daily chain of increments beside a full refit each day

Outputs go under runs/<mode>/ unless --out says (report.py writes the JSON and the PNG).
"""

from __future__ import annotations

import os


def _datasets(text: str) -> str:
    import argparse

    bad = [d for d in text.split(",") if d not in ("demo", "criteo")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown dataset {bad[0]!r}: choose demo, criteo or demo,criteo")
    return text


def add_parser(sub, add_config_flags) -> None:
    p = sub.add_parser("bench", help="measure this loader against a per-row DataLoader, Ray Data and the memory limit "
                                     "(--mode loader), or preprocessing against a hand-written script (--mode preprocess)",
                       description=__doc__)
    p.add_argument("--mode", choices=["loader", "preprocess", "increments"], default="loader",
                   help="preprocess: see `pipeline/bench_preprocess.py` (fit + transform vs a single-process script); "
                        "increments: see `pipeline/bench_increments.py` (the daily loop: the warm-started chain beside "
                        "a full refit and retrain, and their AUC on the next day)")
    p.add_argument("--days", type=int, default=7, help="increments: days of the daily table")
    p.add_argument("--epochs", type=int, default=1, help="increments: epochs per day's training")
    p.add_argument("--batch-size", type=int, default=1024, help="increments: training batch size")
    p.add_argument("--rows", default=None, help="default 2M (loader), 10M (preprocess demo; criteo: 2M and 10M), 200k "
                                               "a day (increments); preprocess: several, comma-separated, are measured "
                                               "side by side")
    p.add_argument("--dataset", default="demo", type=_datasets,
                   help="preprocess: demo (the demo data and recipe), criteo (Criteo-shaped data and the DLRM "
                        "recipe), or both comma-separated (demo,criteo: every case side by side in one run)")
    p.add_argument("--shards", type=int, default=None, help="preprocess: files the rows are written in (default 32 "
                                                             "for demo, 16 for criteo, 64 for --scale)")
    p.add_argument("--world", type=int, default=2, help="preprocess: ranks whose shares are transformed")
    p.add_argument("--data", default=None, help="preprocess: the folder under which each case's files are written, as <dataset>-<rows> (default data/bench-<dataset>-<rows>)")
    p.add_argument("--read-share", choices=["worker", "ray_data"], default="worker",
                   help="preprocess: who reads each rank's share (loader.read_share)")
    p.add_argument("--scale", default=None, metavar="ROWS,ROWS,...",
                   help="preprocess: the fit on a 3-node Ray cluster as Criteo-shaped data grows, every value kept "
                        "(driver and reducer memory, fit time against the hand-written counting pass, ids against a "
                        "fit in one process): see `pipeline/bench_scale.py`")
    p.add_argument("--partitions", default="auto", help="preprocess --scale: preprocess.vocab_partitions")
    p.add_argument("--no-check-ids", action="store_true", help="preprocess --scale: skip the fit in one process")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--categorical", type=int, default=4)
    p.add_argument("--batch-sizes", default="256,4096", help="comma-separated")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--budget", type=float, default=3.0, help="seconds per slow measurement")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions per method, best kept "
                                                              "(default 3 for loader, 1 for preprocess)")
    p.add_argument("--no-ray", action="store_true", help="skip (b), which starts a local Ray")
    p.add_argument("--out", default="bench.json", help="JSON file with every figure")
    p.add_argument("--plot", default="bench.png", help="PNG bar chart ('' to skip)")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(handler=_cmd, no_config=True)


def _outputs(args, name: str) -> None:
    """Where a mode's JSON and PNG go: under runs/<name>/ unless --out says (never the repository root);
    the PNG beside the JSON unless --plot says."""
    if args.out == "bench.json":
        args.out = os.path.join("runs", name, f"{name}.json")
    if args.plot == "bench.png":
        args.plot = os.path.splitext(args.out)[0] + ".png"


def _cmd(cfg, args) -> int:
    if args.mode == "increments":  # outputs under a run folder, never the repository root
        from . import increments

        args.rows = int(args.rows) if args.rows else 200_000
        _outputs(args, "bench-increments")
        return increments.main(args)
    if args.mode == "preprocess":
        from . import preprocess

        args.repeats = args.repeats or 1
        _outputs(args, "bench-preprocess")
        if args.scale:
            from . import scale

            args.out, args.plot = args.out.replace("preprocess", "scale"), args.plot.replace("preprocess", "scale")
            args.partitions = args.partitions if args.partitions == "auto" else int(args.partitions)
            args.shards = args.shards or 64
            return scale.main(args)
        return preprocess.main(args)
    from . import loader
    from .report import report

    _outputs(args, "bench-loader")
    args.rows, args.repeats = int(args.rows or 2_000_000), args.repeats or 3
    res = loader.run(args.rows, args.features, args.categorical, [int(b) for b in args.batch_sizes.split(",")],
                     args.device, args.budget, not args.no_ray, args.repeats)
    return report(res, loader.table, loader.plot, args)
