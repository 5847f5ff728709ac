"""commsched.workers.exit_worker: exit handlers run, output is flushed, the status is kept,
and the interpreter is not finalized."""

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
