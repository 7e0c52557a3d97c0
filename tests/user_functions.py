"""Functions a user names in preprocess.function (tests/test_transforms.py imports them by path)."""

import pyarrow as pa
import pyarrow.compute as pc


def ratio_and_domain(t: pa.Table) -> pa.Table:
    """Adds 'ratio' (I1 per I2) and replaces 'C2' by its first two characters."""
    ratio = pc.divide(pc.cast(t["I1"], pa.float64()), pc.add(pc.abs(t["I2"]), 1.0))
    t = t.append_column("ratio", ratio)
    return t.set_column(t.column_names.index("C2"), "C2", pc.utf8_slice_codeunits(t["C2"], 0, 2))


def drops_rows(t: pa.Table) -> pa.Table:
    """Filters rows, which a function must not do (the row accounting would be wrong)."""
    t = ratio_and_domain(t)
    return t.slice(0, t.num_rows // 2)
