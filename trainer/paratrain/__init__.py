"""paratrain: train with data, pipeline, tensor, ZeRO and mixed-precision parallelism from one spec."""

__version__ = "0.1.0"
