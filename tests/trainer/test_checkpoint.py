"""Checkpoint loading, in the test process (one rank)."""

import torch

from paratrain.train.checkpoint import Checkpointer, rng_state
from paratrain.train.loop import Trainer


class RecordingEngine:
    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_resume_on_a_non_cpu_device_restores_the_rng_state(one_rank_group, tmp_path):
    """A job training on a GPU resumes from its checkpoint. The meta device stands in for CUDA: an RNG state
    loaded onto either is refused by torch.set_rng_state ("RNG state must be a torch.ByteTensor")."""
    checkpointer = Checkpointer(tmp_path, rank=0, world_size=1, layout="dp1·tp1·pp1 z0 fp32")
    torch.manual_seed(7)
    saved_rng = rng_state()
    weights = torch.arange(4.0)
    checkpointer.save(3, {"engine": {"weights": weights}, "rng": saved_rng},
                      {"losses": [], "gradNorms": [], "valLosses": [], "skippedSteps": 0})
    torch.manual_seed(8)
    engine = RecordingEngine()
    trainer = Trainer(spec=None, engine=engine, dims=None, corpus=None, device=torch.device("meta"), reporter=None,
                      checkpointer=checkpointer)

    trainer.resume()

    assert trainer.result.start_step == 3
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"])
    assert torch.equal(engine.state["weights"], weights)  # on the CPU: the engine copies it onto its device
