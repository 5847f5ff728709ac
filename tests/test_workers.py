"""commsched.workers.exit_worker: exit handlers run, output is flushed, the status is kept,
and the interpreter is not finalized."""

import json
import subprocess
import sys
import textwrap

# The child leaves output in its buffers (stdout is a pipe: block-buffered), registers an
# exit handler, and keeps an object whose __del__ prints when the interpreter finalizes.
CHILD = textwrap.dedent("""
    import atexit, os, sys
    from commsched.workers import exit_worker

    class Kept:
        def __del__(self):
            os.write(1, b"finalized\\n")

    kept = Kept()
    atexit.register(lambda: print("exit handler ran"))
    print("buffered", end="")
    sys.stderr.write("to stderr ")
    exit_worker(int(sys.argv[1]))
    print("not reached")
""")


def _run(code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(code)], capture_output=True,
                          text=True, timeout=60)


def test_exit_worker_runs_exit_handlers_flushes_and_keeps_the_status():
    proc = _run(0)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "bufferedexit handler ran\n"
    assert proc.stderr == "to stderr "
    proc = _run(3)
    assert proc.returncode == 3
    assert proc.stdout == "bufferedexit handler ran\n"


def test_a_normal_exit_would_finalize():
    # The reference for the test above: the same child returning normally runs the
    # finalizer at interpreter shutdown, which exit_worker skips.
    child = CHILD.replace("exit_worker(int(sys.argv[1]))", "pass")
    proc = subprocess.run([sys.executable, "-c", child, "0"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "bufferednot reached\nexit handler ran\nfinalized\n"


# A one-rank gloo group in a child of its own: settle_gloo_workers finds the group's worker
# threads by the name torch gives them (if torch renamed them, the wait would silently do
# nothing), returns at once without any, and once they are back waiting for work.
SETTLE_CHILD = textwrap.dedent("""
    import json, os, sys, tempfile, time
    import torch
    import torch.distributed as dist
    from commsched import workers

    before = workers._gloo_worker_states()
    t0 = time.monotonic()
    settled_without = workers.settle_gloo_workers()
    without_s = time.monotonic() - t0
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    for _ in range(3):
        dist.all_reduce(torch.ones(1024))
    during = workers._gloo_worker_states()
    settled = workers.settle_gloo_workers(timeout_s=10)
    after = workers._gloo_worker_states()
    dist.destroy_process_group()
    print(json.dumps(dict(before=before, settled_without=settled_without,
                          without_s=without_s, during=during, settled=settled, after=after)))
    workers.exit_worker(0)
""")


def test_settle_finds_the_gloo_worker_threads_and_returns_once_they_wait():
    proc = subprocess.run([sys.executable, "-c", SETTLE_CHILD], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["before"] == [] and seen["settled_without"] is True
    assert seen["without_s"] < 0.05
    # gloo's default: two worker threads per group (a thread names itself as it starts:
    # one that never ran yet still has its parent's name, and has run nothing)
    assert 1 <= len(seen["during"]) <= 2
    assert seen["settled"] is True and seen["after"] == ["S"] * len(seen["after"])


# Threads that stand in for gloo's workers (named as torch names them): one busy (runnable)
# for a while, then asleep; one busy past the timeout.
BUSY_CHILD = textwrap.dedent("""
    import json, threading, time
    from commsched import workers
    from commsched.threads import _set_os_name

    def worker(busy_s):
        _set_os_name(workers.GLOO_WORKER_THREAD)
        end = time.monotonic() + busy_s
        while time.monotonic() < end:
            pass
        time.sleep(60)

    out = {}
    for name, busy_s, timeout_s in (("done_in_time", 0.3, 10.0), ("past_timeout", 3.0, 0.3)):
        threading.Thread(target=worker, args=(busy_s,), daemon=True).start()
        while len(workers._gloo_worker_states()) < len(out) + 1:
            time.sleep(0.001)
        t0 = time.monotonic()
        settled = workers.settle_gloo_workers(timeout_s=timeout_s)
        out[name] = dict(settled=settled, waited_s=time.monotonic() - t0)
        if name == "done_in_time":
            out[name]["states_after"] = workers._gloo_worker_states()
    print(json.dumps(out))
    workers.exit_worker(0)
""")


def test_settle_waits_for_a_running_worker_and_gives_up_at_its_timeout():
    proc = subprocess.run([sys.executable, "-c", BUSY_CHILD], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    done, past = seen["done_in_time"], seen["past_timeout"]
    # returned only once the worker went to sleep, at most 0.3 s after it started
    assert done["settled"] is True and done["waited_s"] >= 0.1, seen
    assert done["states_after"] == ["S"], seen
    # the second worker stays runnable for 3 s: settle gives up at 0.3 s, not later
    assert past["settled"] is False and 0.3 <= past["waited_s"] < 2.5, seen
