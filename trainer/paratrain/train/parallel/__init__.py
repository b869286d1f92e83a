"""The parallel modes, one module each, and the one place they are composed (parallelize):

dims (the mesh) · data_parallel (DDP, the overlapped reducer) · tensor_parallel · pipeline · zero1 (ZeRO-1's
sharded optimizer) · fsdp (ZeRO-2/3 through FSDP2) · activation_checkpoint · precision (autocast, loss scaling) ·
tensors (tensors held in parts across ranks).

Nothing here imports a model family or the run: a mode takes a module and a mesh, and reads what a family
declares (`tp_plan`, `embeddings`, ...) from the module itself.
"""
