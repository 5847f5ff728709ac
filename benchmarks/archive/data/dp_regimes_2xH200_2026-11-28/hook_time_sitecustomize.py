"""Host time of the data-parallel mode's entry points per training step, for
dp_regimes_2xH200_2026-11-28.md: with HOOKTIME=1 and this directory first on PYTHONPATH
(PYTHONPATH=<this directory>:<checkout>), every process wraps the engine's hooks and
Scheduler.submit in a wall-clock timer and prints, when the engine closes, per step: calls
and milliseconds per entry point ("@bg": on a thread other than the main one, autograd's).
Times are inclusive (_grad_post_hook holds _submit, which holds _adopt and submit) and hold
the timers' own cost and any wait for the GIL.
"""
import os
if os.environ.get("HOOKTIME") == "1":
    import collections, functools, threading, time
    try:
        from commsched.overlap import engine as E
        from commsched import scheduler as S
    except Exception as e:  # noqa
        print("[hooktime] not installed:", e, flush=True)
    else:
        stats = collections.defaultdict(lambda: [0, 0.0])
        steps = [0]
        def wrap(cls, name):
            fn = getattr(cls, name)
            @functools.wraps(fn)
            def w(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    s = stats[(name, threading.current_thread() is threading.main_thread())]
                    s[0] += 1
                    s[1] += time.perf_counter() - t
            setattr(cls, name, w)
        for n in ("_grad_pre_hook", "_grad_post_hook", "_submit", "_adopt", "_forward_pre_hook",
                  "step", "zero_grad", "_end_backward", "_settle", "_settle_with_ready",
                  "_settle_batch", "_run_updates", "before_forward"):
            wrap(E.OverlapEngine, n)
        wrap(S.Scheduler, "submit")
        orig_step = E.OverlapEngine.step
        def step(self, kwargs):
            steps[0] += 1
            return orig_step(self, kwargs)
        E.OverlapEngine.step = step
        def report(tag):
            import torch.distributed as dist
            n = max(1, steps[0])
            r = dist.get_rank() if dist.is_initialized() else -1
            rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
            print(f"[hooktime] rank {r} {tag} {steps[0]} steps: " + "; ".join(
                f"{k[0]}{'' if k[1] else '@bg'} {v[0] / n:.0f}x {v[1] * 1e3 / n:.2f}ms"
                for k, v in rows), flush=True)
            stats.clear(); steps[0] = 0
        orig_close = E.OverlapEngine.close
        def close(self):
            report("close")
            return orig_close(self)
        E.OverlapEngine.close = close
