"""Benchmark helpers for the workers of a launch: ``megatron_e2e.py`` puts this directory
first on their PYTHONPATH, so every Python process of the run imports it at start-up. Each
helper acts only where its variable is set, in a torchrun worker (``RANK`` set):

  BENCH_THREAD_CPU_DIR   per-thread CPU samples (bench_thread_cpu.py, ``--thread-cpu``)
  BENCH_INTERLEAVE       stock and patched iterations in blocks (bench_interleave.py)

A ``sitecustomize`` further down ``sys.path`` (an environment's own) still runs, after
these.
"""

import os


def _chain():
    """Run the first sitecustomize on sys.path after this directory (which shadows it)."""
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    folders = [os.path.abspath(entry or ".") for entry in sys.path]
    below = folders[folders.index(here) + 1:] if here in folders else folders
    for folder in below:
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("RANK") is not None:
    if os.environ.get("BENCH_THREAD_CPU_DIR"):
        import bench_thread_cpu
        bench_thread_cpu.start()
    if os.environ.get("BENCH_INTERLEAVE"):
        import bench_interleave
        bench_interleave.start()
_chain()
