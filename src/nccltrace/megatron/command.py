"""``nccltrace infer-layout``: the command behind the subcommand (kept light to import)."""

from __future__ import annotations

import argparse
import sys

HELP = "infer Megatron parallel sizes (tp, cp, dp, pp, ep, etp) from communicator member sets"

DESCRIPTION = """\
Infer a Megatron-LM job's parallel sizes from the member sets (global ranks) of the
communicators seen, e.g. from NCCL init lines or Flight Recorder's pg_config.

Input (GROUPS.json):
  {"world_size": 16,
   "groups": [[0, 1], [0, 4, 8, 12], {"ranks": [0, 12], "desc": "EMBEDDING_GROUP"}, ...]}
  A group is a list of global ranks, or an object with "ranks" and an optional "desc": the
  PyTorch group description Megatron gave it (TENSOR_MODEL_PARALLEL_GROUP, ...; or a kind
  such as tp, dp-cp, ep). A desc pins the group's kind; without descs only member sets count.

Method: every size tuple Megatron accepts for the world (tp*cp*dp*pp = world,
etp*ep*edp*pp = world, the order's constraints) generates its groups; a candidate is
consistent when it explains every observed group (single ranks and the world explain
themselves unless described).

Output (JSON on stdout):
  sizes       tp, cp, dp, pp, ep, etp: a value only when every consistent candidate agrees,
              null ("unknown") otherwise; values lists what is still possible
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
    parser.add_argument("groups_json", metavar="GROUPS.json", help="JSON file {\"world_size\": N, \"groups\": [...]}")
    parser.add_argument("--order", action="append", metavar="ORDER",
                        help="a Megatron rank order to try; repeat to try several (default: the default "
                             "order tp-cp-ep-dp-pp; runs with --use-tp-pp-dp-mapping use tp-cp-ep-pp-dp)")  # fmt: skip


def cmd_infer_layout(args: argparse.Namespace) -> int:
    """Run the inference on GROUPS.json and print the result as JSON."""
    from .groups import DEFAULT_ORDER
    from .infer import infer_layout, read_layout_input

    world, groups, descs = read_layout_input(args.groups_json)
    try:
        res = infer_layout(world, groups, descs=descs, orders=tuple(args.order or (DEFAULT_ORDER,)))
    except ValueError as exc:
        raise ValueError(f"--order: {exc}") from None
    print(res.to_json())
    known = ", ".join(f"{k}={v}" for k, v in res.sizes.items() if v is not None) or "none"
    unknown = ", ".join(k for k, v in res.sizes.items() if v is None)
    state = "determined" if res.layout else f"{len(res.candidates)} candidates"
    print(f"infer-layout: {state}; known: {known}" + (f"; unknown: {unknown}" if unknown else ""), file=sys.stderr)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
