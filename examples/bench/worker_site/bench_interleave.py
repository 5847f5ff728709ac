"""Stock and patched Megatron-LM iterations interleaved in one training run, for
``megatron_e2e.py --variants ...,interleaved`` (started by this directory's
``sitecustomize`` in a run of the patched launch script, ``COMMSCHED=1``).

In a torchrun worker (``RANK`` set) with ``BENCH_INTERLEAVE=K`` set, once the training
module (``BENCH_INTERLEAVE_TARGET``, default ``megatron.training.training:train_step``) is
imported, its training step is wrapped: before the step of logged iteration ``N`` (Megatron
passes ``iteration=N-1``), the bucket groups' collectives are switched, for the whole step,
to commsched's patched methods or to megatron's own, in blocks of ``K`` iterations:
``block(N) = (N - 1) // K``; even blocks run ``BENCH_INTERLEAVE_FIRST`` (``patched``, the
default, or ``stock``), odd blocks the other. Every rank switches at the same iteration.
The last rank (the one whose training log Megatron-LM prints) prints ``[interleave]
iteration N: patched|stock`` at each switch, which ``megatron_e2e.py`` checks against the
schedule it expects.

Why: two runs of the same Megatron-LM launch on one machine differ by a few percent from
one process to the next (``benchmarks/archive/megatron_gpt_24x1024_2xH100_2026-11-27.md``), more
than the difference to be measured; iterations of one process, alternating, do not carry
that offset.

Switching keeps commsched's registration of the bucket groups (done when they were built,
under the patches): the class's methods are exchanged, not re-applied. Before switching to
megatron's own, whatever the scheduler still has outstanding is ended and waited for, as
before any of megatron's own collectives (``Runtime.complete_outstanding``). Standard library
only at import.
"""

import os

CLASS_MODULE = "megatron.core.distributed.param_and_grad_buffer"
CLASS_NAME = "_ParamAndGradBucketGroup"
SWITCHED = ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync")
VARIANTS = ("patched", "stock")


def block_variant(iteration: int, every: int, first: str) -> str:
    """The variant that runs logged iteration ``iteration`` (1-based)."""
    other = VARIANTS[1] if first == VARIANTS[0] else VARIANTS[0]
    return first if ((iteration - 1) // every) % 2 == 0 else other


class Switch:
    """Exchanges ``_ParamAndGradBucketGroup``'s collective methods between commsched's
    replacements and megatron's originals (those the applied patches keep)."""

    def __init__(self, cls, runtime):
        self.cls = cls
        self.runtime = runtime
        self.patched = {name: cls.__dict__[name] for name in SWITCHED}
        self.current = "patched"

    def use(self, variant: str) -> bool:
        """Switch to ``variant``; True when that changed anything."""
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: expected one of {', '.join(VARIANTS)}")
        if variant == self.current:
            return False
        if variant == "stock":
            for state in self.runtime.states.values():
                self.runtime.complete_outstanding(state)
        methods = self.patched if variant == "patched" else self.runtime.originals
        for name in SWITCHED:
            setattr(self.cls, name, methods[name])
        self.current = variant
        return True


def _switch():
    import importlib

    from commsched import megatron_patches

    runtime = megatron_patches.current_runtime()
    if runtime is None:
        raise RuntimeError("BENCH_INTERLEAVE: commsched's megatron patches are not applied "
                           "(run the patched launch script, COMMSCHED=1)")
    return Switch(getattr(importlib.import_module(CLASS_MODULE), CLASS_NAME), runtime)


def wrap_step(step, every: int, first: str, printing: bool, out=print):
    """``step`` (called with ``iteration=N-1`` for logged iteration N), run in the variant
    of its block."""
    switch = None

    def interleaved_step(*args, **kwargs):
        nonlocal switch
        iteration = kwargs.get("iteration")
        if iteration is None:
            raise RuntimeError("BENCH_INTERLEAVE: the training step was called without "
                               "iteration=; cannot tell its block")
        variant = block_variant(iteration + 1, every, first)
        announce = switch is None             # (the first step says where it starts)
        if announce:
            switch = _switch()
        if switch.use(variant) or announce:
            if printing:
                out(f"[interleave] iteration {iteration + 1}: {variant}", flush=True)
        return step(*args, **kwargs)

    interleaved_step.__wrapped__ = step
    return interleaved_step


def _settings():
    every = int(os.environ["BENCH_INTERLEAVE"])
    if every < 1:
        raise ValueError(f"BENCH_INTERLEAVE={every}: expected iterations per block >= 1")
    first = os.environ.get("BENCH_INTERLEAVE_FIRST", "patched")
    if first not in VARIANTS:
        raise ValueError(f"BENCH_INTERLEAVE_FIRST={first!r}: expected one of "
                         f"{', '.join(VARIANTS)}")
    target = os.environ.get("BENCH_INTERLEAVE_TARGET", "megatron.training.training:train_step")
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"BENCH_INTERLEAVE_TARGET={target!r}: expected MODULE:FUNCTION")
    return every, first, module, name


class _Finder:
    """Wraps ``FUNCTION`` of ``MODULE`` right after the module is first executed."""

    def __init__(self, module, name, wrap):
        self.module, self.name, self.wrap = module, name, wrap

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, finder = spec.loader, self

        class _Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                import sys as _sys
                if finder in _sys.meta_path:
                    _sys.meta_path.remove(finder)
                setattr(module, finder.name, finder.wrap(getattr(module, finder.name)))

            def __getattr__(self, attr):
                return getattr(loader, attr)

        spec.loader = _Loader()
        return spec


def start():
    if not os.environ.get("BENCH_INTERLEAVE") or os.environ.get("RANK") is None:
        return
    import sys

    every, first, module, name = _settings()
    last = int(os.environ["RANK"]) == int(os.environ.get("WORLD_SIZE", "1")) - 1
    sys.meta_path.insert(0, _Finder(module, name,
                                    lambda step: wrap_step(step, every, first, last)))
