"""Megatron-LM's own per-iteration log line, as evidence of where training iterations lie in a log.

Megatron's last rank prints ``iteration N/ M | ...`` after each logged iteration's train step, so
in a stream that also holds a process's NCCL call lines, the lines before a call count the
training iterations completed before it, whatever the first iterations did: the evidence
:mod:`nccltrace.align.window` uses to number the log's steps for ``--capture-steps``. The lines
reach the analysis as application output (the log reader's ``unclassified`` table), and
:func:`iteration_lines` picks them out. Line format: ``docs/correlation.md``, Module notes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # log discovery imports this module: numpy and pandas are imported where used
    import numpy as np
    import pandas as pd

__all__ = ["ITERATION_LINE", "completed_before", "is_iteration_line", "iteration_lines", "read_iteration_lines"]

ITERATION_LINE = re.compile(r"\biteration\s+(?P<iteration>\d+)\s*/\s*(?P<train_iters>\d+)\s*\|")
"""Megatron's ``' iteration {:8d}/{:8d} |'`` (1-based iteration number / ``--train-iters``)."""
_ITERATION_BYTES = re.compile(ITERATION_LINE.pattern.encode())


def is_iteration_line(text: bytes) -> bool:
    """Whether a raw line (bytes, launcher prefix removed or not) is Megatron's iteration line."""
    return _ITERATION_BYTES.search(text) is not None


def iteration_lines(unclassified: pd.DataFrame) -> pd.DataFrame:
    """Megatron's iteration lines among a log's application lines (the ``unclassified`` table):
    ``line`` (in the log), ``iteration`` (1-based, as printed) and ``train_iters``, in line order.
    A log that printed none gives an empty frame."""
    import numpy as np
    import pandas as pd

    cols = {"line": pd.Series([], dtype="int64"), "iteration": pd.Series([], dtype="int64"),
            "train_iters": pd.Series([], dtype="int64")}  # fmt: skip
    if unclassified is None or not len(unclassified):
        return pd.DataFrame(cols)
    got = unclassified["text"].astype("string").str.extract(ITERATION_LINE.pattern)
    keep = got["iteration"].notna().to_numpy(bool)
    if not keep.any():
        return pd.DataFrame(cols)
    out = pd.DataFrame({"line": unclassified["line"].to_numpy(np.int64)[keep],
                        "iteration": got["iteration"][keep].astype("int64").to_numpy(),
                        "train_iters": got["train_iters"][keep].astype("int64").to_numpy()})  # fmt: skip
    return out.sort_values("line", kind="stable").reset_index(drop=True)


def read_iteration_lines(unclassified_path: Path | str) -> pd.DataFrame:
    """:func:`iteration_lines` of an ``unclassified.parquet`` (empty when the file is absent)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = Path(unclassified_path)
    if not path.exists():
        return iteration_lines(None)
    table = pq.read_table(path, columns=["line", "text"])
    # only lines that can be Megatron's are decoded into pandas (application output can be large)
    table = table.filter(pc.match_substring(table["text"], "iteration"))
    return iteration_lines(table.to_pandas())


def completed_before(marks: pd.DataFrame, lines: np.ndarray) -> np.ndarray:
    """Per log line in ``lines``: the training iterations completed before it by the iteration
    lines' own count, or -1 where the lines do not tell: before the first printed line (unless it
    is iteration 1: then 0), between
    two printed lines that are not consecutive iterations (``--log-interval`` > 1), and after the
    last one unless the two before it were consecutive.

    Line ``k`` printed before a call says ``k`` iterations had finished when the call was made,
    provided the next printed line is ``k + 1`` (else the call may belong to a later unlogged
    iteration)."""
    import numpy as np

    lines = np.asarray(lines, np.int64)
    out = np.full(len(lines), -1, np.int64)
    if marks is None or not len(marks):
        return out
    at = marks["line"].to_numpy(np.int64)
    it = marks["iteration"].to_numpy(np.int64)
    j = np.searchsorted(at, lines, side="right") - 1  # the last printed line before each line
    has = j >= 0
    k = np.where(has, it[np.maximum(j, 0)], -1)
    nxt = np.where(j + 1 < len(it), it[np.minimum(j + 1, len(it) - 1)], -1)
    # after the last printed line the count k holds if lines were printed every iteration (the
    # last two consecutive): the iteration then in progress never finished, or was not logged yet
    every = len(it) >= 2 and it[-1] == it[-2] + 1
    exact = has & ((nxt == k + 1) | ((j + 1 >= len(it)) & every))
    out[exact] = k[exact]
    if it[0] == 1:
        out[~has] = 0  # before "iteration 1" no iteration has finished
    return out
