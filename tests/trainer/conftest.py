import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    """A real one-process gloo group, for the collective calls of code tested inside the test process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
