"""The trainer: every process of a job runs `paratrain train`, which composes the parallel modes from the spec."""
