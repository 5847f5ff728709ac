"""The step split (``commsched.telemetry.step_split``) on profiler traces whose every part is
known by construction: compute only's window and a step's window of the same two
iterations, written as torch.profiler writes them (GPU activities with their device,
stream and correlation id, the runtime calls that launched them, the marker kernels)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from commsched.telemetry import step_split, timeline
from commsched.telemetry.errors import TelemetryError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
MARK = "void at::cuda::(anonymous namespace)::spin_kernel(long)"


class Trace:
    """Builds a trace: each activity gets a correlation id and a launch call on the host,
    returned at ``launched`` (default: long before the activity starts)."""

    def __init__(self):
        self.events = []
        self.corr = 0

    def add(self, name, start, dur, stream=7, launched=None, cat="kernel", device=0):
        self.corr += 1
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                            "ts": start, "dur": dur,
                            "args": {"device": device, "stream": stream,
                                     "correlation": self.corr}})
        returned = start - 50 if launched is None else launched
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                            "pid": 1, "tid": 11, "ts": returned - 1, "dur": 1,
                            "args": {"correlation": self.corr}})
        # torch.profiler's flow events and CPU-side records are read past
        self.events.append({"ph": "f", "id": self.corr, "pid": 0, "tid": stream,
                            "ts": start, "cat": "ac2g", "name": "ac2g"})

    def write(self, path: Path) -> str:
        with gzip.open(path, "wt") as f:
            json.dump({"schemaVersion": 1, "deviceProperties": [{"id": 0}],
                       "traceEvents": self.events}, f)
        return str(path)


# Compute only, per iteration (us from its start; iterations at 0 and 65):
#   gemm [0,10) gemm [10,20) gemm_bw [20,50) | marker | idle [50,55): adam's launch call
#   returned at 55 (host late 5) | adam [55,65) | marker
def compute_only(tr: Trace, markers=True) -> Trace:
    for o in (0, 65):
        tr.add("gemm", o, 10)
        tr.add("gemm", o + 10, 10)
        tr.add("gemm_bw", o + 20, 30)
        if markers:
            tr.add(MARK, o + 50, 0.5)
        tr.add("adam", o + 55, 10, launched=o + 55)
        if markers:
            tr.add(MARK, o + 65, 0.5)
    return tr


# The step, per iteration (iterations at 0 and 100):
#   gemm [0,10) | NCCL [10,13) while the second gemm waits for it: exposed 3 (not the tail)
#   gemm [13,23) | gemm_bw [23,59): 36 where compute only takes 30, beside NCCL [33,73):
#   hidden [33,59), exposed [59,73) = 14 after the backward's marker at 59 (the tail)
#   copy [73,77) (own work 4) | idle [77,84): adam's launch returned at 84 (host late 7)
#   adam [84,94) | marker at 94 | idle [94,100) before the second iteration: dependency
#   (its first kernel was launched long before): 6 in the window, 3 per iteration.
# Span 194: 97 per iteration, 32 above compute only's 65 =
#   exposed 17 (tail 14) + slowed 6 + own 4 + host 2 (7 - 5) + rest 3.
def step(tr: Trace, markers=True) -> Trace:
    for o in (0, 100):
        tr.add("gemm", o, 10)
        tr.add(NCCL, o + 10, 3, stream=20)
        tr.add("gemm", o + 13, 10)
        tr.add("gemm_bw", o + 23, 36)
        tr.add(NCCL, o + 33, 40, stream=20)
        if markers:
            tr.add(MARK, o + 59, 0.5)
        tr.add("Memcpy DtoD (Device -> Device)", o + 73, 4, cat="gpu_memcpy")
        tr.add("adam", o + 84, 10, launched=o + 84)
        if markers:
            tr.add(MARK, o + 94, 0.5)
    return tr


def figures(tr: Trace, tmp_path: Path, name: str, iters: int = 2):
    events, calls = timeline.load_trace(tr.write(tmp_path / f"{name}.json.gz"))
    return step_split.window_figures(events, calls, iters)


def test_window_figures_per_iteration(tmp_path):
    f = figures(step(Trace()), tmp_path, "step")
    assert f["span_ms"] == pytest.approx(0.097)
    assert f["exposed_ms"] == pytest.approx(0.017)
    assert f["tail_ms"] == pytest.approx(0.014)
    assert f["idle_ms"] == pytest.approx(0.010)
    assert (f["host_late_ms"], f["dependency_ms"], f["unknown_ms"]) == pytest.approx(
        (0.007, 0.003, 0.0))
    # compute = the union of every non-NCCL activity: 10 + 10 + 36 + 4 + 10
    assert f["compute_ms"] == pytest.approx(0.070)
    assert f["span_ms"] == pytest.approx(f["compute_ms"] + f["exposed_ms"] + f["idle_ms"])
    assert f["kernels"]["gemm"] == pytest.approx([2.0, 0.020])
    assert f["collectives"][NCCL] == pytest.approx([2.0, 0.043])
    assert not any(step_split.MARKER in name for name in f["kernels"])


def test_split_parts_are_the_constructed_ones_and_add_up(tmp_path):
    s = step_split.split(figures(step(Trace()), tmp_path, "step"),
                         figures(compute_only(Trace()), tmp_path, "compute"))
    assert s["step_window_ms"] == pytest.approx(0.097)
    assert s["compute_window_ms"] == pytest.approx(0.065)
    assert s["above_ms"] == pytest.approx(0.032)
    expected = {"exposed_ms": 0.017, "tail_ms": 0.014, "slowed_ms": 0.006, "own_ms": 0.004,
                "host_ms": 0.002, "rest_ms": 0.003}
    assert {k: s[k] for k in expected} == pytest.approx(expected)
    parts = sum(s[k] for k in ("exposed_ms", "slowed_ms", "own_ms", "host_ms", "rest_ms"))
    assert parts == pytest.approx(s["above_ms"], rel=0.02)
    assert s["own_by_name"] == [{"name": "Memcpy DtoD (Device -> Device)",
                                 "ms": pytest.approx(0.004)}]
    assert s["not_measured"] == {}


def test_with_a_timed_above_the_parts_add_up_to_it_and_the_device_parts_stay(tmp_path):
    # The constructed windows are 32 us apart; the timed steps (outside the profiler) put
    # the step 40 us above compute only. The split is of the timed 40: exposed, tail,
    # slowed, own and host are the windows' (17, 14, 6, 4, 2), rest the remainder:
    # 40 - 29 = 11 (the windows' 3 and the 8 the windows do not show).
    step_w = figures(step(Trace()), tmp_path, "step")
    compute_w = figures(compute_only(Trace()), tmp_path, "compute")
    s = step_split.split(step_w, compute_w, timed_above_ms=0.040)
    assert (s["above_ms"], s["window_above_ms"], s["above_from"]) == (
        pytest.approx(0.040), pytest.approx(0.032), "timed")
    expected = {"exposed_ms": 0.017, "tail_ms": 0.014, "slowed_ms": 0.006, "own_ms": 0.004,
                "host_ms": 0.002, "rest_ms": 0.011}
    assert {k: s[k] for k in expected} == pytest.approx(expected)
    parts = sum(s[k] for k in ("exposed_ms", "slowed_ms", "own_ms", "host_ms", "rest_ms"))
    assert parts == pytest.approx(0.040, abs=1e-15)
    assert s["not_measured"] == {}


def test_without_a_timed_above_the_split_is_of_the_windows(tmp_path):
    s = step_split.split(figures(step(Trace()), tmp_path, "step"),
                         figures(compute_only(Trace()), tmp_path, "compute"))
    assert s["above_ms"] == s["window_above_ms"] == pytest.approx(0.032)
    assert s["above_from"] == "windows"


def test_a_timed_above_below_the_windows_makes_rest_negative_and_still_adds_up(tmp_path):
    step_w = figures(step(Trace()), tmp_path, "step")
    compute_w = figures(compute_only(Trace()), tmp_path, "compute")
    s = step_split.split(step_w, compute_w, timed_above_ms=0.020)
    assert s["rest_ms"] == pytest.approx(0.020 - 0.029)
    assert s["host_ms"] == pytest.approx(0.002)
    parts = sum(s[k] for k in ("exposed_ms", "slowed_ms", "own_ms", "host_ms", "rest_ms"))
    assert parts == pytest.approx(0.020, abs=1e-15)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "4.9", True, None])
def test_a_timed_above_that_is_not_a_finite_number_is_refused_naming_it(bad):
    w = {"span_ms": 1.0, "exposed_ms": 0.0, "host_late_ms": 0.0, "tail_ms": 0.0,
         "kernels": {}}
    if bad is None:             # (None: no timed figure, the windows' difference)
        assert step_split.split(w, w, timed_above_ms=bad)["above_from"] == "windows"
        return
    with pytest.raises(TelemetryError, match="timed_above_ms must be a finite number"):
        step_split.split(w, w, timed_above_ms=bad)


def test_a_kernel_the_step_runs_more_often_is_own_work_and_fewer_is_negative():
    # per iteration: compute only runs "cast" once (2 us), the step 3 times (2 us each),
    # and "gemm" 4 times where compute only runs it 5 times (10 us each)
    step_ = {"span_ms": 1.0, "exposed_ms": 0.0, "host_late_ms": 0.0, "tail_ms": 0.0,
             "kernels": {"cast": [3.0, 0.006], "gemm": [4.0, 0.040]}}
    base = {"span_ms": 1.0, "host_late_ms": 0.0,
            "kernels": {"cast": [1.0, 0.002], "gemm": [5.0, 0.050]}}
    s = step_split.split(step_, base)
    assert s["own_ms"] == pytest.approx(0.004 - 0.010)
    assert s["slowed_ms"] == pytest.approx(0.0)


def test_extra_instances_of_a_kernel_are_costed_by_their_launch_shape(tmp_path):
    # One templated copy kernel: 4 small instances (1 us, grid [4,1,1]) per iteration in
    # both windows, and in the step 1 large one more (50 us, grid [4096,1,1]): own work is
    # the large one, not 1/5 of the name's time; nothing is slowed.
    def copies(tr, large):
        for k in range(4):
            tr.add("copy_kernel", 10 * k, 1)
            tr.events[-3]["args"].update(grid=[4, 1, 1], block=[128, 1, 1])
        if large:
            tr.add("copy_kernel", 100, 50)
            tr.events[-3]["args"].update(grid=[4096, 1, 1], block=[128, 1, 1])
        return tr

    s = step_split.split(figures(copies(Trace(), True), tmp_path, "step", 1),
                         figures(copies(Trace(), False), tmp_path, "compute", 1))
    assert (s["own_ms"], s["slowed_ms"]) == pytest.approx((0.050, 0.0))
    assert s["own_by_name"] == [{"name": "copy_kernel [grid [4096, 1, 1], block [128, 1, 1]]",
                                 "ms": pytest.approx(0.050)}]


def test_a_window_without_its_markers_leaves_the_tail_not_measured(tmp_path):
    s = step_split.split(figures(step(Trace(), markers=False), tmp_path, "step"),
                         figures(compute_only(Trace(), markers=False), tmp_path, "compute"))
    assert s["tail_ms"] is None
    assert "holds 0 markers, not 4" in s["not_measured"]["tail_ms"]
    assert s["exposed_ms"] == pytest.approx(0.017)      # the rest is measured
    line = step_split.verdict_line(s)
    assert "(the tail not measured)" in line
    assert "what a better order can win is not measured" in line
    assert any("n/m" in ln and "markers" in ln for ln in step_split.format_split(s))


def test_verdict_line_names_each_part_and_what_an_order_can_win():
    s = {"above_ms": 24.0, "exposed_ms": 9.0, "tail_ms": 6.0, "slowed_ms": 8.0,
         "own_ms": 3.0, "host_ms": 2.0, "rest_ms": 2.0}
    assert step_split.verdict_line(s) == (
        "of 24.0 ms above compute: 9.0 exposed (6.0 of them the tail), 8.0 compute slowed "
        "beside communication, 3.0 own device work, 2.0 host under the profiler, 2.0 rest; "
        "a better order can win at most the 3.0 ms of exposed communication outside the "
        "tail")


def test_verdict_line_says_a_negative_part_is_less_than_compute_only():
    s = {"above_ms": 4.9, "exposed_ms": 0.0, "tail_ms": 0.0, "slowed_ms": -0.4,
         "own_ms": -1.2, "host_ms": -5.9, "rest_ms": 12.4}
    assert step_split.verdict_line(s) == (
        "of 4.9 ms above compute: 0.0 exposed (0.0 of them the tail), -0.4 compute slowed "
        "beside communication (faster than in compute only), -1.2 own device work (less "
        "than compute only), -5.9 host under the profiler (less than compute only), 12.4 "
        "rest; a better order can win at most the 0.0 ms of exposed communication outside "
        "the tail")
    s.update(host_ms=2.0, rest_ms=-1.7, own_ms=-0.04)     # -0.04 prints as 0.0: no note
    line = step_split.verdict_line(s)
    assert "-1.7 rest (less than compute only)" in line
    assert "0.0 own device work," in line and "2.0 host under the profiler," in line


def test_a_split_not_measured_is_never_zero():
    s = step_split.not_measured("not measured: no CUDA timing on this device", 11.3)
    assert all(s[p] is None for p in step_split.PARTS)
    line = step_split.verdict_line(s)
    assert line.startswith("of 11.3 ms above compute: exposed communication not measured")
    assert " 0.0 " not in line and "0.00" not in "\n".join(step_split.format_split(s))
    assert all("no CUDA timing" in ln for ln in step_split.format_split(s))


def test_both_at_once_against_each_alone(tmp_path):
    # compute only: two gemms of 10 us; comm only: one all-reduce of 40 us; both at once:
    # the gemms take 12 us beside the all-reduce, which takes 44: +20% and +10%.
    alone, comm, both = Trace(), Trace(), Trace()
    for tr, g, c in ((alone, 10, None), (comm, None, 40), (both, 12, 44)):
        if g:
            tr.add("gemm", 0, g)
            tr.add("gemm", g, g)
        if c:
            tr.add(NCCL, 1, c, stream=20)
    b = step_split.both_at_once(figures(both, tmp_path, "both", 1),
                                figures(alone, tmp_path, "alone", 1),
                                figures(comm, tmp_path, "comm", 1))
    assert b == pytest.approx({"compute_slowed_ms": 0.004, "compute_slowed": 0.2,
                               "comm_slowed_ms": 0.004, "comm_slowed": 0.1,
                               "not_measured": None})


def test_both_at_once_without_comm_onlys_window_says_the_callers_reason(tmp_path):
    alone, both = Trace(), Trace()
    alone.add("gemm", 0, 10)
    both.add("gemm", 0, 12)
    reason = "not measured: the window ran no device activity"
    b = step_split.both_at_once(figures(both, tmp_path, "both", 1),
                                figures(alone, tmp_path, "alone", 1), None, reason)
    assert b["compute_slowed_ms"] == pytest.approx(0.002)
    assert (b["comm_slowed_ms"], b["comm_slowed"]) == (None, None)
    assert b["not_measured"] == f"the comm only window: {reason}"


def test_recorded_fixture_traces_give_the_constructed_split():
    """tests/fixtures/traces holds the two windows above as files (written by
    ``write_fixtures`` below): the split read from the files is the constructed one."""
    def read(name):
        events, calls = timeline.load_trace(str(FIXTURES / name))
        return step_split.window_figures(events, calls, 2)

    s = step_split.split(read("step_window.json.gz"), read("compute_window.json.gz"))
    assert (s["above_ms"], s["exposed_ms"], s["tail_ms"], s["slowed_ms"], s["own_ms"],
            s["host_ms"], s["rest_ms"]) == pytest.approx(
        (0.032, 0.017, 0.014, 0.006, 0.004, 0.002, 0.003))


def test_bad_input_is_a_telemetry_error_naming_it(tmp_path):
    with pytest.raises(TelemetryError, match="iters must be at least 1"):
        step_split.window_figures([], [], 0)
    with pytest.raises(TelemetryError, match="no GPU activity for device 0"):
        step_split.window_figures([], [], 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TelemetryError, match="bad.json: not a readable Chrome trace"):
        timeline.load_trace(str(bad))


def test_the_backward_marker_runs_after_the_last_node_and_before_later_callbacks(
        monkeypatch):
    """The window's backward-end marker is queued before the backward runs: it runs after
    the graph's last node and before a callback queued from inside the backward (as DDP's
    finalize and the data-parallel mode's flush are)."""
    import torch

    from commsched.telemetry import window

    order = []
    monkeypatch.setattr(window, "_mark", lambda: order.append("marker"))
    w = window.ProfiledWindow(1)
    w.active = True                 # (recording needs CUDA; the ordering does not)
    x = torch.ones(3, requires_grad=True)

    def on_grad(grad):
        order.append("last node")
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: order.append("finalize"))

    x.register_hook(on_grad)
    loss = (x * 2).sum()
    w.backward_started(loss)
    loss.backward()
    w.step_ended()
    assert order == ["last node", "marker", "finalize", "marker"]
    w.active = False                # outside a window nothing is queued or launched
    order.clear()
    loss = (x * 2).sum()
    w.backward_started(loss)
    loss.backward()
    w.step_ended()
    assert order == ["last node", "finalize"]


def test_a_window_says_why_it_cannot_record_here():
    import torch

    from commsched.telemetry import window

    w = window.ProfiledWindow(2)
    if not torch.cuda.is_available():
        assert w.reason == "not measured: no CUDA timing on this device"
        assert w.start() is False and w.stop() is None
    with pytest.raises(TelemetryError, match="iters must be at least 1, not 0"):
        window.ProfiledWindow(0)


def test_a_script_running_its_own_profiler_leaves_the_window_not_measured(monkeypatch):
    import torch

    from commsched.telemetry import window

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.autograd.profiler, "_is_profiler_enabled", True)
    w = window.ProfiledWindow(2)
    assert w.reason == "not measured: the script runs its own profiler"
    assert w.start() is False and w.stop() is None


def test_stopping_a_window_reads_the_exported_trace_and_keeps_it_only_where_asked(
        monkeypatch, tmp_path):
    import shutil

    import torch

    from commsched.telemetry import window

    exported = []

    class Profiler:             # stands in for torch.profiler.profile (no CUDA here)
        def __exit__(self, *exc):
            pass

        def export_chrome_trace(self, path):     # gzipped where the name says so
            if path.endswith(".gz"):
                shutil.copy(FIXTURES / "step_window.json.gz", path)
            else:
                with gzip.open(FIXTURES / "step_window.json.gz", "rb") as f:
                    Path(path).write_bytes(f.read())
            exported.append(path)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    expected = figures(step(Trace()), tmp_path, "expected")
    for kept in (str(tmp_path / "kept.json.gz"), None):
        w = window.ProfiledWindow(2, kept)
        w.profiler, w.active = Profiler(), True
        assert w.stop() == expected
        assert not w.active and w.profiler is None
        assert (Path(exported[-1]).exists()) == (kept is not None)


@pytest.mark.parametrize("only_markers", [True, False])
def test_a_window_whose_steps_ran_nothing_on_the_device_says_so(monkeypatch, tmp_path,
                                                                 only_markers):
    """A window recorded around steps that launch no kernel, copy or memset (an in-place
    NCCL sum at world size 1): the reason is that, not a missing window."""
    import torch

    from commsched.telemetry import window

    tr = Trace()
    if only_markers:
        tr.add(MARK, 0, 0.5)
        tr.add(MARK, 10, 0.5)
    source = tr.write(tmp_path / "empty.json.gz")

    class Profiler:
        def __exit__(self, *exc):
            pass

        def export_chrome_trace(self, path):
            with gzip.open(source, "rb") as f, gzip.open(path, "wb") as out:
                out.write(f.read())

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    w = window.ProfiledWindow(1, str(tmp_path / "kept.json.gz"))
    w.profiler, w.active = Profiler(), True
    assert w.stop() is None
    assert w.reason == window.NO_DEVICE_ACTIVITY == (
        "not measured: the window ran no device activity")


def write_fixtures(directory: Path = FIXTURES) -> None:     # pragma: no cover
    directory.mkdir(parents=True, exist_ok=True)
    step(Trace()).write(directory / "step_window.json.gz")
    compute_only(Trace()).write(directory / "compute_window.json.gz")


if __name__ == "__main__":      # pragma: no cover
    write_fixtures()
