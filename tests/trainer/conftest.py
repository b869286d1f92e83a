import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def one_rank_group():
    """A real one-process gloo group, for the collective calls of code tested inside the test process. One per
    session: DeepSpeed caches the groups it sees, so a second default group would confuse it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
