"""commsched's own data-parallel mode: communication that crosses the iteration barrier.

DDP's comm-hook contract makes backward wait for every bucket, so gradient communication
can never overlap the next forward. Here it can (ByteScheduler's "crossing the barrier"):
gradients are reduced per layer group through the scheduler, ``optimizer.step()`` only
records the step, and each layer group is updated — by the real optimizer, restricted to
the group — just before the next forward needs it.

  wrap.py     wrap() / drain(), the model and optimizer wrappers
  engine.py   hooks, rank-invariant submission order, deferred per-group actions
  groups.py   layer groups: flat gradient buffers, GradView (.grad that syncs on read)
  update.py   per-group optimizer steps with recorded hyper-parameters
  zero.py     the rs_ag variant: reduce-scatter, sharded (ZeRO-1) update, all-gather
  sparse.py   embedding gradients as rows (Config.sparse_embedding_rows)
  storage.py  when a group's gradient memory exists (released after its update)

What falls back, and what is not supported:
- Reading gradients between backward() and the updates (clip_grad_norm_, GradScaler's
  unscale_, logging a gradient norm) waits for all gradient communication first, so the
  values are DDP's; that step is then synchronous. One DataParallelWarning, unless
  ``wrap(..., reads_grads=True)`` declares it. With rs_ag the gradients are all-gathered.
- Optimizers that couple parameters (apex FusedLAMB: a global norm) step once over the
  whole model, synchronously. LBFGS is rejected. rs_ag needs an elementwise optimizer.
- A parameter used outside the forward of the module that owns it may be used before its
  pending update: detected when it gets a gradient (RuntimeError), not under no_grad.
- Reentrant activation checkpointing is not supported (use_reentrant=False is);
  torch.autograd.grad() is not synchronised; torch.compile of the wrapped model, model
  moves/dtype changes after wrap() and deepcopy of the wrapped model are untested.
- After optimizer.zero_grad() (or model.zero_grad(), of the wrapped model or the one passed
  to wrap) a gradient is None once its group's update ran; until then it still reads as the
  averaged gradient (set_to_none semantics, deferred). A submodule's zero_grad() clears at
  once, and an update still pending then skips its parameters: drain() first.
- Layer groups, their priorities and the submission order follow module registration
  order. A model whose forward calls its modules in another order trains correctly, but
  the layer its forward needs first may be scheduled last, and backward submits nothing
  until the gradients of the first-registered group are ready (DDP rebuilds its buckets
  from the observed order instead).
- COMMSCHED_DECOMPOSE=hier / leader are refused (ValueError); auto is none.

Example::
    model, optimizer = commsched.data_parallel.wrap(model, optimizer)
    model(x).sum().backward(); optimizer.step(); optimizer.zero_grad()
"""

from .engine import DataParallelEngine, DataParallelWarning
from .update import state_bytes
from .wrap import DataParallelModel, DataParallelOptimizer, drain, wrap

__all__ = ["wrap", "drain", "DataParallelModel", "DataParallelOptimizer", "DataParallelEngine",
           "DataParallelWarning", "state_bytes"]
