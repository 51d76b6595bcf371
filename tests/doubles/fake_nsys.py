"""TEST DOUBLE for the `nsys` command line (Nsight Systems needs a GPU to capture CUDA).

  nsys --version                  prints a version marked as a test double
  nsys profile [options] CMD ...  runs CMD with NCCLTRACE_FAKE_NSYS_REPORT pointing at a scratch
                                  file the torchrun double fills; stores it as <output>.nsys-rep
                                  (option syntax as the real CLI: --output X, -o X, --opt=value)
  nsys export --help              the real 2022.4 option list
  nsys export --type sqlite -o OUT REPORT
                                  writes the SQLite data kept in the fake report to OUT

The fake report is a marker line followed by SQLite data (a real .nsys-rep is neither); only the
double's export reads it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MAGIC = b"NCCLTRACE-FAKE-NSYS-REPORT\n"
VERSION = "NVIDIA Nsight Systems version 2022.4.2.1-fake (test double)"
EXPORT_HELP = """usage: nsys export [<args>] [nsys-rep-file]

\t--force-overwrite=<true|false>
\t--help
\t--lazy=<true|false>
\t-o, --output=<path>
\t-q, --quiet=<true|false>
\t--separate-strings=<true|false>
\t-t, --type=<sqlite|hdf|text|arrow|json|info>
"""


def _profile(argv: list[str]) -> int:
    output = "report1"
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if arg in ("-o", "--output"):
            output = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--output="):
            output = arg.split("=", 1)[1]
        elif not arg.startswith("--") and "=" not in arg:
            i += 1  # short option with a separate value, e.g. -t cuda
        i += 1
    command = argv[i:]
    if not command:
        print("fake nsys profile: no application to profile", file=sys.stderr)
        return 1
    output = output.replace("%h", os.uname().nodename.split(".")[0]).replace("%p", str(os.getpid()))
    fd, scratch = tempfile.mkstemp(suffix=".sqlite", prefix="fake_nsys_")
    os.close(fd)
    os.unlink(scratch)
    env = dict(os.environ, NCCLTRACE_FAKE_NSYS_REPORT=scratch)
    code = subprocess.call(command, env=env)
    if os.path.exists(scratch):
        report = output if output.endswith(".nsys-rep") else output + ".nsys-rep"
        with open(report, "wb") as dst, open(scratch, "rb") as src:
            dst.write(MAGIC)
            shutil.copyfileobj(src, dst)
        os.unlink(scratch)
        print(f"Generated:\n    {report}")
    return code


def _export(argv: list[str]) -> int:
    if "--help" in argv:
        print(EXPORT_HELP)
        return 0
    out, kind, positional = None, None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-o", "--output", "-t", "--type"):
            value = argv[i + 1]
            i += 2
            if arg in ("-o", "--output"):
                out = value
            else:
                kind = value
            continue
        if arg.startswith("--output="):
            out = arg.split("=", 1)[1]
        elif arg.startswith("--type="):
            kind = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            positional.append(arg)
        i += 1
    if kind != "sqlite" or out is None or len(positional) != 1:
        print("fake nsys export: need --type sqlite -o OUT REPORT", file=sys.stderr)
        return 1
    if not Path(positional[0]).is_file():
        print(f"fake nsys export: {positional[0]}: no such file", file=sys.stderr)
        return 1
    with open(positional[0], "rb") as src:
        if src.read(len(MAGIC)) != MAGIC:
            print(f"Exportation error: {positional[0]}: not a report of the nsys test double", file=sys.stderr)
            return 1
        with open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("--version", "-v"):
        print(VERSION)
        return 0
    if argv[0] == "profile":
        return _profile(argv[1:])
    if argv[0] == "export":
        return _export(argv[1:])
    print(f"fake nsys: unsupported command {argv[0]!r}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
