"""The models: one module per family (gpt, llama), the registry that builds one from a spec (registry), their
weights (weights: drawn by name, or read from Hugging Face), and the Hugging Face mapping (hf, hf_config).

Nothing here knows a parallel layout: each family declares what the modes need (`tp_plan`, `embeddings`,
`final`, `residual_projections`) on its model class, and train/parallel/ reads it from there.
"""
