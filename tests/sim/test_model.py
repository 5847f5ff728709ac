"""Cost models: the alpha-beta fit recovers known parameters; topology formulas by hand."""

import pytest

from commsched.sim import SimError, TopologyCostModel, fit_alpha_beta, fit_cost_model

MIB = 1 << 20
ALPHA = 25e-6                 # 25 us
BETA = 1 / 50e9               # 50 GB/s


def cost_ns(nbytes):
    return round((ALPHA + nbytes * BETA) * 1e9)


def row(start, nbytes, end=None, step="all_reduce", decompose="none", rank=0):
    return {"rank": rank, "lane": "g0", "op": "all_reduce", "step": step,
            "decompose": decompose, "nbytes": nbytes, "group_size": 2, "ok": 1,
            "t_start_ns": start, "t_end_ns": start + cost_ns(nbytes) if end is None else end}


def test_fit_alpha_beta_on_isolated_samples():
    # 30 us at 1 MB, 50 us at 2 MB, 90 us at 4 MB: alpha 10 us, beta 20 ps/B.
    p = fit_alpha_beta([1e6, 2e6, 4e6], [30e-6, 50e-6, 90e-6])
    assert p.alpha == pytest.approx(10e-6, rel=1e-9)
    assert p.beta == pytest.approx(20e-12, rel=1e-9)


def test_fit_recovers_alpha_beta_from_isolated_chunks():
    rows, t = [], 0
    for nbytes in [1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB] * 3:
        rows.append(row(t, nbytes))
        t += 10**7                       # 10 ms apart: no overlap
    p = fit_cost_model(rows).lookup("all_reduce", "none", 2)
    assert p.alpha == pytest.approx(ALPHA, rel=1e-3)
    assert p.beta == pytest.approx(BETA, rel=1e-4)


def test_fit_sees_through_queueing_under_a_credit_window():
    # All chunks of a busy period are issued (t_start) at the same moment and run one after
    # another, so every duration but the first includes queueing. Busy periods:
    #   [1 MiB, 4 MiB] at 0; [2 MiB] at 10 ms; [8 MiB, 1 MiB, 1 MiB] at 20 ms.
    rows = []
    for t0, sizes in ((0, [MIB, 4 * MIB]), (10**7, [2 * MIB]), (2 * 10**7, [8 * MIB, MIB, MIB])):
        end = t0
        for nbytes in sizes:
            end += cost_ns(nbytes)
            rows.append(row(t0, nbytes, end=end))
    p = fit_cost_model(rows).lookup("all_reduce", "none", 2)
    assert p.alpha == pytest.approx(ALPHA, rel=1e-3)
    assert p.beta == pytest.approx(BETA, rel=1e-4)


def test_one_chunk_size_is_fitted_as_pure_bandwidth():
    rows = [row(i * 10**7, 4 * MIB) for i in range(4)]
    p = fit_cost_model(rows).lookup("all_reduce", "none", 2)
    assert p.alpha == 0.0
    assert p.beta == pytest.approx(cost_ns(4 * MIB) * 1e-9 / (4 * MIB), rel=1e-9)
    assert "not identifiable" in p.note


def test_rs_ag_halves_share_one_fit():
    # Each chunk: RS then AG, each alpha + B * beta, issued together at t0.
    rows = []
    for i, nbytes in enumerate([MIB, 2 * MIB, 4 * MIB]):
        t0 = i * 10**7
        rows.append(row(t0, nbytes, end=t0 + cost_ns(nbytes), step="reduce_scatter",
                        decompose="rs_ag"))
        rows.append(row(t0, nbytes, end=t0 + 2 * cost_ns(nbytes), step="all_gather",
                        decompose="rs_ag"))
    model = fit_cost_model(rows)
    for step in ("reduce_scatter", "all_gather"):
        p = model.lookup(step, "rs_ag", 2)
        assert p.alpha == pytest.approx(ALPHA, rel=1e-3)
        assert p.beta == pytest.approx(BETA, rel=1e-4)


def test_fitted_model_refuses_a_group_size_it_never_saw():
    model = fit_cost_model([row(0, MIB), row(10**7, 2 * MIB)])
    with pytest.raises(SimError, match="8 ranks"):
        model.cost_s("all_reduce", "none", MIB, 8)


def test_ring_formulas():
    # n = 4, B = 4e6 bytes, 100 GB/s, 5 us:
    # all_reduce 2*3*5 us + 2*3/4 * 4e6 / 1e11 s = 30 + 60 = 90 us
    # reduce_scatter / all_gather 3*5 + 3/4 * 40 = 15 + 30 = 45 us
    m = TopologyCostModel("ring", 100.0, 5e-6)
    assert m.cost_s("all_reduce", "none", 4_000_000, 4) == pytest.approx(90e-6)
    assert m.cost_s("reduce_scatter", "rs_ag", 4_000_000, 4) == pytest.approx(45e-6)
    assert m.cost_s("all_gather", "rs_ag", 4_000_000, 4) == pytest.approx(45e-6)
    assert m.cost_s("all_reduce", "none", 4_000_000, 1) == 0.0


def test_tree_formula():
    # n = 4: 2 * log2(4) * (5 us + 4e6 / 1e11 s) = 4 * 45 us = 180 us
    m = TopologyCostModel("tree", 100.0, 5e-6)
    assert m.cost_s("all_reduce", "none", 4_000_000, 4) == pytest.approx(180e-6)


def test_hierarchical_formula():
    # 8 ranks on 2 nodes (4 a node); intra 400 GB/s and 1 us, inter 100 GB/s and 5 us.
    # RS_intra(4, 4e6) = 3*1 + 3/4 * 4e6/4e11 s = 3 + 7.5 = 10.5 us
    # AR_inter(2, 1e6) = 2*1*5 + 2*1/2 * 1e6/1e11 s = 10 + 10 = 20 us
    # AG_intra = 10.5 us; total 41 us.
    m = TopologyCostModel("hier", 100.0, 5e-6, nodes=2, intra_bandwidth_gbps=400.0,
                          intra_latency_s=1e-6)
    assert m.cost_s("all_reduce", "none", 4_000_000, 8) == pytest.approx(41e-6)
    # RS = RS_intra 10.5 + RS_inter(2, 1e6) = 5 + 1/2 * 10 = 10 -> 20.5 us
    assert m.cost_s("reduce_scatter", "rs_ag", 4_000_000, 8) == pytest.approx(20.5e-6)
    with pytest.raises(SimError, match="does not split"):
        m.cost_s("all_reduce", "none", 4_000_000, 6 + 1)


def host_row(rank, key, dispatch_us, start_us, end_us, submit_us=0, iteration=0):
    return {"rank": rank, "lane": "g0", "iteration": iteration, "request_key": key,
            "chunk_index": 0, "op": "all_reduce", "step": "all_reduce", "decompose": "none",
            "nbytes": MIB, "group_size": 2, "ok": 1, "t_submit_ns": submit_us * 1000,
            "t_dispatch_ns": dispatch_us * 1000, "t_start_ns": start_us * 1000,
            "t_end_ns": end_us * 1000}


def test_host_costs_from_dispatch_spacing_and_credit_turnaround():
    from commsched.sim.model import fit_host_costs
    rows = [
        # rank 0: three chunks, all submitted at 0, issued back to back 30 us apart while
        # none has finished: issue samples 30, 30 us.
        host_row(0, "a", 0, 0, 5000), host_row(0, "b", 30, 30, 6000),
        host_row(0, "c", 60, 60, 7000),
        # rank 1: credit of one chunk. b is admitted by a's end (1000 us) and starts at
        # 1070 us; c by b's end (2000 us), starts 2060 us: turnarounds 70, 60 us.
        host_row(1, "a", 0, 0, 1000), host_row(1, "b", 1050, 1070, 2000),
        host_row(1, "c", 2040, 2060, 3000),
    ]
    issue, credit_return, counts = fit_host_costs(rows)
    assert issue == pytest.approx(30e-6)
    assert credit_return == pytest.approx(65e-6)
    assert counts == (2, 2)
