from pathlib import Path

import pytest

from ..trainer.harness import run_job
from .gang import checkpointed


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> tuple[dict, Path]:
    """The uninterrupted 12-step dp2 run every fault is compared with: its metrics and its checkpoints (3, 6, 9,
    12). Tests copy the checkpoints before touching them."""
    tmp = tmp_path_factory.mktemp("reference")
    _, metrics = run_job(tmp, checkpointed(tmp / "ckpt"))
    return metrics, tmp / "ckpt"
