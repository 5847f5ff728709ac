import os
import sys

import pytest
import torch.distributed as dist

# Test modules and the spawned workers they start import the helpers in this folder
# (distributed.py) by name; spawn hands sys.path to the children.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed import free_port  # noqa: E402  (needs the path above)


@pytest.fixture(scope="module")
def world1():
    """A one-rank gloo group for the module's in-process tests."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
