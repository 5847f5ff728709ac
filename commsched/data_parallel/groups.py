"""Layer groups: the unit of communication and of optimizer update in the data-parallel mode.

A layer group is a run of consecutive parameter-owning modules, in registration order (the
first layer first), whose gradients live in one flat buffer. The layout is fixed at wrap
time from the module tree alone, so it is identical on every rank:

  module tree (registration order)      layer groups (group_bytes = 0: one per module)
    embed.weight                         g0: [embed.weight]
    block0.ln.{weight,bias}              g1: [ln.weight | ln.bias | fc.weight | fc.bias]
    block0.fc.{weight,bias}                  (group_bytes > 0 merges small modules)
    head.weight                          g2: [head.weight]

After backward each parameter's ``.grad`` is a view of its slot in the group buffer,
what is communicated. (A gradient autograd hands over to a parameter without one is
copied into the slot with its group's, in one multi-tensor copy; later ones accumulate
into the slot.) The views handed out as ``.grad`` are
``GradView`` tensors: any Python-level read of them (clip_grad_norm_, GradScaler.unscale_,
logging) first lets the engine finish the communication they are part of — see
``GradView.__torch_function__``.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["GradView", "LayerGroup", "build_groups", "grad_view_class", "sent", "narrows",
           "copy_flags", "plain"]


class GradView(torch.Tensor):
    """A gradient living in a layer group's flat buffer.

    Autograd accumulates into it in C++ (no Python involved). A Python-level operation on
    it calls the owning engine's ``on_grad_access()`` first, which waits for the
    communication in flight, so that the caller sees averaged gradients as it would after
    DDP's backward. The engine's own optimizer updates run with subclass dispatch disabled.
    Each engine makes its own subclass, whose ``_engine`` is a weak reference to it.
    """

    _engine: Optional["weakref.ReferenceType"] = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__" or _gets_data(func):
            for t in types:
                ref = getattr(t, "_engine", None)
                engine = ref() if ref is not None else None
                if engine is not None:
                    engine.on_grad_access()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _gets_data(func) -> bool:
    # Reading metadata (shape, device, dtype, ...) needs no data; `.data` hands it out.
    return getattr(getattr(func, "__self__", None), "__name__", "") in ("data", "real", "imag")


def grad_view_class(engine) -> type:
    """A GradView subclass bound (weakly) to ``engine``."""
    return type("GradView", (GradView,), {"_engine": weakref.ref(engine),
                                          "__module__": __name__})


class LayerGroup:
    """Parameters whose gradients share one flat buffer, one request per iteration.

    Layout fields are fixed at wrap time; the rest is the group's run-time state, owned by
    the engine (training thread and autograd hooks; never the completion thread).
    """

    __slots__ = (
        # layout
        "index", "params", "names", "first", "offsets", "numel", "padded", "dtype", "device",
        "buffer", "grads", "grad_views", "flags", "opt_params", "owned", "fully_owned",
        # zero (rs_ag) layout
        "param_buffer", "shard", "shard_params",
        # run-time state
        "request", "submitted_iter", "ready", "all_used", "actions", "param_request",
        "needs_gather", "grads_full", "consistent",
        # row gradients (sparse.py): the group holds one embedding weight
        "sparse", "priority",
        # the gradients in the communication type (COMMSCHED_GRAD_REDUCE_DTYPE), or None;
        # its per-parameter views and usage flags, as in the buffer
        "comm", "comm_grads", "comm_flags",
        # storage.py: the buffer's (and the copy's) memory given back to the allocator; the
        # tensors of the engine's own on the buffer's storage, and references to its views
        "released", "comm_released", "uses", "view_refs",
    )

    def __init__(self, index: int, named: Sequence[Tuple[str, torch.nn.Parameter]], first: int):
        self.index = index
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.first = first                      # global index of params[0]
        self.offsets: List[int] = []
        off = 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.padded = off
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.buffer: Optional[torch.Tensor] = None
        self.grads: List[torch.Tensor] = []        # plain views (engine's own use)
        self.grad_views: List[torch.Tensor] = []   # GradView views (handed out as .grad)
        self.flags: Optional[torch.Tensor] = None
        # Per optimizer param group k: the group's parameters the optimizer owns.
        self.opt_params: List[Tuple[int, List[torch.nn.Parameter]]] = []
        self.owned: List[bool] = []
        self.fully_owned = False
        self.param_buffer = None
        self.shard = (0, 0)
        self.shard_params = []
        self.request = None
        self.submitted_iter = -1
        self.ready = 0
        self.all_used = True
        self.actions: list = []
        self.param_request = None
        self.needs_gather = False
        self.grads_full = True
        self.consistent = True
        self.sparse = None                      # SparseSlot of the group's weight
        self.priority = index                   # lower: needed earlier by the forward
        self.comm: Optional[torch.Tensor] = None
        self.comm_grads: List[torch.Tensor] = []
        self.comm_flags: Optional[torch.Tensor] = None
        self.released = False
        self.comm_released = False
        self.uses = 0
        self.view_refs = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def allocate(self, view_cls: type, flags: bool, multiple: int = 1) -> None:
        """Create the flat gradient buffer (padded to ``multiple`` elements, plus one usage
        flag per parameter at the end when ``flags``) and the per-parameter views."""
        self.padded = -(-self.numel // multiple) * multiple
        extra = len(self.params) if flags else 0
        self.buffer = torch.zeros(self.padded + extra, dtype=self.dtype, device=self.device)
        self.grads = [self.buffer.narrow(0, off, p.numel()).view(p.shape)
                      for off, p in zip(self.offsets, self.params)]
        self.grad_views = [g.as_subclass(view_cls) for g in self.grads]
        self.flags = self.buffer.narrow(0, self.padded, extra) if flags else None

    def allocate_comm(self, dtype: torch.dtype) -> None:
        """A copy of the buffer in ``dtype`` (what is sent with a narrower communication
        type), with the same layout: per-parameter views, padding (zero, never written) and
        flags."""
        self.comm = torch.zeros(self.buffer.numel(), dtype=dtype, device=self.device)
        self.comm_grads = [self.comm.narrow(0, off, p.numel()).view(p.shape)
                           for off, p in zip(self.offsets, self.params)]
        self.comm_flags = (None if self.flags is None
                           else self.comm.narrow(0, self.padded, self.flags.numel()))

    def __repr__(self) -> str:
        return f"LayerGroup({self.index}, params={len(self.params)}, numel={self.numel})"


def build_groups(module: torch.nn.Module, group_bytes: int,
                 alone: Optional[Dict[int, bool]] = None, first_bytes: int = 0
                 ) -> Tuple[List[LayerGroup], Dict[torch.nn.Module, List[int]]]:
    """Cut ``module``'s trainable parameters into layer groups, in registration order.

    A group is closed at a module boundary once it holds at least ``group_bytes`` bytes of
    gradient (0: one group per parameter-owning module), and whenever dtype or device
    changes. ``first_bytes`` (0: off) caps the first groups instead: the first at
    ``first_bytes``, each next one at twice the one before, up to ``group_bytes``. A
    parameter shared by several modules belongs to the first one that registers it.
    ``alone`` (parameter id -> last): parameters that get a group of their own, in
    place, or (``last``) after every other group. Returns the groups and, per module
    owning parameters directly, the indices of the groups those parameters belong to (for
    the module's forward pre-hook).
    """
    alone = alone or {}
    seen: Dict[int, int] = {}
    runs: List[List[Tuple[str, torch.nn.Parameter]]] = []
    for mname, m in module.named_modules():
        run = []
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen[id(p)] = -1
                run.append((f"{mname}.{pname}" if mname else pname, p))
        if run:
            runs.append(run)
    groups: List[LayerGroup] = []
    current: List[Tuple[str, torch.nn.Parameter]] = []
    current_bytes = 0
    first = 0

    def close():
        nonlocal current, current_bytes, first
        if current:
            groups.append(LayerGroup(len(groups), current, first))
            first += len(current)
            current, current_bytes = [], 0

    def cap() -> int:
        # (groups of their own do not count: the sizes follow the other groups)
        k = len(groups) - placed
        return group_bytes if not first_bytes else min(group_bytes, first_bytes << min(k, 40))

    last, placed = [], 0
    for run in runs:
        if current and current_bytes >= cap():
            close()
        for name, p in run:
            if id(p) in alone:
                if alone[id(p)]:
                    last.append((name, p))
                else:
                    close()
                    current.append((name, p))
                    close()
                    placed += 1
                continue
            if current and (p.dtype != current[0][1].dtype or p.device != current[0][1].device):
                close()
            current.append((name, p))
            current_bytes += p.numel() * p.element_size()
    close()
    for named in last:
        current.append(named)
        close()
    for g in groups:
        for p in g.params:
            seen[id(p)] = g.index
    module_groups: Dict[torch.nn.Module, List[int]] = {}
    for m in module.modules():
        idx = sorted({seen[id(p)] for p in m.parameters(recurse=False) if id(p) in seen
                      and seen[id(p)] >= 0})
        if idx:
            module_groups[m] = idx
    return groups, module_groups


def sent(g: LayerGroup) -> torch.Tensor:
    """What the group's all-reduce sends: its buffer, or its copy in the communication
    type (``COMMSCHED_GRAD_REDUCE_DTYPE``)."""
    return g.buffer if g.comm is None else g.comm


def narrows(dtype: torch.dtype, to: torch.dtype) -> bool:
    """Whether casting floating-point gradients of ``dtype`` to ``to`` halves their bytes
    or more (float32 or float64 to bfloat16 or float16); gradients already that narrow go
    as they are."""
    return dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(to).bits


def copy_flags(dst: torch.Tensor, values: List[bool]) -> None:
    """``dst[:] = values`` (1 or 0) without making the host wait for the device: all true
    is a fill; otherwise a copy from pinned memory queued on the stream (the caching host
    allocator keeps that memory until the copy ran). A copy from pageable memory would
    synchronise the stream, i.e. wait for every kernel queued so far."""
    if all(values):
        dst.fill_(1)
    elif dst.is_cuda:
        dst.copy_(torch.tensor(values, dtype=dst.dtype, pin_memory=True), non_blocking=True)
    else:
        dst.copy_(torch.tensor(values, dtype=dst.dtype))


def plain():
    """GradView dispatch off: tensor operations on the slots themselves."""
    return torch._C.DisableTorchFunctionSubclass()
