"""`python -m pipeline` / `parquet-pipeline`: generate, validate, fit, train, bench.

Every config key is also a flag: `--train.epochs 5`, `--data.path s3://bucket/shards`,
`--train.hidden [512,256]` (values are read as TOML). Flags win over the --config file.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

from . import config as config_mod
from .errors import PipelineError, find_pipeline_error

DEFAULT_CONFIG = "configs/demo.toml"
COMMAND_START = time.time()  # as early as this module is imported: what "after the command started" counts from


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"TOML config file (the demo uses {DEFAULT_CONFIG}; "
                                                   f"without it the built-in defaults apply)")
    p.add_argument("--debug", action="store_true", help="show tracebacks and Ray's own logs")
    g = p.add_argument_group("config keys (override the file; values are TOML: 3, 0.5, true, [256,128], text)")
    for key, finfo in config_mod.keys().items():
        default = finfo.default
        help_text = (finfo.description + "; " if finfo.description else "") + f"default {json.dumps(default, default=list)}"
        g.add_argument(f"--{key}", dest=f"cfg:{key}", metavar="V", default=None, help=help_text)


def _config_from(args: argparse.Namespace) -> config_mod.Config:
    overrides = {k[4:]: config_mod.parse_flag_value(v) for k, v in vars(args).items()
                 if k.startswith("cfg:") and v is not None}
    return config_mod.load(args.config, overrides)


def cmd_generate(cfg: config_mod.Config, args) -> int:
    from . import demo

    g = cfg.generate
    t0 = time.perf_counter()
    if g.days:
        added = demo.generate_daily(cfg.data.path, g.days, g.rows, g.seed, overwrite=args.overwrite)
        print(f"[generate] the daily Delta table at {cfg.data.path} holds days 1..{g.days} ({g.rows:,} rows a day): "
              f"{'appended days ' + ', '.join(map(str, added)) if added else 'nothing to append'} "
              f"({time.perf_counter() - t0:.1f}s)")
        return 0
    write = demo.generate_criteo if g.dataset == "criteo" else demo.generate
    paths = write(cfg.data.path, g.rows, g.shards, g.seed, overwrite=args.overwrite)
    print(f"[generate] {len(paths)} shards at {cfg.data.path} ({time.perf_counter() - t0:.1f}s; "
          f"an existing complete dataset is kept unless --overwrite)")
    return 0


def cmd_validate(cfg: config_mod.Config, args) -> int:
    from .read import source
    from .errors import DataError

    # Collect every bad file (not just the first), then apply the configured policy.
    lenient = cfg.model_copy(update={"quality": cfg.quality.model_copy(update={"on_bad_file": "quarantine"})})
    src = source.inspect(lenient)
    print(f"[validate] {len(src.shards)} good shards, {src.num_rows:,} rows, {len(src.fragments)} row groups "
          f"{src.where}; {src.describe_columns()}")
    for b in src.bad_files:
        rows = "rows unknown" if b.rows is None else f"{b.rows:,} rows"
        print(f"[validate] BAD {b.path} ({rows}): {b.reason}")
    if src.bad_files and cfg.quality.on_bad_file == "fail":
        raise DataError(f"{len(src.bad_files)} bad files under '{src.uri}' (listed above); rewrite or remove them, "
                        f"or set quality.on_bad_file = \"quarantine\" to train on the rest")
    damaged = _deep(src) if args.deep else []
    if damaged and cfg.quality.on_bad_file == "fail":
        raise DataError(f"{len(damaged)} damaged row groups under '{src.uri}' (listed above); rewrite those files, or "
                        f"set quality.on_bad_file = \"quarantine\" to set damaged row groups aside")
    if src.bad_files or damaged:
        print(f"[validate] quality.on_bad_file = quarantine: {len(src.bad_files)} files and {len(damaged)} row groups "
              f"would be set aside")
    return 0


def _deep(src) -> list[tuple[str, int, str]]:
    """Decode every page of every row group (no Ray), with a progress bar; print each damaged one."""
    from tqdm.auto import tqdm

    from .read import row_groups

    damaged = []
    total = sum(len(s.row_group_rows) for s in src.shards)
    with tqdm(total=total, desc="validate --deep", unit="row group") as bar:
        for shard in src.shards:
            for g, problem in row_groups.deep_check(src.uri, shard):
                bar.update(1)
                if problem:
                    damaged.append((shard.path, g, problem))
                    tqdm.write(f"[validate] BAD {shard.path} row group {g} ({shard.row_group_rows[g]:,} rows): {problem}")
    print(f"[validate] --deep: {total - len(damaged)} of {total} row groups decode and "
          f"match their statistics")
    return damaged


def cmd_fit(cfg: config_mod.Config, args) -> int:
    from . import storage
    from .cluster import runtime
    from .job import driver as train

    runtime.init_ray(cfg)
    train.prepare_run(cfg, storage.join(cfg.run.output, train.run_name(cfg)), cfg.train.workers)
    return 0


def summary_table(summary: dict) -> str:
    """The train job's closing table: one value and baseline column per target, one row per epoch."""
    from .job.evaluate import target_metrics

    rows, targets = summary["epochs"], summary["targets"]
    lines, cols = [""], []  # cols: (header, value key, baseline key), per target and metric
    said = {"val_rmse": "predicting the training mean", "val_acc": "the majority class",
            "val_auc": "0.5, a random order", "val_logloss": "predicting the training positive rate"}
    for t in targets:
        metrics = target_metrics(t["name"], t["kind"])
        lines.append(f"target '{t['name']}' ({t['kind']}): {', '.join(m for m, _, _ in metrics)} on the validation rows, "
                     f"beside the baseline ({'; '.join(f'{m}: {said[m]}' for m, _, _ in metrics)})")
        cols += [(name if len(targets) == 1 else value_key, value_key, base_key) for name, value_key, base_key in metrics]
    lines.append("epoch  train_loss" + "".join(f"  {h:>{max(8, len(h))}}  baseline" for h, _, _ in cols)
                 + "  rows/s       data_wait%")
    for m in rows:
        figures = "".join(f"  {m.get(v, float('nan')):>{max(8, len(h))}.4f}  {m.get(b, float('nan')):>8.4f}"
                          for h, v, b in cols)
        lines.append(f"{m['epoch']:>5}  {m['train_loss']:>10.4f}{figures}  {m['rows_per_s']:>11,.0f}  "
                     f"{m['data_wait_pct']:>10.1f}")
    return "\n".join(lines)


def cmd_train(cfg: config_mod.Config, args) -> int:
    from .cluster import runtime
    from .job import driver as train

    summary = train.run(cfg, started=COMMAND_START, start_ray=functools.partial(runtime.init_ray, train=True),
                        starts_private_ray=runtime.address(cfg) == "local")
    print(summary_table(summary))
    print(f"\n[rows] {summary['accounting_summary']}")
    print(f"[train] done in {summary['wall_s']:.1f}s; run folder {summary['run']}; checkpoint {summary['checkpoint']}; "
          f"preprocessor {summary['preprocessor']}")
    return 0


COMMANDS: dict[str, tuple[Callable[..., int], str]] = {
    "generate": (cmd_generate, "write the demo Parquet dataset to data.path (skipped if already complete)"),
    "validate": (cmd_validate, "list shards, read every footer, check columns against the config"),
    "fit": (cmd_fit, "fit the preprocessing in one distributed pass and save it as JSON"),
    "train": (cmd_train, "fit, transform and train with Ray Train (TorchTrainer, DDP)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_config_flags(p)
        if name == "generate":
            p.add_argument("--overwrite", action="store_true", help="rewrite the dataset even if it is complete")
        if name == "validate":
            p.add_argument("--deep", action="store_true", help="also decode every page of every row group (checksums "
                                                               "where stored, values against the footer's statistics)")
    from . import bench

    bench.add_parser(sub, _add_config_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "debug", False):
        os.environ["PIPELINE_DEBUG"] = "1"  # also for Ray workers started from here (runtime.optional)
    try:
        cfg = None if getattr(args, "no_config", False) else _config_from(args)
        handler: Callable[..., Any] = COMMANDS[args.command][0] if args.command in COMMANDS else args.handler
        return handler(cfg, args)
    except PipelineError as e:
        _report(e, args.debug)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # Ray wraps errors raised in tasks and workers; surface ours without the noise
        inner = find_pipeline_error(e)
        if inner is None:
            raise
        _report(inner, args.debug, e)
        return 2


def _report(e: PipelineError, debug: bool, outer: BaseException | None = None) -> None:
    """One paragraph; --debug adds the tracebacks (ours, Ray's wrapping, and a task's own)."""
    if debug:
        traceback.print_exception(outer or e)
        if e.details:
            print(e.details, file=sys.stderr)
    print(f"error: {e}", file=sys.stderr)
