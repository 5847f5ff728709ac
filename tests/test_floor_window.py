"""The profiled window of a ``commsched floor`` launch (``floor_worker._Window``): after the
timed steps, P more under the profiler with a marker at each backward's end and step's end,
then the script stops; where no window can be recorded, the launch stops after the timed
steps and says why. A stand-in recorder takes the profiler's place (no CUDA here)."""

import pytest
import torch

from commsched import floor_worker
from commsched.telemetry import window as window_module

WARMUP, ITERS, PROFILE = 2, 3, 2
FIGURES = {"span_ms": 1.0}


class Recorder:
    """Stands in for ProfiledWindow: records what the launch asked of it."""

    made = []

    def __init__(self, iters, trace_path=None, can_start=True):
        self.iters, self.trace_path = iters, trace_path
        self.calls = []
        self.reason = None if can_start else "not measured: no CUDA timing on this device"
        Recorder.made.append(self)

    def start(self):
        self.calls.append("start")
        return self.reason is None

    def backward_started(self, tensors):
        assert tensors.grad_fn is not None
        self.calls.append("backward")

    def step_ended(self):
        self.calls.append("step end")

    def stop(self):
        self.calls.append("stop")
        return FIGURES


def train(win, steps=20):
    """A training loop stopped by the window; how many optimizer steps it made."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    made = 0
    with pytest.raises(floor_worker._WindowDone):
        for _ in range(steps):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            made += 1
    return made + 1             # (the step that raised)


@pytest.fixture
def launch(monkeypatch):
    """A window over this process's optimizer steps, removed afterwards."""
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)
    Recorder.made.clear()
    handles = []

    def make(profile_iters, can_start=True):
        monkeypatch.setattr(window_module, "ProfiledWindow",
                            lambda iters, path: Recorder(iters, path, can_start))
        win = floor_worker._Window(WARMUP, ITERS, floor_worker._Counters(),
                                   profile_iters=profile_iters, trace_path="t.json.gz")
        handles.append(win.install())
        return win

    yield make
    for handle in handles:
        handle.remove()


def test_the_window_follows_the_timed_steps_with_a_marker_at_each_end(launch):
    win = launch(PROFILE)
    assert train(win) == WARMUP + ITERS + PROFILE
    [recorder] = Recorder.made
    assert (recorder.iters, recorder.trace_path) == (PROFILE, "t.json.gz")
    assert recorder.calls == ["start"] + ["backward", "step end"] * PROFILE + ["stop"]
    result = win.result()
    assert result["window"] == FIGURES and result["window_not_measured"] is None
    # the timing is the N steps after the warm-up, the window's excluded
    assert len(result["host_step_ms"]) == ITERS
    assert result["backwards"] == ITERS


def test_without_a_window_the_launch_stops_after_its_timed_steps_and_says_why(launch):
    win = launch(PROFILE, can_start=False)
    assert train(win) == WARMUP + ITERS
    assert Recorder.made[0].calls == ["start"]
    result = win.result()
    assert result["window"] is None
    assert result["window_not_measured"] == "not measured: no CUDA timing on this device"
    win = launch(0)
    assert train(win) == WARMUP + ITERS
    assert win.result()["window_not_measured"] == "not measured: --profile-iters 0"
