"""The workflow's import backend (acquisition.raw.import_raw) on runs that left only some of the
four evidence sources (NCCL logs, nsys exports, PyTorch-profiler traces, Flight Recorder dumps),
each found by content: the real H200 capture's traces, dumps and logs
(tests/data/real/torch_nccl228_h200_tp2pp2) and a real nsys 2026 export
(tests/data/real/nsys_sqlite), copied under names that say nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from data_paths import CAPTURE, NSYS_SQLITE

from nccltrace.acquisition.raw import RawImportError, import_raw
from nccltrace.acquisition.status import read_status
from nccltrace.kineto.reader import is_kineto_trace
from nccltrace.pytorch.flight_recorder import read_dump

SETTINGS = {"tp": 2, "pp": 2, "nodes": 1, "gpus_per_node": 4}


def _copy(src_dir: Path, dst: Path, rename: str) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(sorted(src_dir.iterdir())):
        suffix = "".join(p.suffixes) if rename != "pickle" else ""
        shutil.copyfile(p, dst / f"{rename}{i}{suffix}")


def _import(src: Path, tmp_path: Path) -> tuple[dict, Path]:
    raw = tmp_path / "raw"
    record = import_raw(src, raw, run_id="r", settings=SETTINGS)
    assert json.loads((raw / "launch" / "import.json").read_text()) == record
    status = read_status(raw)
    assert status["status"] == "ok" and status["sources"] == record["sources"]
    assert status["source_counts"] == record["source_counts"]
    return record, raw


def test_a_run_that_left_only_profiler_traces_is_imported_with_them(tmp_path):
    src = tmp_path / "elsewhere"
    _copy(CAPTURE / "kineto", src / "prof", "worker")  # worker0.json.gz ...: found by content
    (src / "notes.txt").write_text("nothing to see\n")
    record, raw = _import(src, tmp_path)
    assert record["sources"] == ["profiler-trace"] and record["processes"] == 0 and record["exports"] == []
    assert record["source_counts"] == {"nccl-log": 0, "nsys-export": 0, "profiler-trace": 4, "flight-recorder": 0}
    traces = sorted((raw / "kineto").iterdir())
    assert [p.name for p in traces] == [f"worker{i}.json.gz" for i in range(4)] and all(map(is_kineto_trace, traces))
    assert not (raw / "nccl").exists() and not (raw / "nsys").exists() and (raw / "run.yaml").is_file()
    assert any("no NCCL debug log found" in w and "4 PyTorch-profiler traces only" in w for w in record["warnings"])


def test_a_run_that_left_only_flight_recorder_dumps_is_imported_with_them(tmp_path):
    src = tmp_path / "elsewhere"
    _copy(CAPTURE / "flight_recorder", src, "pickle")  # no suffix at all
    (src / "junk.pkl").write_bytes(b"\x80\x04K\x01.")  # a pickle, not a dump: a warning, not a source
    record, raw = _import(src, tmp_path)
    assert record["sources"] == ["flight-recorder"] and record["source_counts"]["flight-recorder"] == 4
    dumps = sorted((raw / "flight_recorder").iterdir())
    assert len(dumps) == 4 and sorted(read_dump(p).rank for p in dumps) == [0, 1, 2, 3]
    assert any("not used as a Flight Recorder dump" in w and "junk.pkl" in w for w in record["warnings"])


def test_a_run_that_left_one_nsys_export_only_is_imported_under_its_host(tmp_path):
    src = tmp_path / "elsewhere"
    src.mkdir()
    shutil.copyfile(NSYS_SQLITE / "nsysai_mfu_2gpu_before.sqlite", src / "profile.sqlite")
    record, raw = _import(src, tmp_path)
    assert record["sources"] == ["nsys-export"] and record["exports"] == ["modal"]  # the host recorded in it
    assert record["source_counts"]["nsys-export"] == 1 and (raw / "nsys" / "modal.sqlite").is_file()
    assert any("no NCCL debug log found" in w and "1 nsys exports only" in w for w in record["warnings"])


def test_a_mix_with_logs_lists_every_source_and_logs_alone_are_imported(tmp_path):
    src = tmp_path / "elsewhere"
    _copy(CAPTURE / "nccl", src / "logs", "rank")
    _copy(CAPTURE / "kineto", src / "prof", "t")
    _copy(CAPTURE / "flight_recorder", src / "fr", "pickle")
    record, raw = _import(src, tmp_path)
    assert record["sources"] == ["nccl-log", "profiler-trace", "flight-recorder"] and record["processes"] == 4
    assert len(list((raw / "nccl").glob("nccl_*.log"))) == 4 and len(list((raw / "kineto").iterdir())) == 4
    assert not any("no NCCL debug log" in w or "no kernel trace" in w for w in record["warnings"])
    shutil.rmtree(src / "prof")
    shutil.rmtree(src / "fr")
    logs_only, _ = _import(src, tmp_path / "again")
    assert logs_only["sources"] == ["nccl-log"]
    assert any("no kernel trace" in w and "torch.profiler" in w for w in logs_only["warnings"])


def test_a_directory_without_any_source_is_refused_naming_what_was_looked_for_and_found(tmp_path):
    src = tmp_path / "elsewhere"
    src.mkdir()
    with pytest.raises(RawImportError) as empty:
        import_raw(src, tmp_path / "raw", run_id="r", settings=SETTINGS)
    msg = str(empty.value)
    for looked_for in ("no NCCL debug log found", "NCCL_DEBUG=INFO", "no nsys export (*.sqlite)", "*.nsys-rep",
                       "no PyTorch-profiler trace", "no Flight Recorder dump"):  # fmt: skip
        assert looked_for in msg, looked_for
    assert msg.endswith("found no file")
    (src / "train.log").write_text("iteration 1 loss 2.3\n")
    (src / "broken.pkl").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(RawImportError, match=r"found 2 file\(s\): broken.pkl, train.log; set aside: not used as a "
                       r"Flight Recorder dump"):  # fmt: skip
        import_raw(src, tmp_path / "raw", run_id="r", settings=SETTINGS)
