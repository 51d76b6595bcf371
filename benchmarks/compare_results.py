"""Compare two results trees table by table: the check that a refactoring changed no result.

    python benchmarks/compare_results.py results_before/example results_after/example

Every Parquet table under either tree is read with pandas and compared by content (columns,
dtypes, values, row order), not by file bytes: manifests, code hashes and the pandas metadata of a
file may differ after a code change, the tables may not. Prints one line per table that differs
or exists on one side only, and a count; exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd


def _tables(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.parquet") if ".snakemake" not in p.parts}


def table_difference(a: Path, b: Path) -> str | None:
    """Why the tables at ``a`` and ``b`` differ (first difference found), or None when equal."""
    left, right = pd.read_parquet(a), pd.read_parquet(b)
    if list(left.columns) != list(right.columns):
        return f"columns {list(left.columns)} != {list(right.columns)}"
    if len(left) != len(right):
        return f"{len(left)} rows != {len(right)} rows"
    try:
        pd.testing.assert_frame_equal(left, right, check_exact=True)
    except AssertionError as err:
        return str(err).strip().splitlines()[0] + " " + " ".join(str(err).split())[:300]
    return None


def compare_trees(before: Path, after: Path) -> list[str]:
    """One line per table that differs or is on one side only."""
    old, new = _tables(before), _tables(after)
    out = [f"only before: {t}" for t in sorted(old - new)] + [f"only after: {t}" for t in sorted(new - old)]
    for t in sorted(old & new):
        why = table_difference(before / t, after / t)
        if why:
            out.append(f"differs: {t}: {why}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    lines = compare_trees(args.before, args.after)
    n = len(_tables(args.before) | _tables(args.after))
    for line in lines:
        print(line)
    print(f"{n} tables compared, {len(lines)} differ or are on one side only")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
