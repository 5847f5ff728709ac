"""Tests only: let megatron-core's DDP run on the CPU with gloo.

megatron-core allocates its parameter and gradient buffers with
``device=torch.cuda.current_device()``, and 0.19's ``start_grad_sync`` takes
``torch.cuda.current_stream()`` (to order CUDA-graph gradient events) before any collective;
both raise on a CPU-only torch. Here they answer ``"cpu"`` and a stream that has nothing to
wait for. megatron's other CUDA calls sit on paths these tests do not take (several
distributed-optimizer instances, NCCL user buffers, SHARP). Install it in spawned test
workers only, never in the pytest process or in commsched.
"""

import torch

_originals = {}


class _HostStream:
    """The "current stream" of a CPU-only process: work is already ordered."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def install() -> None:
    """Patch ``torch.cuda.current_device`` / ``current_stream`` in this process (CPU-only
    torch only)."""
    if torch.cuda.is_available() or _originals:
        return
    _originals.update(current_device=torch.cuda.current_device,
                      current_stream=torch.cuda.current_stream)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda device=None: _HostStream()

