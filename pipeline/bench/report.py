"""What both benchmarks do with their results (bench.py, bench_preprocess.py): a module of its own, so
that neither imports the other."""

from __future__ import annotations

import json
import os
from typing import Callable


def report(res: dict, table_of: Callable[[dict], str], plot_to: Callable[[dict, str], None], args) -> int:
    """Print the table, write the JSON (and the PNG unless --plot '')."""
    print(table_of(res))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        plot_to(res, args.plot)
    print(f"\nwrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0
