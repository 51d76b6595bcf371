"""``nccltrace infer-layout``: the command behind the subcommand (kept light to import)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "infer Megatron parallel sizes (tp, cp, dp, pp, ep, etp) from communicator member sets"

DESCRIPTION = """\
Infer a Megatron-LM job's parallel sizes from the member sets (global ranks) of the
communicators seen, e.g. from NCCL init lines or Flight Recorder's pg_config.

Input: a directory (or file) of PyTorch Flight Recorder dumps, found by content (one pickled
dict per rank, any name; only plain values are read), or GROUPS.json:
  {"world_size": 16,
   "groups": [[0, 1], [0, 4, 8, 12], {"ranks": [0, 12], "desc": "EMBEDDING_GROUP"}, ...]}
  A group is a list of global ranks, or an object with "ranks" and an optional "desc": the
  PyTorch group description Megatron gave it (TENSOR_MODEL_PARALLEL_GROUP, ...; or a kind
  such as tp, dp-cp, ep). A desc pins the group's kind; without descs only member sets count.
  From dumps: every rank's pg_config (member ranks and Megatron's desc of each group) and, for
  ranking, which collectives each group's recorded entries ran. --no-names ignores the descs
  (what member sets and behaviour alone decide).

Method: every size tuple Megatron accepts for the world (tp*cp*dp*pp = world,
etp*ep*edp*pp = world, the order's constraints) generates its groups; a candidate is
consistent when it explains every observed group (single ranks and the world explain
themselves unless described).

Output (JSON on stdout):
  sizes       tp, cp, dp, pp, ep, etp: a value only when every consistent candidate agrees,
              null ("unknown") otherwise; values lists what is still possible
  most_likely the best-ranked consistent candidate (all six sizes) with the evidence that
              ranks it first (the busiest group is tp, all-to-all groups are ep, Send/Recv
              groups are pp; cp = 1 and etp = 1 unless evidence says otherwise) and the
              runner-up; a ranking, never a certainty (see sizes)
  candidates  the consistent size tuples (the best-fitting ones if none is consistent,
              "consistent": false); "ambiguous" is true when there are several
  evidence    per size, a minimal set of observed group shapes that pins it
  groups      every input group with its possible kinds ("labels"), the kinds it has under
              every candidate ("certain"), or "unexplained"
Member sets alone often cannot decide (cp=1,dp=d and cp=d,dp=1 create identical member
sets; so can etp/ep splits): the result then says unknown instead of guessing.

Exit status 0 on success, 2 on a malformed or missing input file.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument("groups_json", metavar="PATH",
                        help="a directory (or file) of Flight Recorder dumps, or a JSON file "
                             "{\"world_size\": N, \"groups\": [...]}")
    parser.add_argument("--no-names", action="store_true",
                        help="ignore the groups' names (desc): infer from member sets and behaviour alone")
    parser.add_argument("--order", action="append", metavar="ORDER",
                        help="a Megatron rank order to try; repeat to try several (default: the default "
                             "order tp-cp-ep-dp-pp; runs with --use-tp-pp-dp-mapping use tp-cp-ep-pp-dp)")  # fmt: skip


def cmd_infer_layout(args: argparse.Namespace) -> int:
    """Run the inference on GROUPS.json and print the result as JSON."""
    from nccltrace.megatron.groups import DEFAULT_ORDER
    from nccltrace.megatron.infer import infer_layout, read_layout_input

    path = Path(args.groups_json)
    ops = None
    if path.is_dir() or (path.is_file() and path.read_bytes()[:1] == b"\x80"):
        from nccltrace.pytorch.flight_recorder import (
            find_dumps,
            group_ops,
            layout_input,
        )

        dumps = find_dumps(path)
        world, groups, descs = layout_input(dumps, names=not args.no_names)
        ops = group_ops(dumps)
        print(f"infer-layout: {len(dumps)} Flight Recorder dump(s), {len(groups)} distinct group(s)"
              + (" (names ignored)" if args.no_names else ""), file=sys.stderr)
    else:
        world, groups, descs = read_layout_input(path)
        if args.no_names:
            descs = None
    try:
        res = infer_layout(world, groups, descs=descs, orders=tuple(args.order or (DEFAULT_ORDER,)), ops=ops)
    except ValueError as exc:
        raise ValueError(f"--order: {exc}") from None
    print(res.to_json())
    known = ", ".join(f"{k}={v}" for k, v in res.sizes.items() if v is not None) or "none"
    unknown = ", ".join(k for k, v in res.sizes.items() if v is None)
    state = "determined" if res.layout else f"{len(res.candidates)} candidates"
    print(f"infer-layout: {state}; known: {known}" + (f"; unknown: {unknown}" if unknown else ""), file=sys.stderr)
    if res.most_likely and not res.layout:
        ml = res.most_likely
        print("infer-layout: most likely " + ", ".join(f"{k}={ml[k]}" for k in ("tp", "cp", "dp", "pp", "ep", "etp"))
              + (f" (tied with {ml['tied']} other(s))" if ml.get("tied") else ""), file=sys.stderr)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
