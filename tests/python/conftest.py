"""Fixtures shared by the single-process test files."""
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world1():
    """A one-rank gloo group (file:// store) for the module's tests; destroyed after them."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
