"""``nccltrace infer-layout``: Megatron parallel sizes from communicator member sets.

Real check: PyTorch Flight Recorder dumps of a real 16-rank Megatron-Core MoE job
(``tests/data/real/flight_recorder_megatron16``, its README.md gives the source). Every dump's
``pg_config`` lists the rank's process groups with Megatron's own names (``desc``) and member
ranks; ``entries`` the recorded ops with their group.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_paths import FR_MEGATRON16

from nccltrace.campaign.matrix import expand_campaign, load_campaign
from nccltrace.cli import main
from nccltrace.emulator.config import EmulatorConfig
from nccltrace.emulator.layout import layout_of
from nccltrace.emulator.layout import orthogonal_groups as layout_orthogonal_groups
from nccltrace.megatron.groups import (
    DEFAULT_ORDER,
    megatron_groups,
    order_problem,
    orthogonal_groups,
)
from nccltrace.megatron.infer import KIND_LABEL, SIZE_NAMES, infer_layout, kind_of_desc
from nccltrace.megatron.sizes import ParallelSizes

REPO = Path(__file__).resolve().parents[1]
FR = FR_MEGATRON16
SCENARIOS = ("gpu_error_1st", "gpu_error_2nd", "lock_gil_1st", "lock_gil_2nd")

# Read off Megatron's own group names in pg_config (test_truth_is_what_the_group_names_say).
# The data's source notes gave TP 2 x DP 2 x PP 4, EP 4 for the job; that holds for two scenarios
# only: gpu_error_2nd and lock_gil_1st come from a TP 4 x DP 2 x PP 2, EP 8 run.
TP2 = {"tp": 2, "cp": 1, "dp": 2, "pp": 4, "ep": 4, "etp": 1}
TP4 = {"tp": 4, "cp": 1, "dp": 2, "pp": 2, "ep": 8, "etp": 1}
TRUTH = {"gpu_error_1st": TP2, "gpu_error_2nd": TP4, "lock_gil_1st": TP4, "lock_gil_2nd": TP2}

# What the member sets alone determine (proved by the brute-force oracle below and by the
# witnesses in test_member_sets_alone_cannot_tell_tp_cp_dp_ep_apart).
SETS_DETERMINE = {"gpu_error_1st": {"pp": 4}, "gpu_error_2nd": {}, "lock_gil_1st": {}, "lock_gil_2nd": {"pp": 4}}


def _load(scenario: str) -> tuple[dict[str, tuple[list[int], str]], set[str]]:
    """pg name -> (member ranks, desc), union over the 16 dumps; names the entries ran on."""
    d = FR / scenario
    groups: dict[str, tuple[list[int], str]] = {}
    used: set[str] = set()
    for rank in range(16):
        with open(d / f"_dump_{rank}", "rb") as fh:
            dump = pickle.load(fh)  # plain dicts/lists/str/int (tests/data/real/flight_recorder_megatron16/README.md)
        for pg in dump["pg_config"].values():
            groups[pg["name"]] = (json.loads(pg["ranks"]), pg["desc"])
        used |= {e["process_group"][0] for e in dump["entries"]}
    return groups, used


def _truth_tuple(t: dict[str, int]) -> tuple[int, ...]:
    return tuple(t[n] for n in SIZE_NAMES)


def _cand_tuples(res) -> set[tuple[int, ...]]:
    return {tuple(c[n] for n in SIZE_NAMES) for c in res.candidates}


# --------------------------------------------------------------------------- brute-force oracle
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _oracle(world: int, groups, descs=None, orders=(DEFAULT_ORDER,)) -> set[tuple[int, ...]]:
    """Consistent size tuples by generating every group of every candidate (slow, obvious)."""
    out = set()
    for order in orders:
        for tp in _divisors(world):
            for cp in _divisors(world // tp):
                for dp in _divisors(world // tp // cp):
                    pp = world // tp // cp // dp
                    for etp in _divisors(world // pp):
                        for ep in _divisors(world // pp // etp):
                            s = ParallelSizes(world_size=world, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)
                            if order_problem(s, order):
                                continue
                            kinds_of: dict[tuple[int, ...], set[str]] = {}
                            for kind, gs in megatron_groups(s, order).items():
                                for g in gs:
                                    kinds_of.setdefault(tuple(g), set()).add(kind)
                            ok = True
                            for i, g in enumerate(groups):
                                members = tuple(sorted(g))
                                kind = kind_of_desc(descs[i]) if descs and descs[i] else None
                                have = kinds_of.get(members, set())
                                if (kind is not None and kind not in have) or (
                                        kind is None and 1 < len(members) < world and not have):
                                    ok = False
                                    break
                            if ok:
                                out.add((tp, cp, dp, pp, ep, etp))
    return out


# --------------------------------------------------------------------------- the real job
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_truth_is_what_the_group_names_say(scenario):
    groups, _ = _load(scenario)
    by_desc: dict[str, list[list[int]]] = {}
    for ranks, desc in groups.values():
        by_desc.setdefault(desc, []).append(ranks)
    size = {d: {len(g) for g in gs} for d, gs in by_desc.items()}
    tp = size["TENSOR_MODEL_PARALLEL_GROUP"].pop()
    cp = size["TENSOR_AND_CONTEXT_PARALLEL_GROUP"].pop() // tp
    dp = size["DATA_PARALLEL_GROUP_WITH_CP"].pop() // cp
    pp = size["PIPELINE_MODEL_PARALLEL_GROUP"].pop()
    ep = size["EXPERT_MODEL_PARALLEL_GROUP"].pop()
    etp = size["EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"].pop() // ep
    assert {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "etp": etp} == TRUTH[scenario]
    assert tp * cp * dp * pp == 16
    # Megatron's ordering: tp innermost (stride 1), pp outermost (stride 16/pp).
    assert min(by_desc["TENSOR_MODEL_PARALLEL_GROUP"]) == list(range(tp))
    assert min(by_desc["PIPELINE_MODEL_PARALLEL_GROUP"]) == list(range(0, 16, 16 // pp))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_all_pg_config_groups_with_megatron_names_give_the_exact_layout(scenario):
    groups, _ = _load(scenario)
    names = sorted(groups, key=int)
    ranks = [groups[n][0] for n in names]
    descs = [groups[n][1] for n in names]
    res = infer_layout(16, ranks, descs=descs)
    assert res.consistent and not res.ambiguous
    assert res.sizes == TRUTH[scenario]
    assert res.layout is not None and _cand_tuples(res) == {_truth_tuple(TRUTH[scenario])}
    assert all(res.evidence[n]["pinned_by"] for n in ("tp", "pp", "ep"))
    # Every group is labelled with the kind its Megatron name says, under every candidate, and
    # its labels are exactly the kinds Megatron creates with these members under the truth.
    truth_kinds: dict[tuple[int, ...], set[str]] = {}
    for kind, gs in megatron_groups(ParallelSizes(world_size=16, **TRUTH[scenario])).items():
        for g in gs:
            truth_kinds.setdefault(tuple(g), set()).add(KIND_LABEL[kind])
    assert len(res.groups) == len(names)
    for g, desc in zip(res.groups, descs):
        assert g["explained"] and g["desc"] == desc
        assert KIND_LABEL[kind_of_desc(desc)] in g["certain"], (desc, g)
        assert set(g["certain"]) == set(g["labels"]) == truth_kinds[tuple(g["ranks"])]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_all_pg_config_member_sets_alone_determine_only_what_they_can(scenario):
    groups, _ = _load(scenario)
    ranks = [groups[n][0] for n in sorted(groups, key=int)]
    res = infer_layout(16, ranks)
    assert res.consistent and res.ambiguous and res.layout is None
    determined = {n: v for n, v in res.sizes.items() if v is not None}
    assert determined == SETS_DETERMINE[scenario]
    assert all(TRUTH[scenario][n] == v for n, v in determined.items())  # nothing wrong
    assert all(TRUTH[scenario][n] in res.values[n] for n in SIZE_NAMES)
    assert _truth_tuple(TRUTH[scenario]) in _cand_tuples(res)
    assert _cand_tuples(res) == _oracle(16, ranks)
    if "pp" in determined:  # the embedding groups (first + last stage) pin pp
        (pin,) = res.evidence["pp"]["pinned_by"]
        assert pin["example"] == [0, 12] and pin["labels"] == ["embedding"]
    # Each group is labelled with (at least) the kind its Megatron name says.
    for g, n in zip(res.groups, sorted(groups, key=int)):
        assert KIND_LABEL[kind_of_desc(groups[n][1])] in g["labels"]
    assert any("desc" in note for note in res.notes)


def test_member_sets_alone_cannot_tell_tp_cp_dp_ep_apart():
    """Witnesses: other layouts generate every member set of gpu_error_1st's pg_config."""
    groups, _ = _load("gpu_error_1st")
    observed = {tuple(r) for r, _ in groups.values()}
    for other in ({"tp": 2, "cp": 2, "dp": 1, "pp": 4, "ep": 4, "etp": 1},   # cp and dp swap
                  {"tp": 2, "cp": 1, "dp": 2, "pp": 4, "ep": 2, "etp": 2},   # etp*ep split differently
                  {"tp": 1, "cp": 2, "dp": 2, "pp": 4, "ep": 1, "etp": 2}):  # tp-pp set is expert tp-ep-pp
        generated = {tuple(g) for gs in megatron_groups(ParallelSizes(world_size=16, **other)).values() for g in gs}
        assert observed <= generated, other


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_b_groups_the_recorded_ops_ran_on(scenario):
    groups, used = _load(scenario)
    names = sorted(used, key=int)
    assert len(names) >= 8
    ranks = [groups[n][0] for n in names]
    # Member sets alone: tp pairs / quads, pipeline groups, expert groups - no embedding group,
    # so not even pp is pinned (a pipeline group could be a data-parallel group of pp = 1).
    res = infer_layout(16, ranks)
    assert res.consistent and res.ambiguous
    assert res.sizes == dict.fromkeys(SIZE_NAMES)
    assert _truth_tuple(TRUTH[scenario]) in _cand_tuples(res)
    assert _cand_tuples(res) == _oracle(16, ranks)
    # With the group names the entries carry, the same groups pin every size.
    res = infer_layout(16, ranks, descs=[groups[n][1] for n in names])
    assert res.sizes == TRUTH[scenario] and not res.ambiguous
    assert res.derived == {"edp": 1, "tp*cp": TRUTH[scenario]["tp"], "dp*cp": 2, "etp*ep": TRUTH[scenario]["ep"]}


# --------------------------------------------------------------------------- round trip
def _campaign_configs() -> list[tuple[str, EmulatorConfig]]:
    out = []
    for name in ("config.yaml", "thesis-chapter5.yaml"):
        for run in expand_campaign(load_campaign(REPO / "config" / name)):
            out.append((f"{name}:{run.run_id}", EmulatorConfig.from_dict(run.settings)))
    return out


EXTRA = [  # larger layouts, every dimension > 1 somewhere
    {"nodes": 2, "gpus_per_node": 8, "tp": 2, "pp": 2, "ep": 2, "num_experts": 4, "precision": "bf16",
     "sequence_parallel": True},
    {"nodes": 4, "gpus_per_node": 8, "tp": 2, "pp": 2, "cp": 2, "ep": 2, "etp": 1, "num_experts": 4,
     "precision": "bf16", "sequence_parallel": True},
    {"nodes": 8, "gpus_per_node": 8, "tp": 4, "pp": 4, "ep": 4, "etp": 2, "num_experts": 8,
     "precision": "bf16", "sequence_parallel": True},
]


@pytest.mark.parametrize("cfg", [c for _, c in _campaign_configs()] + [EmulatorConfig.from_dict(e) for e in EXTRA],
                         ids=[n for n, _ in _campaign_configs()] + [f"extra{i}" for i in range(len(EXTRA))])
def test_c_round_trip_through_the_emulator_layout(cfg):
    layout = layout_of(cfg)
    truth = {"tp": cfg.tp, "cp": cfg.cp, "dp": cfg.dp, "pp": cfg.pp, "ep": cfg.ep, "etp": cfg.expert_tp}
    ranks = [list(g.ranks) for g in layout.groups]
    # All group kinds, each with its kind: the exact sizes.
    res = infer_layout(cfg.world_size, ranks, descs=[g.kind for g in layout.groups])
    assert res.sizes == truth and not res.ambiguous
    assert res.layout["edp"] == cfg.expert_dp
    for g, grp in zip(res.groups, layout.groups):
        assert KIND_LABEL[grp.kind] in g["certain"]
    # Member sets only: the truth stays a candidate and no determined size is wrong.
    res = infer_layout(cfg.world_size, ranks)
    assert res.consistent and _truth_tuple(truth) in _cand_tuples(res)
    assert all(v is None or v == truth[n] for n, v in res.sizes.items())


def test_megatron_groups_equal_the_emulator_layout():
    for cfg in [c for _, c in _campaign_configs()[:8]] + [EmulatorConfig.from_dict(e) for e in EXTRA]:
        layout = layout_of(cfg)
        gen = megatron_groups(ParallelSizes(world_size=cfg.world_size, tp=cfg.tp, cp=cfg.cp, pp=cfg.pp, ep=cfg.ep,
                                            etp=cfg.expert_tp))
        for kind, gs in layout.by_kind.items():
            assert [list(g.ranks) for g in gs] == gen[kind], kind


def test_orthogonal_groups_has_one_home_and_the_analysis_no_emulator():
    assert layout_orthogonal_groups is orthogonal_groups
    code = ("import sys, nccltrace.megatron.infer, nccltrace.megatron.command; "
            "bad = [m for m in sys.modules if m.startswith('nccltrace.emulator')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- rules
def test_cp_and_dp_swap_is_reported_unknown_with_the_product():
    truth = ParallelSizes(world_size=32, tp=2, cp=1, dp=4, pp=4, ep=2, etp=2)
    swapped = ParallelSizes(world_size=32, tp=2, cp=4, dp=1, pp=4, ep=2, etp=2)
    gen = megatron_groups(truth)
    ranks = [g for gs in gen.values() for g in gs]
    assert {tuple(g) for g in ranks} == {tuple(g) for gs in megatron_groups(swapped).values() for g in gs}
    res = infer_layout(32, ranks)
    assert res.sizes == {"tp": 2, "cp": None, "dp": None, "pp": 4, "ep": None, "etp": None}
    assert res.derived == {"edp": 2, "tp*cp": None, "dp*cp": 4, "etp*ep": 4}
    cands = _cand_tuples(res)
    assert (2, 1, 4, 4, 2, 2) in cands and (2, 4, 1, 4, 2, 2) in cands
    assert res.ambiguous and res.layout is None
    assert res.evidence["cp"] == {"value": None, "values": res.values["cp"]} and 1 in res.values["cp"]
    # With the kinds given, the same groups are exact.
    res = infer_layout(32, ranks, descs=[k for k, gs in gen.items() for _ in gs])
    assert res.layout is not None and _cand_tuples(res) == {(2, 1, 4, 4, 2, 2)}


def test_single_ranks_and_the_world_carry_no_evidence():
    res = infer_layout(12, [[0], [5], list(range(12))])
    assert res.consistent and res.sizes == dict.fromkeys(SIZE_NAMES)
    assert len(res.candidates) == len(_oracle(12, []))
    assert [g["evidence"] for g in res.groups] == [False, False, False]
    assert "world" in res.groups[2]["certain"]
    # ... unless described: an expert-data-parallel group of one rank means edp = 1.
    res = infer_layout(4, [[0]], descs=["EXPERT_DATA_PARALLEL_GROUP"])
    assert res.derived["edp"] == 1


def test_a_group_megatron_never_creates_is_unexplained():
    gen = megatron_groups(ParallelSizes(world_size=16, tp=2, dp=2, pp=4, etp=1))
    ranks = gen["tp"] + gen["pp"] + gen["embd"] + [[0, 3, 5]]
    res = infer_layout(16, ranks)
    assert not res.consistent
    assert res.groups[-1]["labels"] == ["unexplained"] and not res.groups[-1]["explained"]
    assert all(g["explained"] for g in res.groups[:-1])
    assert res.sizes["pp"] == 4  # the best-fitting candidates still agree on pp
    assert any("no candidate explains every group" in n for n in res.notes)
    # A description the member set contradicts is not explained either: a pipeline group of
    # tp-cp-ep-dp-pp has stride world/pp, never 1 ...
    res = infer_layout(8, [[0, 1]], descs=["PIPELINE_MODEL_PARALLEL_GROUP"])
    assert not res.consistent and not res.groups[0]["explained"]
    assert "tp" in res.groups[0]["labels"]
    # ... while first and last stage 6 apart in a world of 8 can only be pp = 4.
    res = infer_layout(8, [[0, 6]], descs=["EMBEDDING_GROUP"])
    assert res.consistent and res.sizes["pp"] == 4 and res.groups[0]["certain"] == ["embedding"]


def test_orders():
    # Dense (ep = 1): tp-cp-dp-pp is the default order; candidates merge, sizes unchanged.
    gen = megatron_groups(ParallelSizes(world_size=16, tp=2, cp=2, dp=2, pp=2, etp=1))
    ranks = [g for gs in gen.values() for g in gs]
    kinds = [k for k, gs in gen.items() for _ in gs]
    one = infer_layout(16, ranks, descs=kinds)
    two = infer_layout(16, ranks, descs=kinds, orders=(DEFAULT_ORDER, "tp-cp-dp-pp"))
    assert one.sizes == two.sizes == {"tp": 2, "cp": 2, "dp": 2, "pp": 2, "ep": 1, "etp": 1}
    assert two.layout["orders"] == [DEFAULT_ORDER, "tp-cp-dp-pp"]
    # --use-tp-pp-dp-mapping (tp-cp-ep-pp-dp): found under its order, refuted under the default.
    s = ParallelSizes(world_size=16, tp=2, cp=1, dp=2, pp=4, ep=2, etp=1)
    gen = megatron_groups(s, "tp-cp-ep-pp-dp")
    ranks = [g for gs in gen.values() for g in gs]
    kinds = [k for k, gs in gen.items() for _ in gs]
    res = infer_layout(16, ranks, descs=kinds, orders=("tp-cp-ep-pp-dp",))
    assert res.sizes == {"tp": 2, "cp": 1, "dp": 2, "pp": 4, "ep": 2, "etp": 1}
    assert not infer_layout(16, ranks, descs=kinds).consistent
    res = infer_layout(16, ranks, descs=kinds, orders=(DEFAULT_ORDER, "tp-cp-ep-pp-dp"))
    assert res.layout["orders"] == ["tp-cp-ep-pp-dp"]
    with pytest.raises(ValueError, match="order"):
        infer_layout(16, ranks, orders=("tp-zz",))


def test_agrees_with_brute_force_on_random_layouts():
    rng = random.Random(7)
    orders_pool = (DEFAULT_ORDER, "tp-cp-ep-pp-dp", "tp-pp-dp")
    for _ in range(40):
        w = rng.choice([4, 6, 8, 12, 16])
        while True:
            tp = rng.choice(_divisors(w))
            cp = rng.choice(_divisors(w // tp))
            dp = rng.choice(_divisors(w // tp // cp))
            pp = w // tp // cp // dp
            etp = rng.choice(_divisors(w // pp))
            ep = rng.choice(_divisors(w // pp // etp))
            order = rng.choice(orders_pool)
            s = ParallelSizes(world_size=w, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)
            if not order_problem(s, order):
                break
        gen = megatron_groups(s, order)
        groups, descs = [], []
        for kind in [k for k in gen if rng.random() < 0.5]:
            for g in rng.sample(gen[kind], rng.randint(1, len(gen[kind]))):
                groups.append(g)
                descs.append(kind if rng.random() < 0.3 else None)
        orders = orders_pool if rng.random() < 0.3 else (DEFAULT_ORDER,)
        use = descs if rng.random() < 0.5 else None
        res = infer_layout(w, groups, descs=use, orders=orders)
        expected = _oracle(w, groups, use, orders)
        assert res.consistent == bool(expected)
        if expected:
            assert _cand_tuples(res) == expected
            assert all(v is None or v == getattr(s, n) for n, v in res.sizes.items())


def test_world_4096_is_fast():
    s = ParallelSizes(world_size=4096, tp=8, cp=2, dp=16, pp=16, ep=8, etp=2)
    gen = megatron_groups(s)
    ranks = [g for gs in gen.values() for g in gs]
    t0 = time.perf_counter()
    res = infer_layout(4096, ranks)
    assert time.perf_counter() - t0 < 10
    assert res.sizes == {"tp": 8, "cp": 2, "dp": 16, "pp": 16, "ep": 8, "etp": 2} and not res.ambiguous
    t0 = time.perf_counter()
    res = infer_layout(4096, [gen["tp"][0], gen["pp"][3]])  # sparse: thousands of candidates
    assert time.perf_counter() - t0 < 10 and res.ambiguous and res.sizes["tp"] is None


# --------------------------------------------------------------------------- CLI
def _write(tmp_path: Path, data, name: str = "groups.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_d_cli_on_the_real_pg_config(tmp_path, capsys):
    groups, _ = _load("gpu_error_1st")
    names = sorted(groups, key=int)
    described = _write(tmp_path, {"world_size": 16, "groups": [{"ranks": groups[n][0], "desc": groups[n][1]}
                                                               for n in names]})  # fmt: skip
    assert main(["infer-layout", str(described)]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["sizes"] == TP2 and out["ambiguous"] is False and out["consistent"] is True
    assert out["candidates"] == [{**TP2, "edp": 1, "orders": [DEFAULT_ORDER]}]
    assert len(out["groups"]) == len(names) and set(out["evidence"]) == set(SIZE_NAMES)
    assert "determined" in cap.err
    bare = _write(tmp_path, {"world_size": 16, "groups": [groups[n][0] for n in names]}, "bare.json")
    assert main(["infer-layout", str(bare)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sizes"] == {"tp": None, "cp": None, "dp": None, "pp": 4, "ep": None, "etp": None}
    assert out["ambiguous"] is True and len(out["candidates"]) > 1
    assert out["evidence"]["tp"] == {"value": None, "values": [1, 2, 4]}


def test_d_cli_help_explains(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["infer-layout", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in ("world_size", "desc", "candidates", "ambiguous", "evidence", "unknown", "--order"):
        assert word in text


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"groups": [[0, 1]]}, "field 'world_size' is missing"),
    ({"world_size": 4}, "field 'groups' is missing"),
    ({"world_size": "4", "groups": []}, "'world_size' must be a positive integer"),
    ({"world_size": 0, "groups": []}, "'world_size' must be a positive integer"),
    ({"world_size": True, "groups": []}, "'world_size' must be a positive integer"),
    ({"world_size": 4, "groups": {"a": 1}}, "'groups' must be a list"),
    ({"world_size": 4, "groups": [[0, 4]]}, "groups[0]: rank 4 is outside 0..3"),
    ({"world_size": 4, "groups": [[0, 1], [1, 1]]}, "groups[1]: a rank is listed twice"),
    ({"world_size": 4, "groups": [[0, "1"]]}, "groups[0]: rank '1' is not an integer"),
    ({"world_size": 4, "groups": [[]]}, "groups[0]: expected a non-empty list"),
    ({"world_size": 4, "groups": [7]}, "groups[0] must be a list of global ranks"),
    ({"world_size": 4, "groups": [{"desc": "TENSOR_MODEL_PARALLEL_GROUP"}]}, "groups[0]: an object needs 'ranks'"),
    ({"world_size": 4, "groups": [{"ranks": [0, 1], "desc": 5}]}, "groups[0].desc must be a string"),
])  # fmt: skip
def test_e_malformed_input_is_a_clear_error(tmp_path, capsys, content, message):
    path = _write(tmp_path, content)
    assert main(["infer-layout", str(path)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.startswith(f"error: {path}: ") and message in cap.err, cap.err


def test_e_missing_file_and_bad_order(tmp_path, capsys):
    assert main(["infer-layout", str(tmp_path / "absent.json")]) == 2
    assert "absent.json: no such file" in capsys.readouterr().err
    path = _write(tmp_path, {"world_size": 4, "groups": [[0, 1]]})
    assert main(["infer-layout", "--order", "tp-xx-pp", str(path)]) == 2
    assert "error: --order: order 'tp-xx-pp'" in capsys.readouterr().err


def test_e_unknown_descriptions_are_noted_not_guessed():
    res = infer_layout(4, [[0, 1]], descs=["MY_OWN_GROUP"])
    assert any("MY_OWN_GROUP" in n for n in res.notes)
    assert res.sizes == infer_layout(4, [[0, 1]]).sizes
    with pytest.raises(ValueError, match=r"groups\[0\]: rank -1"):
        infer_layout(4, [[-1, 0]])
    with pytest.raises(ValueError, match="world_size"):
        infer_layout(0, [])
