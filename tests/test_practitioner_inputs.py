"""The practitioner's path (issue: one pipeline of stages): `nccltrace analyze` on logs and
exports as users have them, not as our launcher names them."""

from __future__ import annotations

import json
import re

import pytest

from nccltrace.cli import main
from nccltrace.emulator.run import emulate_run
from nccltrace.tables import read_table
from nccltrace.validation.alignment import SCENARIO_BASE

CALL = re.compile(rb"NCCL INFO \w+: opCount")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """1-node TP2.PP2 run, 4 ranks, NCCL 2.21.5, grouped P2P."""
    raw = tmp_path_factory.mktemp("practitioner") / "raw"
    emulate_run({**SCENARIO_BASE, "iterations": 2, "seed": 3, "imperfections": {"fuse_grouped_p2p": True}}, raw)
    return raw


def test_logs_with_call_lines_only_are_analysed_with_inferred_communicators_and_flagged(small_run, tmp_path, capsys):
    """NCCL_DEBUG_SUBSYS=COLL: no init lines. Communicators come from the call sequences, the
    run is partial with a message that says so and how to get exact ones (was: 'No objects
    to concatenate')."""
    import shutil

    raw = tmp_path / "raw"
    shutil.copytree(small_run, raw)
    for log in (raw / "nccl").glob("*.log"):
        log.write_bytes(b"".join(line for line in log.read_bytes().splitlines(True) if CALL.search(line)))
    assert main(["analyze", str(raw), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "communicators inferred from call sequences" in err and "NCCL_DEBUG_SUBSYS=INIT" in err
    comms = read_table(tmp_path / "out" / "communicators" / "communicators.parquet")
    assert len(comms) and set(comms["kind"].astype(str)) == {"sequence"}
    ops = read_table(tmp_path / "out" / "ops" / "ops.parquet")
    calls = ops[ops["row_kind"] == "call"]
    assert (calls["status"] == "matched").mean() > 0.9
    manifest = json.loads((tmp_path / "out" / "ops" / "manifest.json").read_text())
    assert manifest["partial"]
