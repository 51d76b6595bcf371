"""NCCL version strings and the log-format features that depend on them.

Format facts come from the NCCL release tags (see ``docs/nccl-log-formats.md``); each
feature is a predicate on the version tuple so the writer and the reader agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VERSION_RE = re.compile(r"NCCL version (\d+)\.(\d+)\.(\d+)(\S*?)\+cuda(\d+)\.(\d+)")


@dataclass(frozen=True, order=True)
class NcclVersion:
    """An NCCL release as (major, minor, patch)."""

    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> "NcclVersion":
        """Parse ``"2.21.5"`` (patch optional: ``"2.21"`` means the first patch of that minor)."""
        m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.(\d+))?(?:[-+].*)?\s*", str(text))
        if not m:
            raise ValueError(f"not an NCCL version: {text!r} (expected e.g. '2.21.5')")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def tuple(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    # --- line-format features -------------------------------------------------------
    @property
    def info_version_line(self) -> bool:
        """>= 2.22 every process prints the version as an INFO line (earlier: bare stdout line)."""
        return self.tuple >= (2, 22, 0)

    @property
    def send_buffer_in_recv_slot(self) -> bool:
        """From 2.12 ``Send`` logs ``sendbuff (nil) recvbuff <p>``."""
        return self.tuple >= (2, 12, 0)

    @property
    def tuning_format(self) -> str | None:
        """Which INFO TUNING line format this version prints (None: no INFO line)."""
        t = self.tuple
        if t < (2, 20, 0):
            return None
        if t < (2, 23, 0):
            return "bytes_numeric"  # "%ld Bytes -> Algo %d proto %d time %f"
        if t < (2, 24, 0):
            return "op_bytes_numeric"  # "%s: %ld Bytes -> Algo %d proto %d time %f"
        return "op_bytes_named"  # "%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}"

    @property
    def tuning_bytes_include_nranks(self) -> bool:
        """2.20-2.23 count AllGather/ReduceScatter TUNING bytes as the full buffer (x nranks)."""
        return (2, 20, 0) <= self.tuple < (2, 24, 0)

    @property
    def init_style(self) -> str:
        """Shape of the Init START/COMPLETE line."""
        t = self.tuple
        if t < (2, 16, 2):
            return "complete_only_no_commid"
        if t < (2, 18, 3):
            return "complete_only_no_nvml"
        if t < (2, 21, 5):
            return "base"
        if t < (2, 23, 0):
            return "literal_api"  # "ncclCommInitRank " / "ncclCommSplit ... parent color key commId"
        if t < (2, 24, 0):
            return "api_split_no_commid"
        if t < (2, 29, 0):
            return "api_split_count"
        return "api_child_count"

    @property
    def has_comm_info_line(self) -> bool:
        """``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d`` (>= 2.20)."""
        return self.tuple >= (2, 20, 0)

    @property
    def topo_node_style(self) -> str:
        """How topology node ids are printed: 'hex' (<=2.20), 'mixed' (2.21-2.22), 'sysid' (>=2.23)."""
        t = self.tuple
        if t < (2, 21, 0):
            return "hex"
        if t < (2, 23, 0):
            return "mixed"
        return "sysid"

    @property
    def ring_line_style(self) -> str:
        """<= 2.22 ``Channel %02d/%02d : `` + ``%3d`` (max 20 ranks); >= 2.23 width = digits."""
        return "fixed3" if self.tuple < (2, 23, 0) else "width"

    @property
    def supports_timestamps(self) -> bool:
        """NCCL_DEBUG_TIMESTAMP_LEVELS/FORMAT exist from 2.26."""
        return self.tuple >= (2, 26, 0)

    @property
    def has_bf16(self) -> bool:
        return self.tuple >= (2, 10, 0)

    @property
    def has_native_alltoall(self) -> bool:
        return self.tuple >= (2, 28, 0)

    @property
    def count_format_unsigned(self) -> bool:
        """2.22.3+ print ``count %zu`` (differs from ``%zi`` only for counts >= 2^63)."""
        return self.tuple >= (2, 22, 3)


def parse_version_line(text: str) -> tuple[NcclVersion, str, str] | None:
    """Extract (version, suffix, cuda 'major.minor') from a line containing ``NCCL version ...``."""
    m = VERSION_RE.search(text)
    if not m:
        return None
    return (
        NcclVersion(int(m.group(1)), int(m.group(2)), int(m.group(3))),
        m.group(4),
        f"{m.group(5)}.{m.group(6)}",
    )
