"""What a Snakemake invocation scheduled, read from its job table (not from words in its output:
a rule's name also appears in warnings, e.g. "Rules with missing metadata: ... parse_node")."""

from __future__ import annotations

import re


def scheduled_jobs(output: str) -> dict[str, int]:
    """Rule -> number of jobs from Snakemake's "Job stats" table (the first one printed), ``{}``
    when it said there was nothing to be done. Raises when the output has neither (an error, or a
    Snakemake whose output this no longer reads), so that no test passes on an empty count."""
    block = output.split("Job stats:", 1)
    if len(block) < 2:
        if "Nothing to be done" in output:
            return {}
        raise AssertionError(f"no job table and no 'Nothing to be done' in Snakemake's output:\n{output[-3000:]}")
    stats: dict[str, int] = {}
    for line in block[1].splitlines()[1:]:
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if not m:
            if stats:
                break
            continue  # the header and its rule
        if m.group(1) != "total":
            stats[m.group(1)] = int(m.group(2))
    if not stats:
        raise AssertionError(f"an empty job table:\n{block[1][:2000]}")
    return stats
