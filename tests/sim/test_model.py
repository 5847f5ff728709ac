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


def collective_row(rank, key, start_us, end_us, dispatch_us=None, chunk=0, iteration=0):
    return {"rank": rank, "lane": "g0", "iteration": iteration, "request_key": key,
            "chunk_index": chunk, "op": "all_reduce", "step": "all_reduce",
            "decompose": "none", "nbytes": MIB, "group_size": 2, "ok": 1,
            "t_submit_ns": 0, "t_dispatch_ns": (start_us if dispatch_us is None
                                                else dispatch_us) * 1000,
            "t_start_ns": start_us * 1000, "t_end_ns": end_us * 1000}


def test_join_ranks_starts_a_collective_when_the_last_rank_joins():
    from commsched.sim.model import join_ranks
    # Rank 1 got there at 0 and waited for rank 0, which started at 900 us: the step ran
    # [900, 1000]; rank 1's row alone would say it took 1000 us.
    rows = [collective_row(0, "a", 900, 1000), collective_row(1, "a", 0, 1010)]
    (joined,) = join_ranks(rows)
    assert (joined["t_start_ns"], joined["t_end_ns"]) == (900_000, 1_010_000)
    assert joined["rank"] == -1


def test_join_ranks_keeps_a_step_missing_on_a_rank_as_recorded():
    from commsched.sim.model import join_ranks
    rows = [collective_row(0, "a", 0, 100), collective_row(0, "b", 200, 300),
            collective_row(1, "b", 250, 300)]
    joined = sorted(join_ranks(rows), key=lambda r: r["t_start_ns"])
    assert [(r["rank"], r["t_start_ns"]) for r in joined] == [(0, 0), (-1, 250_000)]


def test_fit_sees_through_a_rank_waiting_for_its_peer():
    # Isolated chunks; rank 1 always starts 5 ms early and records the wait.
    rows, t = [], 0
    for i, nbytes in enumerate([1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB] * 3):
        for rank, start in ((0, t), (1, t - 5_000_000)):
            r = row(start, nbytes, end=t + cost_ns(nbytes), rank=rank)
            r.update(iteration=0, request_key=str(i), chunk_index=0)
            rows.append(r)
        t += 10**7
    p = fit_cost_model(rows).lookup("all_reduce", "none", 2)
    assert p.alpha == pytest.approx(ALPHA, rel=1e-3)
    assert p.beta == pytest.approx(BETA, rel=1e-4)


def test_credit_turnaround_is_measured_from_the_link_end_of_the_first_of_a_batch():
    from commsched.sim.model import fit_host_costs
    # Credit of two chunks. a and b start at 0 and 10 us and take 20 us each on the link
    # (link ends 20, 40 us), but both ends are recorded at 500 us (one batch). c, held
    # back, is dispatched at 510 us and starts at 530: a's credit admitted it, so the
    # turnaround from a's link end is 510 us (the recorded end would say 30 us).
    rows = [collective_row(0, "a", 0, 500), collective_row(0, "b", 10, 500),
            collective_row(0, "c", 530, 550, dispatch_us=510)]
    rows[2]["t_submit_ns"] = 0
    _, credit_return, counts = fit_host_costs(rows, lambda r: 20e-6)
    assert counts[1] == 1
    assert credit_return == pytest.approx(510e-6)
    _, recorded_only, _ = fit_host_costs(rows)
    assert recorded_only == pytest.approx(30e-6)


def test_host_costs_charge_the_mean_delay_not_the_median():
    from commsched.sim.model import MAX_HOST_DELAY_S, fit_host_costs
    # Rank 0 issues four chunks back to back (submitted at 0, none finishes meanwhile):
    # spacings 100, 100, 400 us. Many such delays add up on the critical path, so the
    # issue cost is their mean, 200 us (the median would say 100).
    rows = [host_row(0, k, d, d, 500_000) for k, d in (("a", 0), ("b", 100), ("c", 200),
                                                      ("d", 600))]
    issue, _, counts = fit_host_costs(rows)
    assert issue == pytest.approx(200e-6)
    assert counts[0] == 3
    # A spacing longer than MAX_HOST_DELAY_S is not one host delay: left out.
    late = MAX_HOST_DELAY_S * 1e6 + 1000
    rows.append(host_row(0, "e", 600 + late, 600 + late, 600 + late + 10))
    issue, _, counts = fit_host_costs(rows)
    assert issue == pytest.approx(200e-6)
    assert counts[0] == 4


def test_pooled_runs_are_not_joined_with_each_other():
    from commsched.sim.model import join_ranks
    # Two runs that both recorded iteration 0, request "a", chunk 0 on ranks 0 and 1.
    rows = [dict(collective_row(rank, "a", start, 100), run=run)
            for run, start in (("r1", 0), ("r2", 50)) for rank in (0, 1)]
    joined = sorted(join_ranks(rows), key=lambda r: r["run"])
    assert [(r["run"], r["rank"], r["t_start_ns"]) for r in joined] == [
        ("r1", -1, 0), ("r2", -1, 50_000)]


def test_ranks_on_different_hosts_are_not_joined():
    from commsched.sim.model import join_ranks
    rows = [dict(collective_row(rank, "a", 0, 100), host=f"node{rank}") for rank in (0, 1)]
    assert sorted(r["rank"] for r in join_ranks(rows)) == [0, 1]
