"""Device completion of a lane's collectives: what a lane issued and did not complete yet,
in issue order, the thread that completes it, and the watchdog.

A lane (lane.py) hands every step it issues to its ``Completion``: as an item of its own
where somebody needs that step's completion (its credit, a gloo future or next step, its
timings, a padded chunk's copy back), else into the open completion batch. The completion
thread, once rung, or the caller of a polled lane, at its end of iteration, takes the items
that finished on the device, with their host-clock device times, and hands them to the
lane's ``settle`` callback: credit back, request outcomes, the next dispatch. When the
thread is rung and when the caller completes instead: [Note: completion hand-off] in
docs/design.md.

The lane's lock guards everything here (the one lock that totally orders a lane's
dispatch); only the thread's wait for the device is outside it.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .clock import EventClock
from .partition import Chunk
from .threads import start_thread

__all__ = ["Completion", "InFlight", "Watchdog", "LAZY_ITEMS", "POLLED_ITEMS"]

# Unfinished chunks that may wait for their completion before the completion thread is
# woken for them anyway (bounds the events and staging buffers they hold).
LAZY_ITEMS = 64
POLLED_ITEMS = 4 * LAZY_ITEMS
# The completion thread of a polled lane looks at an unfinished event after WAIT_POLL_S,
# then at intervals doubling up to WAIT_POLL_MAX_S (see Completion.wait).
WAIT_POLL_S = 0.0002
WAIT_POLL_MAX_S = 0.004

Times = List[Tuple[Optional[int], int]]


class InFlight:
    """One issued collective step, until it was completed; or, on CUDA, a batch of
    consecutive steps of the lane's own group that nobody needs one by one (``chunk``
    None: no timings, no credit, no copy back), completed together."""

    __slots__ = ("chunk", "step", "work", "start", "end", "error", "keep_end", "nbytes",
                 "count", "t_first_ns", "iteration", "open")

    def __init__(self, chunk: Optional[Chunk], step: int, work, start, end,
                 keep_end: bool = False):
        self.chunk = chunk
        self.step = step
        self.work = work              # a batch's: its newest (NCCL runs them in order)
        self.start = start            # timed CUDA event before it (telemetry, tuner)
        self.end = end                # CUDA event after it on the done stream, or None
        self.error: Optional[BaseException] = None
        self.keep_end = keep_end      # ``end`` is a request's done_event: not pooled
        self.nbytes = 0               # a batch's payload bytes (chunks counted once)
        self.count = 0                # a batch's steps
        self.t_first_ns = 0           # a batch's first dispatch
        self.iteration = -1           # a batch's first step's iteration
        self.open = False             # a batch that the next lean step may join

    def describe(self) -> str:
        if self.chunk is None:
            return (f"{self.count} collectives ({self.nbytes} bytes) issued from iteration "
                    f"{self.iteration} on")
        req = self.chunk.request
        return (f"{req.steps[self.step]} of chunk {self.chunk.index}/{len(req.chunks)} of "
                f"request {req.key!r} ({self.chunk.nbytes} bytes, iteration {req.iteration})")


class Completion:
    """The completion side of one lane. Owns the in-flight queue and its sequence numbers,
    the newest step per process group, the done stream and the pool of CUDA events
    recorded on it, the event clock, and the completion thread with its wait bookkeeping.
    The lane's issue path adds to it (``add``, ``batch``) and says when its thread must
    complete (``ring``, ``bound``, ``close_newest``); what finished goes to ``settle``.

    ``polled``: CUDA with nothing waiting for a step's completion (no credit window, no
    tuner): nobody wakes the completion thread per iteration; the caller completes what
    the device finished at its next end of iteration (``take(None, ...)``).
    ``ordered``: the device completes the lane's steps in issue order (NCCL: one stream per
    group), so one wait covers every step before it. ``credit``: the lane's window
    (``limit`` read: under a bounded one the oldest item is completed first)."""

    __slots__ = ("name", "lock", "cuda", "device", "polled", "ordered", "credit", "settle",
                 "done_stream", "in_flight", "head_seq", "must_complete", "newest", "joined",
                 "events", "clock", "group_end_ns", "waiting_item", "waiting_since", "wake",
                 "batches", "thread_batches", "stopping", "failure", "thread")

    def __init__(self, name: str, lock: threading.Lock, device: torch.device, *,
                 polled: bool, ordered: bool, credit, settle: Callable[["InFlight"], None]):
        self.name = name
        self.lock = lock
        self.cuda = device.type == "cuda"
        self.device = device
        self.polled = polled
        self.ordered = ordered
        self.credit = credit
        self.settle = settle
        # CUDA: where events after steps are recorded (and a padded chunk copied back).
        self.done_stream = torch.cuda.Stream(device) if self.cuda else None
        # Issued, not yet completed, in issue order. in_flight[0] has sequence number
        # head_seq; every item up to sequence number must_complete is waited for as soon as
        # possible.
        self.in_flight: "collections.deque[InFlight]" = collections.deque()
        self.head_seq = 0
        self.must_complete = -1
        # CUDA: the newest step issued on each process group (None: the lane's own), and
        # the newest padded chunk's copy back ("copy"): what join() and seal() wait for.
        self.newest: Dict[object, object] = {}
        # The newest step of the lane's own group that the caller's stream waited for
        # before a synchronous collective (Issuer.synchronous_options); held no longer
        # than ``newest``.
        self.joined = None
        self.events: "collections.deque" = collections.deque()
        # Maps events onto the host clock (device_times): made where first needed; its
        # anchor renewed by the watchdog where the caller completes, else by the completion
        # thread once it is older than EventClock.REFRESH_S.
        self.clock: Optional[EventClock] = None
        self.group_end_ns = 0         # host-clock end of the group's newest timed step
        self.waiting_item: Optional[InFlight] = None     # what the thread waits on
        self.waiting_since = 0.0
        self.wake = threading.Condition(lock)
        self.batches = 0              # completions (each a batch of items)
        self.thread_batches = 0       # of which the completion thread's
        self.stopping = threading.Event()
        # The lane's failure, once it failed: a polled wait stops looking (its collective
        # may never end), and so does the watchdog.
        self.failure: Optional[BaseException] = None
        self.thread = start_thread(self._loop, f"commsched-{name}", f"cs-{name}-complete")

    # ---- from the issue path (lock held) -------------------------------------------------
    def add(self, chunk: Chunk, step: int, work, start, end, keep_end: bool) -> None:
        """A step completed on its own. The open batch ends before it, with an event of its
        own (the step's event covers the batch only where both ran on one stream)."""
        in_flight = self.in_flight
        if in_flight and in_flight[-1].open:
            batch = in_flight[-1]
            batch.open = False
            self.seal(batch)
        in_flight.append(InFlight(chunk, step, work, start, end, keep_end))

    def batch(self, chunk: Chunk, step: int, last: bool, work) -> None:
        """Add an untimed step with nothing waiting on its completion to the open batch."""
        in_flight = self.in_flight
        batch = in_flight[-1] if in_flight else None
        if batch is None or not batch.open:
            batch = InFlight(None, 0, work, None, None)
            batch.open = True
            batch.t_first_ns = chunk.t_dispatch_ns
            batch.iteration = chunk.request.iteration
            in_flight.append(batch)
        batch.work = work
        batch.count += 1
        if last:
            batch.nbytes += chunk.nbytes
            chunk.works = None            # (nothing completes it one by one)
            chunk.request = None          # nothing reads it again: see lane.release

    def bound(self) -> None:
        """Keep what is issued and not completed bounded: past ``LAZY_ITEMS`` steps in one
        batch or items in flight the completion thread completes them; a polled lane only
        closes an overgrown batch, and rings where its caller lets items pile up (no end of
        iteration). Nothing while the thread is at it."""
        if self.must_complete >= self.head_seq:
            return
        in_flight = self.in_flight
        if self.polled:
            if in_flight[-1].count >= LAZY_ITEMS:
                self.close_newest()
            elif len(in_flight) >= POLLED_ITEMS:
                self.ring()
        elif len(in_flight) >= LAZY_ITEMS or in_flight[-1].count >= LAZY_ITEMS:
            self.ring()

    def ring(self) -> None:
        """Have the completion thread complete everything issued so far."""
        newest = self.head_seq + len(self.in_flight) - 1
        if self.in_flight and newest > self.must_complete:
            item = self.in_flight[-1]
            item.open = False
            if self.cuda and item.end is None:
                self.seal(item)
            self.must_complete = newest
            self.wake.notify()

    def close_newest(self) -> None:
        """End the open batch, if any, with no event: the caller tells that it finished
        from its newest collective (``Work.is_completed()``, a query of the process group's
        own event). See [Note: no waits on the collective] in docs/design.md."""
        if self.in_flight and self.in_flight[-1].open:
            self.in_flight[-1].open = False

    def seal(self, item: InFlight) -> None:
        """Give ``item`` an end event after every step issued so far (on each group's
        stream): what the completion thread waits for, once for a whole batch."""
        caller = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(self.done_stream)
        try:
            for work in self.newest.values():
                work.wait()
            item.end = self.event()
            item.end.record(self.done_stream)
        finally:
            torch.cuda.set_stream(caller)

    def event(self):
        """A CUDA event from the pool, timed: the host-clock time of a step or batch comes
        from its events when it is completed later than it finished (device_times).
        Blocking-sync where the completion thread waits for steps as they finish (not
        polled): it sleeps in synchronize() instead of spinning. Not on a polled lane, whose
        caller only queries them: the driver services each blocking-sync event's completion
        on a thread of its own."""
        try:
            return self.events.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True, blocking=not self.polled)

    def pending(self) -> bool:
        """Whether anything issued is not completed yet."""
        return bool(self.in_flight)

    # ---- completion thread ---------------------------------------------------------------
    def _loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self.lock:
                while self.must_complete < self.head_seq:
                    if self.stopping.is_set():
                        return            # (close() rang: everything issued was completed)
                    self.wake.wait()
                # One wait on the last item that must complete covers every item before it
                # where the device completes them in order; under a credit window the
                # oldest goes first, as its credit is what dispatch waits for.
                ordered = self.ordered and not self.credit.limit
                index = self.must_complete - self.head_seq if ordered else 0
                item = self.in_flight[index]
                self.waiting_item, self.waiting_since = item, time.monotonic()
            self.wait(item)
            self.settle(item)
            item = None       # not held while idle: a work may hold buffers (lane.settle)

    def wait(self, item: InFlight) -> None:
        """Block until the item's collective finished on the device: on CUDA the event
        recorded on the done stream after it (GIL released), on gloo ``work.wait()``. A
        polled lane's events do not block (see event()): its completion thread, rung only
        for what the caller left behind, looks at the event at growing intervals, until
        the lane failed (its watchdog gave up on it)."""
        try:
            end = item.end
            if end is None:
                item.work.wait()
            elif not self.polled:
                end.synchronize()
            else:
                pause = WAIT_POLL_S
                while not end.query():
                    if self.failure is not None:
                        item.error = self.failure
                        return
                    time.sleep(pause)
                    pause = min(2 * pause, WAIT_POLL_MAX_S)
        except Exception as exc:  # the collective failed (peer gone, timeout, ...)
            item.error = exc

    def close(self, failed: bool) -> None:
        """Have the thread complete what was issued, then end."""
        self.stopping.set()
        # (A thread stuck in a failed collective may hold the lock: do not wait for it.)
        if self.lock.acquire(timeout=1):
            try:
                self.ring()
                self.wake.notify()
            finally:
                self.lock.release()
        # After a failure the completion thread may be stuck in a collective that will
        # never finish; it is a daemon thread and must not hold up the exit.
        self.thread.join(timeout=1 if failed else 10)

    # ---- taking what finished (lock held) ------------------------------------------------
    def take(self, waited: Optional[InFlight], t_seen: int
             ) -> Optional[Tuple[List[InFlight], Times]]:
        """The items to complete now, in issue order, and their host-clock device times
        (``device_times``): ``waited``, which the completion thread waited for, and what
        finished with it; or, with ``waited`` None, what the device finished of what the
        caller must complete (polled: the caller's thread, at its end of iteration). None
        where there is nothing, or the completion thread was rung (it is at it)."""
        if waited is None:
            if self.waiting_item is not None or self.must_complete >= self.head_seq:
                return None
            batch = self._take_finished(None)
            if not batch:
                return None
        else:
            self.waiting_item = None
            batch = self._take_finished(waited)
            self.thread_batches += 1
        self.batches += 1
        times = self.device_times(batch, t_seen)
        if not self.in_flight:
            self.newest.clear()           # (a work may hold buffers, see lane.settle)
            self.joined = None
        return batch, times

    def _take_finished(self, waited: Optional[InFlight]) -> List[InFlight]:
        """Pop, in issue order, the items up to ``waited`` (finished: the thread waited for
        it, and on CUDA what precedes it finished first) and any finished after it.
        Everything that finished is completed under one lock acquisition: fewer hand-offs
        of the GIL between this thread and the training thread. ``waited`` None (CUDA, the
        caller polls): the closed items at the head that finished."""
        batch = []
        in_flight = self.in_flight
        seen = waited is None
        while in_flight:
            item = in_flight[0]
            if seen and not self._finished(item, polled=waited is None):
                break
            in_flight.popleft()
            self.head_seq += 1
            if item is waited:
                seen = True
            elif not self.cuda:
                self.wait(item)           # returns at once; surfaces a failure
            batch.append(item)
        return batch

    @staticmethod
    def _finished(item: InFlight, polled: bool) -> bool:
        """Whether ``item`` finished on the device, never blocking: its end event, else its
        newest collective. A caller polling (``polled``) leaves the batch still open (the
        iteration's, which later steps may join) to its next end of iteration."""
        if item.end is not None:
            return item.end.query()
        if polled and item.open:
            return False
        return item.work.is_completed()

    def device_times(self, batch: List[InFlight], t_seen: int) -> Times:
        """Host-clock (start, end) of each item's collective on the device, start None
        where no event tells it (the step's dispatch stands in, see lane.settle). Events
        are mapped onto the host clock by the ``EventClock`` (the thread may get to an item
        long after it finished; no wait there):

        * an end event: its time, and the start that much earlier as the start event
          says;
        * a start event alone (the group times its own collectives): the collective began
          at the later of its start event (its inputs ready in the issuing stream) and the
          end of the group's previous one (NCCL runs a group's collectives in issue
          order), and took what the process group measured (``Work._get_duration()``);
        * no event (an untimed completion batch, gloo), or one that cannot be timed (a
          failed step): ``t_seen``, when this thread saw it finish."""
        times: Times = [(None, t_seen)] * len(batch)
        if not self.cuda or all(item.start is None and item.end is None for item in batch):
            return times          # (nothing reads a batch's time: lane.settle)
        clock = self.clock
        if clock is None:
            clock = self.clock = EventClock(torch.cuda.Stream(self.device))    # (idle stream)
        if not self.polled and clock.age_s() > EventClock.REFRESH_S:
            try:
                clock.refresh()           # (the completion thread: it may wait)
            except RuntimeError:
                return times              # a failing device
        previous = self.group_end_ns
        for index, item in enumerate(batch):
            start, end = item.start, item.end
            if item.error is not None or (start is None and end is None):
                continue
            try:
                if end is not None:
                    t_end = clock.host_times_ns([end])[0]
                    t_start = (None if start is None
                               else t_end - int(start.elapsed_time(end) * 1e6))
                else:
                    t_start = max(clock.host_times_ns([start])[0], previous)
                    t_end = t_start + int(item.work._get_duration() * 1e6)
            except RuntimeError:          # an event that did not complete (a failure)
                continue
            times[index] = (t_start, t_end)
            if item.chunk is None or not item.chunk.request.cross_group:
                previous = max(previous, t_end)       # (a step on the lane's own group)
        self.group_end_ns = previous
        return times

    def recycle(self, batch: List[InFlight]) -> None:
        """The events of completed items back into the pool (lock not needed: a deque's
        appends and pops are atomic)."""
        events = self.events
        for item in batch:
            if item.start is not None:
                events.append(item.start)
            if item.end is not None and not item.keep_end:
                events.append(item.end)


class Watchdog:
    """A thread per lane that turns a collective that never completes (a dead peer,
    mismatched collectives) into an error on this rank, through the lane's ``stalled``
    callback; hands the completion thread what a polled lane left in flight longer than
    its period (the caller stopped ending iterations: the end of training, an
    evaluation); and, where the caller completes timed steps (``refresh_clock``), renews
    the anchor of the completion side's event clock, so that mapping their end events onto
    the host clock never waits on the caller's thread. Owns its period and thread; reads
    the completion side under its lock."""

    __slots__ = ("completion", "timeout_s", "stalled", "refresh_clock", "period", "thread")

    def __init__(self, completion: Completion, timeout_s: float,
                 stalled: Callable[[InFlight], None], refresh_clock: bool):
        self.completion = completion
        self.timeout_s = timeout_s
        self.stalled = stalled
        self.refresh_clock = refresh_clock and completion.polled
        self.period = min(max(timeout_s / 10.0, 0.05), 5.0,
                          EventClock.REFRESH_S if self.refresh_clock else math.inf)
        name = completion.name
        self.thread = start_thread(self._run, f"commsched-{name}-watchdog",
                                   f"cs-{name}-watchdog")

    def _run(self) -> None:
        completion = self.completion
        while not completion.stopping.wait(self.period):
            clock = completion.clock if self.refresh_clock else None
            if clock is not None:
                try:
                    clock.refresh()           # (not under the lock: it waits for the device)
                except RuntimeError:
                    pass                      # a failing device: the wait below reports it
            with completion.lock:
                if completion.failure is not None:
                    return
                # Only a wait can stall: unfinished chunks nobody waits for yet are not late.
                item = completion.waiting_item
                if item is None:
                    self._hand_over_stale()
                    continue
                if time.monotonic() - completion.waiting_since <= self.timeout_s:
                    # (not held while this thread sleeps: its work may hold buffers, and
                    # its chunk would outlive the iteration, see Completion._loop)
                    item = None
                    continue
            self.stalled(item)
            return

    def _hand_over_stale(self) -> None:
        """Ring the completion thread for what a polled lane issued over a period ago
        (lock held)."""
        completion = self.completion
        in_flight = completion.in_flight
        if not (completion.polled and in_flight
                and completion.must_complete < completion.head_seq):
            return
        head = in_flight[0]
        issued = head.t_first_ns if head.chunk is None else head.chunk.t_dispatch_ns
        if time.time_ns() - issued > self.period * 1e9:
            completion.ring()

    def join(self) -> None:
        self.thread.join(timeout=1)       # (wakes at the completion side's ``stopping``)
