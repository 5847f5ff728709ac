"""What a training iteration leaves to Python's cycle collector ([Note: no cycles on the hot
path] in docs/design.md), measured with the collector off.

- ``steady_state(step)``: per iteration, the change of the collector's generation-0 count
  (gc-tracked objects allocated less those freed), and the change of the live gc-tracked
  objects over several iterations. An object freed by reference counting within the
  iteration counts nothing; one in a reference cycle, or kept by something that grows,
  counts for good: that is what makes the collector run.
- ``Lifetimes``: weak references to every Request, Chunk and collective work the scheduler
  makes in an iteration, to check, with the collector off, that none outlives the next one.

Used by spawned test workers; results go back as plain data.
"""

from __future__ import annotations

import collections
import gc
import statistics
import sys
import time
import weakref
from typing import Callable, Dict, List


# Objects that a process makes once, whenever it first gets there, not per iteration: an
# ABC's caches of the types checked against it (a set and weak references each), say.
ONE_OFF = 4


def steady_state(step: Callable[[], None], settle: Callable[[], None] = lambda: None,
                 warmup: int = 4, iterations: int = 20) -> Dict:
    """Run ``step`` ``warmup`` times, then ``iterations`` times with the collector off,
    each followed by ``settle()`` (what the iteration started has finished: the
    scheduler's threads are done with it; not counted). Returns ``per_iteration``, the
    median generation-0 count delta of an iteration, ``deltas``, each of them, and
    ``survivors``, the live gc-tracked objects after the last iterations less after the
    first ones (the median of five each: the count sits at one level with now and then a
    few objects fewer, those that the scheduler's threads or the deferred updates let go
    of at the moment it was taken; a leak of one object per iteration shows as about 15).
    A few objects may appear once, not per iteration (``ONE_OFF``)."""
    for _ in range(warmup):
        step()
    settle()
    gc.collect()
    gc.disable()
    # The count is not decremented below zero: keep it well above, so that frees count.
    ballast = [[] for _ in range(5000)]
    try:
        deltas = []
        live = []
        before = gc.get_count()[0]
        for i in range(iterations):
            step()
            settle()
            after = gc.get_count()[0]
            deltas.append(after - before)
            live.append(len(gc.get_objects()))
            before = gc.get_count()[0]
    finally:
        del ballast
        gc.enable()
    return {"per_iteration": statistics.median(deltas), "deltas": deltas,
            "survivors": statistics.median(live[-5:]) - statistics.median(live[:5])}


def settled(*schedulers) -> Callable[[], None]:
    """A ``settle`` for ``steady_state``: every scheduler drained, and a moment for its
    completion thread to let go of what it settled last (outside the lane's lock)."""
    def settle():
        for scheduler in schedulers:
            if scheduler is not None:
                scheduler.drain(timeout=60)
        time.sleep(0.02)
    return settle


def keep_no_gloo_works() -> None:
    """``commsched.workers.retain`` keeps the newest gloo collectives referenced, by
    design (a bounded deque, against a race at interpreter exit that a worker ending with
    ``exit_worker`` does not run into): off here, so that what keeps a work alive
    otherwise shows."""
    import commsched.workers

    commsched.workers._recent_works = collections.deque(maxlen=0)


class Lifetimes:
    """Weak references to what the scheduler makes per iteration: ``Scheduler.submit``'s
    Request and its Chunks, and the work of every issued step (patched in this process
    while ``run`` runs; after ``fake_cuda.install`` where that is used, so that its works
    are seen)."""

    def __init__(self) -> None:
        self.made: List[List[weakref.ref]] = []

    def _install(self):
        import commsched.issue as issue
        from commsched.scheduler import Scheduler

        submit, issue_step, made = Scheduler.submit, issue.issue_step, self

        def tracked_submit(scheduler, *args, **kwargs):
            request = submit(scheduler, *args, **kwargs)
            current = made.made[-1]
            current.append(weakref.ref(request))
            current.extend(weakref.ref(chunk) for chunk in request.chunks)
            return request

        def tracked_issue_step(chunk, step):
            work = issue_step(chunk, step)
            if work is not None:
                made.made[-1].append(weakref.ref(work))
                wrapper = getattr(sys.modules.get("fake_cuda"), "_Waited", None)
                if wrapper is not None and isinstance(work, wrapper):
                    made.made[-1].append(weakref.ref(work.work))
            return work

        Scheduler.submit = tracked_submit
        issue.issue_step = tracked_issue_step

        def uninstall():
            Scheduler.submit = submit
            issue.issue_step = issue_step
        return uninstall

    def run(self, step: Callable[[], None], settle: Callable[[], None] = lambda: None,
            iterations: int = 4) -> List[List[str]]:
        """Run ``iterations`` iterations with the collector off, each followed by
        ``settle()`` (see ``steady_state``); returns, per iteration but the last, what it
        made that was still alive when the next one ended (nothing, as it should be: names
        of the objects otherwise)."""
        self.made = []
        uninstall = self._install()
        gc.collect()
        gc.disable()
        try:
            left = []
            for i in range(iterations):
                self.made.append([])
                step()
                settle()
                if i:
                    left.append([_describe(ref()) for ref in self.made[i - 1]
                                 if ref() is not None])
            made = sum(len(m) for m in self.made)
        finally:
            gc.enable()
            uninstall()
        if not made:
            raise AssertionError("the scheduler made nothing: the tracking did not apply")
        return left


def _describe(obj) -> str:
    key = getattr(obj, "key", None)
    return f"{type(obj).__name__}({key!r})" if key is not None else type(obj).__name__
