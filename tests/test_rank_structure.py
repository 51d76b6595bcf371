"""Global ranks from the communicators' structure alone (nccltrace.megatron.rank_structure):
certain only when exactly one assignment fits, never a wrong rank, bounded work."""

from __future__ import annotations

import random

import pytest

from nccltrace.megatron.groups import megatron_groups
from nccltrace.megatron.rank_structure import (
    ORDER_SETTING,
    candidate_layouts,
    solve_global_ranks,
)
from nccltrace.megatron.sizes import ParallelSizes

LAZY_KINDS = ("tp", "pp", "dp", "cp", "ep")  # what a lazily initialised job runs collectives on


def _job(kinds, seed: int = 1, pp_pairs: bool = False, **sizes):
    """Processes named at random (as pids are), the member lists of the ``kinds``' groups of more
    than one rank by rank in the communicator, and the true ranks. ``pp_pairs``: the pipeline's
    neighbours also get PyTorch's two-rank communicator (un-coalesced isend/irecv)."""
    s = ParallelSizes(**sizes)
    groups = megatron_groups(s)
    world = int(s.world_size)
    names = random.Random(seed).sample(range(10_000, 99_999), world)  # rank -> pid
    comms = [g for k in kinds for g in groups[k] if len(g) > 1]
    if pp_pairs:
        comms += [[a, b] for g in groups["pp"] for a, b in zip(g, g[1:])]
    random.Random(seed).shuffle(comms)
    return (sorted(names), [[names[r] for r in g] for g in comms], {names[r]: r for r in range(world)})


def _declared(**sizes):
    """The sizes as a run declares them, with Megatron's default rank order."""
    return {**{k: v for k, v in sizes.items() if k != "world_size"}, ORDER_SETTING: False}


def test_a_layout_whose_dimensions_differ_in_size_gives_the_true_ranks_once_its_sizes_are_declared():
    procs, comms, truth = _job(("tp", "dp"), tp=4, world_size=8)
    sol = solve_global_ranks(procs, comms, _declared(tp=4))
    assert sol.ranks == truth and sol.fits == 1
    assert "one assignment fits the declared sizes" in sol.reason


def test_without_declared_sizes_the_same_structure_fits_several_layouts_and_names_no_rank():
    """tp4·dp2 and tp2·dp4 (the four-rank groups tensor or data parallel) both fit, with
    different ranks: nothing is named."""
    procs, comms, _ = _job(("tp", "dp"), tp=4, world_size=8)
    sol = solve_global_ranks(procs, comms, None)
    assert sol.ranks is None and sol.fits >= 2 and "does not decide" in sol.reason


def test_two_dimensions_of_one_size_are_interchangeable_so_tp2_pp2_dp2_is_undecided():
    """The issue's job: tensor-, pipeline- and data-parallel pairs. Any of the three pair kinds
    could be any dimension; even with the sizes declared the structure cannot tell."""
    procs, comms, _ = _job(("tp", "pp", "dp"), pp_pairs=True, tp=2, pp=2, world_size=8)
    sol = solve_global_ranks(procs, comms, _declared(tp=2, pp=2))
    assert sol.ranks is None and sol.fits >= 2


def test_a_communicator_of_every_process_decides_alone_split_or_not():
    """Its members are all the ranks, in rank order (PyTorch sorts a group's ranks): the
    model-parallel group of a tp2·pp2 job of four ranks names them all."""
    procs, comms, truth = _job(("mp", "tp", "pp"), tp=2, pp=2, world_size=4)
    assert solve_global_ranks(procs, comms, None).ranks == truth


def test_ranks_another_source_named_are_kept_and_can_decide_the_rest():
    """With the true rank of two processes given, the pair kinds are no longer interchangeable."""
    procs, comms, truth = _job(("tp", "pp", "dp"), tp=2, pp=2, world_size=8)
    by_rank = {r: p for p, r in truth.items()}
    known = {by_rank[1]: 1, by_rank[2]: 2, by_rank[4]: 4}
    sol = solve_global_ranks(procs, comms, _declared(tp=2, pp=2), known=known)
    assert sol.ranks == truth
    wrong = {by_rank[1]: 0}  # a rank no assignment can give it
    assert solve_global_ranks(procs, comms, _declared(tp=2, pp=2), known={**known, **wrong}).ranks is None


def test_communicators_no_megatron_layout_has_fit_none_and_name_no_rank():
    procs = list(range(4))
    comms = [[0, 1, 2], [2, 3]]  # no layout of four ranks has a group of three
    sol = solve_global_ranks(procs, comms, None)
    assert sol.ranks is None and sol.fits == 0 and "no assignment fits" in sol.reason


def test_members_out_of_rank_order_fit_nothing():
    """One tensor-parallel communicator whose members run backwards: its data-parallel partners
    pair position i with position i, which no assignment in ascending order can satisfy."""
    procs, comms, _ = _job(("tp", "dp"), tp=4, world_size=8)
    first = next(i for i, c in enumerate(comms) if len(c) == 4)
    comms[first] = list(reversed(comms[first]))
    assert solve_global_ranks(procs, comms, _declared(tp=4)).fits == 0


def test_a_search_past_its_budget_stops_and_names_no_rank():
    procs, comms, _ = _job(("tp", "dp"), tp=4, world_size=8)
    sol = solve_global_ranks(procs, comms, None, budget=50)
    assert sol.exhausted and sol.ranks is None and "undecided" in sol.reason


def test_declared_sizes_that_do_not_describe_the_processes_are_said():
    procs, comms, _ = _job(("tp", "dp"), tp=4, world_size=8)
    sol = solve_global_ranks(procs, comms, {"tp": 4, "world_size": 16})
    assert sol.ranks is None and "describe 16 ranks, the logs 8 processes" in sol.reason


@pytest.mark.parametrize("world", [4, 8, 16])
def test_over_every_layout_of_a_world_the_structure_is_never_wrong_and_decides_where_sizes_differ(world):
    """Every layout Megatron accepts for the world, as a lazily initialised job leaves it (one
    communicator per group of its tp, pp, dp, cp and ep groups of two or more ranks, and the
    pipeline's neighbour pairs): a named rank is always the true one; with the sizes declared,
    layouts whose dimensions all differ in size are decided."""
    certain = {"declared": 0, "free": 0}
    cases = 0
    for sizes, order in candidate_layouts(world):
        if order != "tp-cp-ep-dp-pp" or sizes.expert_tp != sizes.tp:
            continue  # the jobs: every layout with Megatron's default order and etp (the solver tries all)
        kw = {k: getattr(sizes, k) for k in ("tp", "pp", "cp", "ep")}
        declared = {**kw, ORDER_SETTING: False}
        try:
            procs, comms, truth = _job(LAZY_KINDS, pp_pairs=sizes.pp > 1, world_size=world, **kw)
        except ValueError:
            continue
        if not comms:
            continue
        cases += 1
        for how, settings in (("declared", declared), ("free", None)):
            sol = solve_global_ranks(procs, comms, settings)
            assert sol.ranks is None or sol.ranks == truth, (kw, how, sol.reason)
            certain[how] += sol.ranks is not None
        distinct = sorted(v for k, v in kw.items() if v > 1) + ([int(sizes.dp)] if sizes.dp > 1 else [])
        if len(distinct) == len(set(distinct)) and len(distinct) >= 2 and sizes.ep == 1 and sizes.cp == 1:
            # tp, pp, dp all of different sizes: with the sizes declared, one assignment
            assert solve_global_ranks(procs, comms, declared).ranks == truth, kw
    assert cases and certain["declared"] >= certain["free"]


@pytest.mark.slow
def test_the_validation_table_solves_emulated_lazy_jobs_and_never_names_a_wrong_rank(tmp_path):
    """`validate --only communicators`'s table on two emulated lazy jobs (no default-group
    NCCL): TP4·DP2 decided with its sizes declared, not without; TP2·PP2·DP2 undecided."""
    from nccltrace.validation.communicators import structure_accuracy

    table = structure_accuracy(["tp4_dp2_2nodes", "tp2_pp2_dp2_2nodes"], tmp_path).set_index("config")
    assert not table["world_communicator"].any()
    assert table.loc["tp4_dp2_2nodes", "declared sizes"] == "certain"
    assert table.loc["tp4_dp2_2nodes", "no sizes"].endswith("fit")
    assert table.loc["tp2_pp2_dp2_2nodes", "declared sizes"].endswith("fit")
    assert not (table[["declared sizes", "no sizes"]] == "WRONG").any().any()


def test_the_group_sizes_known_from_the_sizes_alone_cover_every_group_built():
    """The solver skips a layout whose group sizes (computed from its sizes, without building
    the groups) lack a communicator's size; a size missing there would skip a layout that fits,
    and a unique answer could then be wrong."""
    from nccltrace.megatron.groups import PAIR_DIMS
    from nccltrace.megatron.rank_structure import _group_sizes

    for world in (4, 8, 12, 16):
        for sizes, order in candidate_layouts(world):
            groups = megatron_groups(sizes, order)
            built = {len(g[0]) for g in groups.values() if g}
            built |= {2} if any(len(g[0]) >= 2 for k, g in groups.items() if k in PAIR_DIMS and g) else set()
            assert built <= _group_sizes(sizes), (sizes, order)


def test_real_megatron_core_groups_from_flight_recorder_dumps_give_the_true_ranks():
    """The process groups of four real 16-rank Megatron-Core MoE jobs (TP2·DP2·PP4·EP4 and
    TP4·DP2·PP2·EP8, ETP1), as their Flight Recorder dumps list them, without the groups of every
    rank: under the declared sizes every rank right, whether every group ran a collective or only
    those in the dumps' last entries; without the sizes never a wrong rank."""
    from data_paths import FR_MEGATRON16

    from nccltrace.pytorch.flight_recorder import read_dump

    base = FR_MEGATRON16  # tests/data/real/flight_recorder_megatron16
    layouts = {"gpu_error_1st": {"tp": 2, "pp": 4, "ep": 4, "etp": 1}, "lock_gil_2nd": {"tp": 2, "pp": 4, "ep": 4, "etp": 1},
               "gpu_error_2nd": {"tp": 4, "pp": 2, "ep": 8, "etp": 1}, "lock_gil_1st": {"tp": 4, "pp": 2, "ep": 8, "etp": 1}}
    decided_free = 0
    for scenario, sizes in layouts.items():
        dumps = [read_dump(base / scenario / f"_dump_{r}") for r in range(16)]
        groups = {name: tuple(ranks) for d in dumps for name, (ranks, _) in d.groups.items()}
        ran = {e["process_group"][0] for d in dumps for e in d.entries}
        pids = random.Random(scenario).sample(range(1000, 99_999), 16)
        truth = {pids[r]: r for r in range(16)}
        for chosen in (set(groups), ran):
            comms = [[pids[r] for r in groups[n]] for n in sorted(chosen) if 1 < len(groups[n]) < 16]
            assert solve_global_ranks(sorted(pids), comms, {**sizes, ORDER_SETTING: False}).ranks == truth, scenario
            free = solve_global_ranks(sorted(pids), comms, None)
            assert free.ranks in (None, truth), scenario
            decided_free += free.ranks is not None
    assert decided_free >= 4  # every group known: the structure decides even without the sizes
