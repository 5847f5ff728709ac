"""Per-thread CPU sampler for benchmark runs (``megatron_e2e.py --thread-cpu``; started by
this directory's ``sitecustomize``). In a process with ``RANK`` and ``BENCH_THREAD_CPU_DIR`` set (a torchrun worker),
a daemon thread appends, every ``BENCH_THREAD_CPU_PERIOD_S`` (0.2 s), one JSON line to
``$BENCH_THREAD_CPU_DIR/rank<RANK>-pid<pid>.jsonl``: ``{"t": <time.time()>, "threads":
{tid: [name, ns on a CPU]}}`` from /proc (Linux; nothing elsewhere; the main thread is
named "main"). A process a worker spawns (a data loader's) inherits ``RANK`` and samples
itself into a file of its own. Reading /proc costs well under a millisecond a sample, the
same in every variant. Standard library only.
"""

import os


def _threads():
    root = "/proc/self/task"
    pid = str(os.getpid())
    out = {}
    for tid in os.listdir(root):
        try:
            with open(f"{root}/{tid}/schedstat") as f:
                on_cpu = int(f.read().split()[0])
            with open(f"{root}/{tid}/comm") as f:
                name = "main" if tid == pid else f.read().strip()
        except (OSError, ValueError, IndexError):
            continue                      # a thread that ended meanwhile
        out[tid] = [name, on_cpu]
    return out


def _sample_forever(path, period):
    import json
    import time

    with open(path, "a") as f:
        while True:
            f.write(json.dumps({"t": time.time(), "threads": _threads()}) + "\n")
            f.flush()
            time.sleep(period)


def start():
    directory = os.environ.get("BENCH_THREAD_CPU_DIR")
    rank = os.environ.get("RANK")
    if not directory or rank is None or not os.path.isdir("/proc/self/task"):
        return
    import threading

    os.makedirs(directory, exist_ok=True)
    period = float(os.environ.get("BENCH_THREAD_CPU_PERIOD_S", "0.2"))
    threading.Thread(target=_sample_forever, name="bench-thread-cpu", daemon=True,
                     args=(os.path.join(directory, f"rank{rank}-pid{os.getpid()}.jsonl"),
                           period)).start()
