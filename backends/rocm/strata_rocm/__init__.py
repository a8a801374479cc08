"""strata_rocm: the AMD backend of Strata Core, through cupy's ROCm build (cupy-rocm-7-0).

Importing this package never imports cupy; `strata_rocm.backend` is the plugin (entry point `strata.backends: rocm`).
"""
