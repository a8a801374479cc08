"""strata_cuda: the NVIDIA backend of Strata Core, through cupy (CUDA build) and nvidia-ml-py.

Importing this package never imports cupy; `strata_cuda.backend` is the plugin (entry point `strata.backends: cuda`).
"""
