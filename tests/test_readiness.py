"""The profile a priority plan is built from: readiness and link time on the device's clock
(``readiness.read_profile``), and the plan built from it, against timelines worked out by
hand. Events are stand-ins that report device times set here; the host submitted every
request at once (it runs ahead), so only the device times say what was ready when."""

from commsched.order import DispatchOrder
from commsched.readiness import Marks, ProfiledRequest, read_profile

MS = 1e-3


class DeviceEvent:
    """A timed event the device reached at ``t`` seconds."""

    def __init__(self, t):
        self.t = t
        self.synchronized = False

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def profiled(times, nbytes=100, priorities=None):
    """Requests "a", "b", ... with device (ready, end) times in ms, in submission order."""
    requests = []
    for i, (ready, end) in enumerate(times):
        marks = Marks(DeviceEvent(ready * MS))
        marks.end = DeviceEvent(end * MS)
        priority = i if priorities is None else priorities[i]
        requests.append(ProfiledRequest("abcdefgh"[i], priority, (nbytes,), marks))
    return requests


def test_readiness_and_the_link_s_busy_time_come_from_the_device():
    # a ready at 0 ends at 15; b ready at 10 waits for a, ends at 25; c ready at 30 ends at
    # 40: the link was busy 15 + 10 + 10 ms for 300 bytes.
    iteration = profiled([(0, 15), (10, 25), (30, 40)])
    profile = read_profile([iteration], cuda=True)
    assert [round(p.ready_s / MS, 6) for p in profile.requests] == [0, 10, 30]
    assert abs(profile.seconds_per_byte - 35 * MS / 300) < 1e-12
    assert all(r.marks.end.synchronized for r in iteration)     # waited for, once here


def test_readiness_is_relative_to_each_iteration_s_first_request():
    first = profiled([(100, 115), (110, 125), (130, 140)])       # spans 40 ms
    second = profiled([(500, 515), (510, 525), (534, 544)])      # spans 44 ms
    profile = read_profile([first, second], cuda=True)
    assert [round(p.ready_s / MS, 6) for p in profile.requests] == [0, 10, 34]
    assert abs(profile.spread_s - 4 * MS) < 1e-12
    assert abs(profile.seconds_per_byte - 2 * 35 * MS / 600) < 1e-12


def test_an_iteration_with_a_request_never_issued_is_not_read():
    done = profiled([(0, 15), (10, 25)])
    failed = profiled([(0, 15), (10, 25)])
    failed[1].marks.end = None
    profile = read_profile([done, failed], cuda=True)
    assert [round(p.ready_s / MS, 6) for p in profile.requests] == [0, 10]   # from `done`


def test_the_plan_follows_device_readiness_not_the_host_s():
    """Submitted at once on the host (the host ahead), ready on the device in submission
    order: a replay from host times would put the most urgent request, ready last on the
    device, first on the link, which would then wait for it. From device times the link
    takes each request as it is ready and the urgent one overtakes only what is queued."""
    order = DispatchOrder("priority", 1, False, credit_for=lambda index: 1, cuda=True)
    # (a credit window of one chunk: the link replayed one collective at a time)
    # priorities: d (submitted last, ready last) is needed first
    iteration = profiled([(0, 10), (10, 20), (20, 30), (30, 40)], priorities=[3, 2, 1, 0])
    plan = order.build_plan([iteration], 1, exchange=lambda values: values)
    assert [key for key, _ in plan.order] == ["a", "b", "c", "d"]
    # the same requests as if all were ready together (what host times said)
    together = profiled([(0, 10), (0, 20), (0, 30), (0, 40)], priorities=[3, 2, 1, 0])
    plan = order.build_plan([together], 1, exchange=lambda values: values)
    assert [key for key, _ in plan.order] == ["d", "c", "b", "a"]


def test_a_forward_plan_gains_less_than_the_spread_keeps_submission_order():
    """Data-parallel groups (the next forward needs d first): the forward plan's modelled
    gain over submission order is 5 ms here (45 ms against 50); iterations that vary by more
    than that keep submission order, which asks nothing of timings."""
    order = DispatchOrder("priority", 2, True, credit_for=lambda index: 0, cuda=True)

    def plan_for(second_span_ms):
        first = profiled([(0, 10), (5, 20), (10, 30), (15, 40)], priorities=[3, 2, 1, 0])
        second = profiled([(0, 10), (5, 20), (10, 30), (15, 40 + second_span_ms)],
                          priorities=[3, 2, 1, 0])
        return [key for key, _ in order.build_plan([first, second], 0, lambda v: v).order]

    assert plan_for(0) != ["a", "b", "c", "d"]            # no spread: the model's order
    assert plan_for(30) == ["a", "b", "c", "d"]           # within the noise: submission
