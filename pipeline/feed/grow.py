"""Warm start: an embedding table grown to a fitted state's new id counts, its known rows untouched.

A model retrained every day on the rows its table gained (`prepare(since=...)`) starts from yesterday's
weights. The fit keeps every id it gave and numbers the values that newly pass a threshold after them
(`FittedPreprocessor.growth(previous)`: per categorical column, the rows before and after), so each
column's block of an embedding table only grows at its end:

    before   | col a: 0..na-1 | col b: 0..nb-1 |
    after    | col a: 0..na-1, new.. | col b: 0..nb-1, new.. |

`grow_embedding` lays the old rows out at their new places, bit for bit, initialises the new rows as a
fresh module's would be (nn.Embedding and nn.EmbeddingBag: N(0, 1)), and does the same for the
optimizer's per-row state (Adam's and SparseAdam's moments, SGD's momentum, Adagrad's sums: old rows
kept, new rows as a new optimizer would start them). One table per column, or one table for all
columns with each column's ids shifted by an offset (the built-in job's layout): the same call.

Grow before wrapping the model in DDP (`ray.train.torch.prepare_model`): DDP registers the parameter's
size when it is built. Every rank grows identically when the new rows' initialisation is seeded the
same (pass `generator=`), else broadcast the module from rank 0 as DDP does at construction.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..errors import PipelineError


def _counts(growth: Any, columns: Sequence[str] | None) -> tuple[list[int], list[int], list[int]]:
    """(rows before, rows after, rows that stay at the block's end) per column, from FittedPreprocessor.growth's
    result (a mapping of column -> (before, after[, tail]), or -> an object with .before/.after[/.tail]), or a
    pair (or triple) of sequences. tail: a vocab+hash column's hash buckets, which follow its vocabulary, so
    they move to the block's new end when the vocabulary grows."""
    if isinstance(growth, tuple) and len(growth) in (2, 3) and not isinstance(growth[0], (int, str)):
        before, after = [int(x) for x in growth[0]], [int(x) for x in growth[1]]
        return before, after, [int(x) for x in growth[2]] if len(growth) == 3 else [0] * len(before)
    if isinstance(growth, Mapping):
        names = list(columns) if columns is not None else list(growth)
        missing = [c for c in names if c not in growth]
        if missing:
            raise PipelineError(f"grow_embedding: no growth for column(s) {missing}; the growth names "
                                f"{sorted(growth)}. Pass columns= in the order of the table's blocks")
        got = [growth[c] for c in names]
        got = [(g.before, g.after, getattr(g, "tail", 0)) if hasattr(g, "before") else (*tuple(g), 0)[:3] for g in got]
        return [int(b) for b, _, _ in got], [int(a) for _, a, _ in got], [int(t) for _, _, t in got]
    raise PipelineError(f"grow_embedding: growth must be FittedPreprocessor.growth(previous) (column -> before, "
                        f"after) or a pair of row counts per column, not {type(growth).__name__}")


def grow_embedding(module, growth: Any, optimizer=None, *, columns: Sequence[str] | None = None,
                   init: Callable | None = None, generator=None):
    """Grow `module` (an nn.Embedding or nn.EmbeddingBag whose rows are the columns' blocks one after the
    other) in place from `growth` (FittedPreprocessor.growth(previous), or (rows before, rows after) per
    column), and the per-row state `optimizer` holds for its weight. Returns `module`.

    columns: which columns of the growth the table's blocks are, in order (default: all, in the growth's
    order). init: how new rows start (default: as the module's own reset_parameters, N(0, 1); a callable
    taking the new rows' tensor fills it in place). Known rows, and their optimizer state, are copied bit
    for bit; a column never shrinks (an id is never taken back): that is refused in one paragraph."""
    import torch

    before, after, tail = _counts(growth, columns)
    w = module.weight
    if w.shape[0] != sum(before):
        raise PipelineError(f"grow_embedding: the table has {w.shape[0]:,} rows but the growth's columns had "
                            f"{sum(before):,} before ({before}); pass the module this growth's previous state built "
                            f"(or columns= naming its blocks)")
    shrunk = [i for i, (b, a) in enumerate(zip(before, after)) if a < b]
    if shrunk:
        raise PipelineError(f"grow_embedding: column block(s) {shrunk} would shrink ({[before[i] for i in shrunk]} -> "
                            f"{[after[i] for i in shrunk]} rows): ids are never taken back, so this growth is not "
                            f"of this model's fitted state; warm-start from the previous run's own model")
    if before == after:
        return module
    old_at = torch.tensor([0, *torch.tensor(before).cumsum(0).tolist()[:-1]], dtype=torch.int64)
    new_at = torch.tensor([0, *torch.tensor(after).cumsum(0).tolist()[:-1]], dtype=torch.int64)
    # where each old row goes: its column's new offset plus its id, and a tail row (a hash bucket) as far
    # further as the column grew
    col = torch.repeat_interleave(torch.arange(len(before)), torch.tensor(before))
    at = torch.arange(sum(before)) - old_at[col]
    in_tail = at >= (torch.tensor(before) - torch.tensor(tail))[col]
    dest = (new_at[col] + at + in_tail * (torch.tensor(after) - torch.tensor(before))[col]).to(w.device)

    def moved(old: torch.Tensor, fill) -> torch.Tensor:
        out = torch.empty((sum(after), *old.shape[1:]), dtype=old.dtype, device=old.device)
        fresh = torch.ones(sum(after), dtype=torch.bool, device=old.device)
        fresh[dest] = False
        fill(out, fresh)
        out[dest] = old
        return out

    def new_rows(out, fresh):
        rows = torch.empty((int(fresh.sum()), *out.shape[1:]), dtype=out.dtype, device=out.device)
        if init is not None:
            init(rows)
        else:
            torch.nn.init.normal_(rows, generator=generator)
        out[fresh] = rows

    with torch.no_grad():
        grown = moved(w.detach(), new_rows)
        if getattr(module, "padding_idx", None) is not None:
            grown[module.padding_idx].zero_()
        w.data = grown  # the same Parameter object: an optimizer built over it keeps pointing at it
        module.num_embeddings = sum(after)
        if optimizer is not None:
            for opt in getattr(optimizer, "parts", {"": optimizer}).values():  # the job's Optimizers, or one
                state = opt.state.get(w)
                if not state:
                    continue
                start = next((g.get("initial_accumulator_value", 0.0) for g in opt.param_groups
                              if any(p is w for p in g["params"])), 0.0)
                for k, v in list(state.items()):
                    if torch.is_tensor(v) and v.dim() and v.shape[0] == len(dest):
                        state[k] = moved(v, lambda out, fresh, s=(start if k == "sum" else 0.0):
                                         out.__setitem__(fresh, s))
    return module
