"""PhantomArray: an array with a shape and a dtype but no memory, for accounting-only runs (sim and runtime)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PhantomArray:
    """An array with a shape and a dtype but no memory: what accounting-only mode hands out."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, shape: Any, dtype: Any) -> "PhantomArray":
        """A phantom of this shape and dtype (shape as numpy accepts it: an int or a tuple)."""
        shape_t = (int(shape),) if np.isscalar(shape) else tuple(int(n) for n in shape)
        if any(n < 0 for n in shape_t):
            raise ValueError(f"negative dimension in shape {shape_t}")
        return cls(shape=shape_t, dtype=np.dtype(dtype))

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)  # the shape holds Python ints; math.prod is exact and ~10x cheaper than np.prod

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the array would take."""
        return self.size * self.dtype.itemsize

    def reshape(self, *shape: Any) -> "PhantomArray":
        """A phantom of another shape with the same element count (as numpy's reshape, -1 allowed once)."""
        dims = shape[0] if len(shape) == 1 and not np.isscalar(shape[0]) else shape
        dims = [int(n) for n in dims]
        if dims.count(-1) > 1:
            raise ValueError("can only specify one unknown dimension")
        if -1 in dims:
            known = int(np.prod([n for n in dims if n != -1], dtype=np.int64))
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self.shape} into {tuple(dims)}")
            dims[dims.index(-1)] = self.size // known
        if int(np.prod(dims, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {tuple(dims)}")
        return PhantomArray(shape=tuple(dims), dtype=self.dtype)

    def __getitem__(self, key: Any) -> "PhantomArray":
        """Rows a:b (a slice) or one row (an int) of the first axis, as numpy's basic indexing gives them."""
        if isinstance(key, slice):
            return PhantomArray((len(range(*key.indices(self.shape[0]))),) + self.shape[1:], self.dtype)
        return PhantomArray(self.shape[1:], self.dtype)

    def view(self, dtype: Any) -> "PhantomArray":
        """A flat phantom of another dtype over the same bytes (used for uint8 views of pinned buffers)."""
        dt = np.dtype(dtype)
        if self.nbytes % dt.itemsize:
            raise ValueError(f"{self.nbytes} bytes are not a whole number of {dt} elements")
        return PhantomArray(shape=(self.nbytes // dt.itemsize,), dtype=dt)
