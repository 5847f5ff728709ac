"""examples/bench/trace_overlap.py on Chrome traces built by hand, against the split of the
GPU time worked out on paper."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bench"))

import trace_overlap  # noqa: E402


def kernel(name, ts, dur, device=0, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"device": device, "stream": stream}}


def write(path: Path, events) -> str:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


# Timeline in microseconds, device 0 (one iteration):
#   gemm x4 alone    [0,10) [10,20) [20,30) [30,40)        10 us each
#   gemm x4 beside   [40,55) [55,70) [70,85) [85,100)      15 us each: +50% beside comm
#   copy             [100,110)
#   idle             [110,150)
#   gemm             [150,160)
#   nccl             [45,130)  on another stream
# compute union = [0,110) + [150,160) = 120; comm = 85, under compute [45,110) = 65,
# exposed = [110,130) = 20; span 160 -> idle 160 - 120 - 20 = 20.
EVENTS = ([kernel("gemm", 10 * k, 10) for k in range(4)]
          + [kernel("gemm", 40 + 15 * k, 15) for k in range(4)]
          + [kernel("Memcpy DtoD", 100, 10, cat="gpu_memcpy"),
             kernel("gemm", 150, 10),
             kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 45, 85, stream=20),
             # Another device's activity and CPU-side events are left out.
             kernel("gemm", 0, 1000, device=1),
             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}])


def test_split_of_the_window_matches_the_timeline(tmp_path):
    events = trace_overlap.load_events(write(tmp_path / "t.json.gz", EVENTS))
    r = trace_overlap.analyse(events, device=0, gaps=3)
    assert r["span_ms"] == pytest.approx(0.160)
    assert r["compute_ms"] == pytest.approx(0.120)
    assert r["comm_ms"] == pytest.approx(0.085)
    assert r["hidden_ms"] == pytest.approx(0.065)
    assert r["exposed_ms"] == pytest.approx(0.020)
    assert r["idle_ms"] == pytest.approx(0.020)
    assert r["span_ms"] == pytest.approx(r["compute_ms"] + r["exposed_ms"] + r["idle_ms"])
    assert r["kernel_sum_ms"] == pytest.approx(0.110)   # 4x10 + 4x15 + 10: not the copy
    assert r["comm_kernels"] == 1
    # gemm: alone 10 us (the 4 first and the last: 5), beside comm 15 us (4, the one at
    # [40,55) is 2/3 beside it): 60 us where 40 would do, +50%, +20 us.
    assert r["slowdown"] == pytest.approx(0.5)
    assert r["slowdown_ms"] == pytest.approx(0.020)
    longest = r["gaps"][0]
    assert (longest["gap_ms"], longest["at_ms"], longest["comm_ms"]) == pytest.approx(
        (0.040, 0.110, 0.020))
    assert (longest["after"], longest["before"]) == ("Memcpy DtoD", "gemm")
    # The GPU ran nothing in [130,150): tenths of the 160 us span are 16 us, so 14 us of it
    # fall in the ninth tenth [128,144) and 6 us in the last.
    assert r["idle_by_tenth_ms"] == pytest.approx([0.0] * 8 + [0.014, 0.006])


def runtime_call(name, ts, dur, tid):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid,
            "pid": 1}


def test_host_calls_per_thread_and_iteration(tmp_path, capsys):
    calls = ([runtime_call("cudaLaunchKernel", k, 2, tid=11) for k in range(6)]
             + [runtime_call("cudaEventQuery", 10 + k, 3, tid=11) for k in range(4)]
             + [runtime_call("cudaStreamWaitEvent", 20, 4, tid=11)]
             + [runtime_call("cudaLaunchKernel", 30 + k, 1, tid=22) for k in range(2)]
             + [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 40,
                 "dur": 6, "tid": 22, "pid": 1}])
    path = write(tmp_path / "t.json.gz", EVENTS + calls)
    gpu, host_events = trace_overlap.load_trace(path)
    assert len(gpu) == len(EVENTS) - 1 and len(host_events) == len(calls)   # (not the cpu_op)
    out = tmp_path / "r.json"
    assert trace_overlap.main([path, "--iters", "2", "--host", "2", "--json", str(out)]) == 0
    host = json.loads(out.read_text())[path]["host"]
    # Per iteration (2): thread 11 made 11 calls (6 + 4 + 1) in 12 + 12 + 4 = 28 us.
    assert host[0] == {"tid": 11, "calls": 5.5, "ms": pytest.approx(0.014),
                       "top": [["cudaLaunchKernel", 3.0], ["cudaEventQuery", 2.0]]}
    assert host[1] == {"tid": 22, "calls": 1.5, "ms": pytest.approx(0.004),
                       "top": [["cudaLaunchKernel", 1.0], ["cuLaunchKernelEx", 0.5]]}
    text = capsys.readouterr().out
    assert "host thread 11: 6 CUDA calls (0.01 ms): cudaLaunchKernel 3, cudaEventQuery 2" in text
    with pytest.raises(SystemExit):
        trace_overlap.main([path, "--host", "-1"])


def test_cli_reports_per_iteration_and_writes_json(tmp_path, capsys):
    path = write(tmp_path / "t.json.gz", EVENTS)
    out = tmp_path / "r.json"
    assert trace_overlap.main([path, "--iters", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "span 0.08 ms = compute 0.06 + comm exposed 0.01 + idle 0.01" in text
    assert json.loads(out.read_text())[path]["comm_kernels"] == 1


def test_cli_fails_on_a_trace_without_gpu_activity(tmp_path, capsys):
    path = write(tmp_path / "cpu.json.gz", [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                            "ts": 0, "dur": 5}])
    assert trace_overlap.main([path]) == 1
    assert "no GPU activity" in capsys.readouterr().err


def test_comm_timeline_gives_launch_start_and_link_idle(tmp_path, capsys):
    # Three NCCL kernels on device 0, origin at the first GPU activity (ts 100):
    #   a: launched at 110 by thread 5, runs [150, 170)
    #   b: launched at 120 by thread 6, runs [200, 230): link idle 30 us before it
    #   c: its launch call is not in the trace, runs [225, 240): overlaps b, idle 0
    # plus a compute kernel at 100 and another device's NCCL kernel (left out).
    def nccl(ts, dur, corr, device=0):
        e = kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ts, dur, device=device, stream=20)
        e["args"]["correlation"] = corr
        return e

    events = [kernel("gemm", 100, 40), nccl(200, 30, 2), nccl(150, 20, 1), nccl(225, 15, 3),
              nccl(0, 10, 9, device=1)]
    calls = [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 110,
              "dur": 1, "tid": 5, "args": {"correlation": 1}},
             {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 120,
              "dur": 1, "tid": 6, "args": {"correlation": 2}},
             {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventRecord", "ts": 130,
              "dur": 1, "tid": 6, "args": {"correlation": 7}}]
    path = write(tmp_path / "t.json.gz", events + calls)
    gpu, host_events = trace_overlap.load_trace(path)
    rows = trace_overlap.comm_timeline(gpu, host_events, device=0)
    assert [(r["launch_ms"] is None, r["tid"]) for r in rows] == [
        (False, 5), (False, 6), (True, None)]
    assert rows[0]["launch_ms"] == pytest.approx(0.010)
    assert rows[1]["launch_ms"] == pytest.approx(0.020)
    assert [(r["start_ms"], r["dur_ms"], r["idle_before_ms"]) for r in rows] == [
        pytest.approx((0.050, 0.020, 0.0)), pytest.approx((0.100, 0.030, 0.030)),
        pytest.approx((0.125, 0.015, 0.0))]
    out = tmp_path / "r.json"
    assert trace_overlap.main([path, "--iters", "1", "--comm", "--device", "0",
                               "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())[path]["comm"]) == 3
    text = capsys.readouterr().out
    assert ("ncclDevKernel_AllReduce_Sum_f32_RING_LL: launched at 0.02 by thread 6, "
            "ran 0.10 + 0.03 ms, link idle 0.03 ms before") in text
    assert "launch call not in the trace, ran 0.12 + 0.01 ms" in text


def test_idle_split_into_host_late_and_dependency(tmp_path, capsys):
    # Device 0, microseconds:
    #   a [0,10)    launched at -5 (returned -4)
    #   b [30,40)   its launch call ran [20,22): idle [10,30) = host late 12 + dependency 8
    #   c [50,60)   launched at 5, long before: idle [40,50) = dependency 10
    #   nccl [55,70) on another stream: no idle
    #   d [80,90)   no launch call in the trace: idle [70,80) unknown 10
    # idle 40 = span 90 - busy 50, the same total as analyse()'s.
    def launched(e, corr):
        e["args"]["correlation"] = corr
        return e

    def call(ts, dur, corr, tid=5):
        return {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": ts,
                "dur": dur, "tid": tid, "args": {"correlation": corr}}

    events = [launched(kernel("a", 0, 10), 1), launched(kernel("b", 30, 10), 2),
              launched(kernel("c", 50, 10), 3),
              launched(kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 55, 15, stream=20), 4),
              kernel("d", 80, 10), launched(kernel("e", 0, 500, device=1), 6)]
    calls = [call(-5, 1, 1), call(20, 2, 2, tid=9), call(5, 1, 3), call(6, 1, 4),
             call(0, 1, 6)]
    path = write(tmp_path / "t.json.gz", events + calls)
    gpu, host_events = trace_overlap.load_trace(path)
    r = trace_overlap.idle_causes(gpu, host_events, device=0, top=2)
    assert r["host_late_ms"] == pytest.approx(0.012)
    assert r["dependency_ms"] == pytest.approx(0.018)
    assert r["unknown_ms"] == pytest.approx(0.010)
    total = r["host_late_ms"] + r["dependency_ms"] + r["unknown_ms"]
    assert total == pytest.approx(trace_overlap.analyse(gpu, device=0, gaps=1)["idle_ms"])
    assert [(s["ms"], s["at_ms"], s["tid"], s["next"]) for s in r["host_late"]] == [
        pytest.approx((0.012, 0.010, 9, "b"))]
    assert [(s["ms"], s["at_ms"], s["next"]) for s in r["dependency"]] == [
        pytest.approx((0.010, 0.040, "c")), pytest.approx((0.008, 0.010, "b"))]
    assert trace_overlap.main([path, "--iters", "1", "--idle", "--device", "0"]) == 0
    text = capsys.readouterr().out
    assert ("idle: host late 0.01 ms, dependency 0.02 ms, unknown 0.01 ms per iteration"
            in text)
    assert "host late 0.012 ms at 0.01 (thread 9) -> b" in text


def test_python_self_time_per_thread(tmp_path, capsys):
    # Thread 5, two iterations, microseconds:
    #   A [0,100) id 1: calls B [10,40) id 2 (which calls D [15,25) id 4) and C [50,65) id 3
    #   self: A 100-30-15 = 55, B 30-10 = 20, C (two calls) 15, D 10; outermost frames 100
    # Thread 6: E [0,50) id 1 (same Python id as A, another thread): self 50.
    # Two calls of one bound method on different objects count as one function.
    def fn(name, ts, dur, pid_, parent, tid=5):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur,
                "tid": tid, "args": {"Python id": pid_, "Python parent id": parent}}

    events = [fn("a.py(1): A", 0, 100, 1, None), fn("a.py(2): B", 10, 30, 2, 1),
              fn("<built-in method sum of Tensor object at 0x7f01>", 50, 8, 3, 1),
              fn("<built-in method sum of Tensor object at 0x7f02>", 58, 7, 5, 1),
              fn("a.py(4): D", 15, 10, 4, 2), fn("b.py(1): E", 0, 50, 1, None, tid=6),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 12, "dur": 5, "tid": 5}]
    threads = trace_overlap.python_self_time(events, iters=2, top=3)
    assert [t["tid"] for t in threads] == [5, 6]
    assert threads[0]["ms"] == pytest.approx(0.050)
    assert [(name, ms, n) for name, ms, n in threads[0]["top"]] == [
        ("a.py(1): A", pytest.approx(0.0275), 0.5), ("a.py(2): B", pytest.approx(0.010), 0.5),
        ("<built-in method sum of Tensor object>", pytest.approx(0.0075), 1.0)]
    assert threads[1]["top"] == [("b.py(1): E", pytest.approx(0.025), 0.5)]
    # A trace without GPU activity (a CPU run): --python still reports it.
    path = write(tmp_path / "cpu.json.gz", events)
    assert trace_overlap.main([path, "--iters", "2", "--python", "1"]) == 0
    text = capsys.readouterr().out
    assert "python on thread 5: 0.05 ms at its outermost frames" in text
    assert "    0.028 ms in 0.5 calls: a.py(1): A" in text        # per iteration
    assert "a.py(2): B" not in text                                 # --python 1: the top one
    assert trace_overlap.main([path, "--iters", "2"]) == 1
    with pytest.raises(SystemExit):
        trace_overlap.main([path, "--python", "-1"])
