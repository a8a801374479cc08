"""How close to the float64 reference a kernel must land, derived from the precision path it declares.

A KernelSet (or a LayerOps) declares its precision path in a `precision` attribute: one string for every kernel
(`precision = "f32"`), or a mapping from kernel name to path (`precision = {"moe_grouped_ffn": "f16"}`; kernels it
does not name are "f32"). A kernel that declares nothing is held to "f32", the strictest path.

The paths and their bounds (relative error ||out - ref|| / ||ref||, the reference computed in float64):
- "f32": every intermediate and the accumulation in f32. The rounding error of a dot product of length n grows like
  sqrt(n) * 2^-24 (about 1e-6 for the kit's sizes and the tiny model's); the bound 1e-5 is ten times that, and a
  kernel whose output is off by 1e-4 fails it.
- "f16": activations, intermediates or outputs rounded to f16 (2^-11 = 4.9e-4 per element, about 3e-4 over a
  SwiGLU expert with two roundings); bound 1e-3.
Weights are never part of the error: f16 weights are exact in float64, and quantized weights are compared against
their exact dequantization (q * d computed in float64), so quantization error is not in the tolerance.
The numpy oracle (`strata_core.reference.kernels`) is itself an "f32" path and is checked against float64 too.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: Relative error bound of each precision path against the float64 reference.
BOUNDS = {"f32": 1e-5, "f16": 1e-3}
#: The precision path of the numpy reference kernels, and of any kernel that declares none.
REFERENCE_PRECISION = "f32"
#: The attribute a KernelSet or LayerOps declares its precision path in.
ATTRIBUTE = "precision"


def precision_of(kernels: Any, kernel: str) -> str:
    """The precision path `kernels` declares for the kernel named `kernel` ("f32" where it declares none)."""
    declared = getattr(kernels, ATTRIBUTE, None)
    if declared is None:
        return REFERENCE_PRECISION
    if isinstance(declared, str):
        path = declared
    elif isinstance(declared, Mapping):
        path = declared.get(kernel, REFERENCE_PRECISION)
    else:
        raise TypeError(f"{type(kernels).__name__}.{ATTRIBUTE} is {type(declared).__name__}: a string or a mapping "
                        f"from kernel name to precision path")
    if path not in BOUNDS:
        raise ValueError(f"{type(kernels).__name__} declares precision {path!r} for {kernel}; known: "
                         f"{', '.join(BOUNDS)}")
    return path


def coarsest(paths: Iterable[str]) -> str:
    """The path with the loosest bound among `paths` (the reference's when there are none)."""
    paths = list(paths)
    return max(paths, key=lambda p: BOUNDS[p]) if paths else REFERENCE_PRECISION


def path_precision(sources: Iterable[tuple[Any, Iterable[str]]]) -> str:
    """The coarsest path over (kernels object, kernel names) pairs: a computation is as coarse as its coarsest step."""
    return coarsest(precision_of(obj, name) for obj, names in sources if obj is not None for name in names)


def bound_of(path: str) -> float:
    """The relative error bound of a precision path."""
    return BOUNDS[path]


def mutation_scale(path: str) -> float:
    """The factor the mutation self-test scales an output of this path by: ten times its bound off (1 + 1e-4 for f32)."""
    return 1.0 + 10.0 * BOUNDS[path]
