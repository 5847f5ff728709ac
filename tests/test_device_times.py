"""The host-clock times a lane gives its timed steps on CUDA
(``Completion.device_times``), against times worked out by hand from the device times the
fakes below report; and how a polled lane's completion thread waits for an event
(``Completion.wait``)."""

from types import SimpleNamespace

from commsched.clock import EventClock
from commsched.completion import Completion, InFlight
from commsched.issue import Issuer

MS = 1_000_000                    # ns per ms


class DeviceEvent:
    """A completed timed event at ``t`` ns of device time (None: it never completed)."""

    def __init__(self, t):
        self.t = t

    def elapsed_time(self, other):
        if self.t is None or other.t is None:
            raise RuntimeError("event not completed")
        return (other.t - self.t) / MS


class TimedWork:
    """A process group's work that timed its collective: ``duration`` ns (None: failed)."""

    def __init__(self, duration):
        self.duration = duration

    def _get_duration(self):
        if self.duration is None:
            raise RuntimeError("getDuration can only be called after work is succeeded")
        return self.duration / MS


def completion(previous_end=0):
    """What device_times reads of a polled CUDA lane's completion side: host clock =
    device clock + 10 s."""
    clock = EventClock(stream=None)
    clock.anchor = (DeviceEvent(0), 10_000 * MS)
    return SimpleNamespace(cuda=True, device=None, polled=True, clock=clock,
                           group_end_ns=previous_end)


def step(start=None, end=None, duration=None, cross_group=False):
    chunk = SimpleNamespace(request=SimpleNamespace(cross_group=cross_group))
    return InFlight(chunk=chunk, step=0, work=TimedWork(duration),
                     start=None if start is None else DeviceEvent(start),
                     end=None if end is None else DeviceEvent(end))


def test_a_step_starts_when_ready_or_when_the_groups_previous_step_ended():
    host = completion(previous_end=10_000 * MS + 5 * MS)
    batch = [step(start=2 * MS, duration=3 * MS),      # ready early: after the previous
             step(start=20 * MS, duration=1 * MS),     # ready after the previous ended
             step(start=20 * MS + 500, duration=2 * MS)]
    times = Completion.device_times(host, batch, t_seen=99)
    t0 = 10_000 * MS
    assert times == [(t0 + 5 * MS, t0 + 8 * MS),
                     (t0 + 20 * MS, t0 + 21 * MS),
                     (t0 + 21 * MS, t0 + 23 * MS)]
    assert host.group_end_ns == t0 + 23 * MS          # where the next batch goes on


def test_end_events_give_the_end_and_start_events_the_start():
    host = completion()
    times = Completion.device_times(host, [step(start=4 * MS, end=7 * MS)], t_seen=99)
    assert times == [(10_004 * MS, 10_007 * MS)]


def test_a_step_with_an_end_event_on_the_group_moves_the_groups_end_on():
    host = completion()
    t0 = 10_000 * MS
    batch = [step(start=1 * MS, end=6 * MS),              # (sealed: an end event)
             step(start=2 * MS, end=9 * MS, cross_group=True),   # another group's
             step(start=3 * MS, duration=1 * MS)]
    times = Completion.device_times(host, batch, t_seen=99)
    assert times[2] == (t0 + 6 * MS, t0 + 7 * MS)
    assert host.group_end_ns == t0 + 7 * MS


def test_steps_that_cannot_be_timed_are_seen_when_completed():
    host = completion()
    failed = step(start=1 * MS, duration=2 * MS)
    failed.error = RuntimeError("peer gone")
    batch = [step(start=1 * MS, duration=None),        # the group could not time it
             step(start=None, end=None),               # untimed
             failed,
             step(start=5 * MS, end=None, duration=1 * MS)]
    times = Completion.device_times(host, batch, t_seen=42)
    assert times[:3] == [(None, 42)] * 3
    assert times[3] == (10_005 * MS, 10_006 * MS)


def test_a_batch_without_events_maps_nothing():
    host = completion()
    host.clock = None                                  # would be made, on a device
    assert Completion.device_times(host, [step(), step()], t_seen=7) == [(None, 7)] * 2
    assert host.clock is None


class LateEvent:
    """An event that completes at its ``n``-th query (never: None)."""

    def __init__(self, n):
        self.n, self.queries = n, 0

    def query(self):
        self.queries += 1
        return self.n is not None and self.queries >= self.n

    def synchronize(self):
        raise AssertionError("a polled lane's events are not waited on blocking")


def test_a_polled_lanes_completion_thread_looks_until_the_event_completed():
    host = SimpleNamespace(polled=True, failure=None)
    item = InFlight(chunk=object(), step=0, work=None, start=None, end=LateEvent(4))
    Completion.wait(host, item)
    assert item.end.queries == 4 and item.error is None


def test_it_stops_looking_once_the_lane_failed():
    failure = RuntimeError("the watchdog gave up")
    host = SimpleNamespace(polled=True, failure=None)

    class NeverCompletes(LateEvent):
        def query(self):
            if super().query() is False and self.queries == 3:
                host.failure = failure        # (the watchdog, meanwhile)
            return False

    item = InFlight(chunk=object(), step=0, work=None, start=None, end=NeverCompletes(None))
    Completion.wait(host, item)
    assert item.error is failure and item.end.queries == 3


def test_only_a_first_step_leaves_its_end_to_the_groups_timing(monkeypatch):
    """A later step (the all-gather of a decomposed all-reduce) keeps its end event: its
    start event, in whatever stream issued it, does not order it."""
    import torch

    import commsched.issue as issue
    from fake_cuda import FakeEvent, FakeStream

    class Work:
        def wait(self):
            pass

    monkeypatch.setattr(issue, "issue_step", lambda chunk, step: Work())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    host = SimpleNamespace(group_timed=True, device=None)
    completion = SimpleNamespace(done_stream=FakeStream(), event=FakeEvent, newest={})
    request = SimpleNamespace(ready_event=None, cross_group=False)
    chunk = SimpleNamespace(request=request, staging=None, works=None)

    def issue_cuda(step, last):           # timed (telemetry), no credit window
        return Issuer.issue_cuda(host, chunk, step, last, True, False, completion)
    start, end, _ = issue_cuda(0, last=False)
    assert start is not None and end is None
    start, end, _ = issue_cuda(1, last=True)
    assert start is not None and end is not None
    host.group_timed = False                        # (no group timing: an end event each)
    assert issue_cuda(0, last=False)[1] is not None
