"""TEST DOUBLE for `torchrun ... pretrain_gpt.py <Megatron args>` (no GPU here).

Reads the run from the real torchrun and Megatron-LM arguments the launch script passes (nodes,
node rank, GPUs per node, model, parallelism, precision, MoE, VPP), emulates it with the
workload emulator, and writes this node's outputs exactly where the real processes would:
one NCCL debug log per rank at NCCL_DEBUG_FILE (with %h and %p expanded), and, when running
under the nsys test double, the node's Nsight Systems data at the path it hands over in
NCCLTRACE_FAKE_NSYS_REPORT.

Test-only knobs (environment):
  NCCLTRACE_FAKE_SETTINGS   JSON of emulator-only settings (nccl_version, nsys_version, seed,
                            hardware, imperfections, ...)
  FAKE_TORCHRUN_EXIT_CODE   fail like a crashed training run with this exit code
  FAKE_TORCHRUN_SLEEP       seconds to sleep first (a slow run, for interruption tests)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path


def _torchrun_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        key, sep, value = argv[i][2:].partition("=")
        if not sep:
            i += 1
            value = argv[i]
        opts[key.replace("-", "_")] = value
        i += 1
    return opts, argv[i:]


def main(argv: list[str]) -> int:
    from nccltrace.acquisition.megatron import parse_megatron_arguments
    from nccltrace.emulator.run import emulate_run

    opts, rest = _torchrun_args(argv)
    if not rest:
        print("fake torchrun: no training script given", file=sys.stderr)
        return 2
    script, megatron_argv = rest[0], rest[1:]
    print(f"[fake torchrun] {script} on node {opts.get('node_rank')} of {opts.get('nnodes')}; "
          f"rendezvous {opts.get('rdzv_endpoint')}", flush=True)
    if os.environ.get("FAKE_TORCHRUN_SLEEP"):
        time.sleep(float(os.environ["FAKE_TORCHRUN_SLEEP"]))
    code = int(os.environ.get("FAKE_TORCHRUN_EXIT_CODE", "0") or 0)
    if code:
        print(f"[fake torchrun] RuntimeError: CUDA error: out of memory (injected failure, exit {code})",
              file=sys.stderr, flush=True)
        return code
    nnodes, node_rank = int(opts.get("nnodes", 1)), int(opts.get("node_rank", 0))
    gpn = int(opts.get("nproc_per_node", 1))
    host = socket.gethostname().split(".")[0]
    settings = parse_megatron_arguments(megatron_argv)
    settings.pop("seed", None)
    settings.update(json.loads(os.environ.get("NCCLTRACE_FAKE_SETTINGS", "{}")))
    settings.update(nodes=nnodes, gpus_per_node=gpn, model="fake",
                    host_names=[host if n == node_rank else f"{host}-n{n}" for n in range(nnodes)])
    with tempfile.TemporaryDirectory(prefix="fake_torchrun_") as tmp:
        emulate_run(settings, Path(tmp))
        pattern = os.environ.get("NCCL_DEBUG_FILE")
        if pattern:
            for log in sorted((Path(tmp) / "nccl").glob(f"nccl_{host}_*.log")):
                pid = log.stem.rsplit("_", 1)[1]
                dst = Path(pattern.replace("%h", host).replace("%p", pid))
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, dst)
        handoff = os.environ.get("NCCLTRACE_FAKE_NSYS_REPORT")
        export = Path(tmp) / "nsys" / f"{host}.sqlite"
        if handoff and export.exists():  # none when no rank here profiles (--profile-ranks)
            shutil.copyfile(export, handoff)
    print(f"[fake torchrun] training finished ({settings.get('iterations')} iterations)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
