"""The sampling temperature of a call, as one value: `Temperature`.

A temperature is one number for every row (the config's float) or one per row (the sampler's own
per-request temperatures, [N]). It travels from `inputs` (which builds it) through the ops and the
backends as this one type, and is unpacked only where a form is consumed:

- a custom op's schema takes tensors only: `.tensor` is a 0-d float64 *CPU* tensor for one temperature
  (a graph input of a compiled step, read on the host without touching the device: a `float` argument
  would specialise the graph on its value and recompile per temperature), or the [N] device tensor;
  `Temperature(tensor)` wraps it again inside the op;
- the torch code paths multiply by `inverse(dtype)`: 1/T as a float, or [N, 1];
- the compiled kernels (Triton, C++, CUDA) take `kernel_args()`: (T, None), or (1.0, float32 1/T per row).

Why a type: each of these forms used to have its own converter in a different module, and mixing two of
them broke a compiled backward once (a host read where a tensor was needed).
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..kernels.temperature import row_temperature


def host_float(t: Tensor) -> float:
    """The value of a 0-d CPU tensor: a host read, never a device synchronisation (the no-sync test allows
    reads from this function only)."""
    return float(t)


class Temperature:
    """One temperature (`tensor` 0-d float64 on the CPU) or one per row (`tensor` [N] on the device)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor):
        self.tensor = tensor

    @classmethod
    def of(cls, value: Union[float, Tensor, "Temperature"]) -> "Temperature":
        """A Temperature from a float, a custom op's tensor (0-d float64 CPU, or [N]), or a Temperature."""
        if isinstance(value, Temperature):
            return value
        if isinstance(value, Tensor):
            return cls(value)
        # built by arithmetic under torch.compile, so that it keeps a per-step float a run-time input
        # (see stage.segments.hyper); one fill eagerly
        if torch.compiler.is_compiling():
            return cls(torch.zeros((), dtype=torch.float64) + value)
        return cls(torch.full((), value, dtype=torch.float64))

    @property
    def per_row(self) -> bool:
        return self.tensor.dim() > 0

    def value(self) -> Union[float, Tensor]:
        """The float (read on the host), or the [N] per-row temperatures."""
        return self.tensor if self.per_row else host_float(self.tensor)

    def inverse(self, dtype: torch.dtype) -> Union[float, Tensor]:
        """1/T for the torch code paths: a float, or the [N, 1] per-row values in `dtype`."""
        if self.per_row:
            return (1.0 / self.tensor.to(dtype)).reshape(-1, 1)
        return 1.0 / host_float(self.tensor)

    def inverse_tensor(self, dtype: torch.dtype) -> Tensor:
        """1/T as a tensor, without a host read (code that torch.compile traces, such as a custom op's
        backward): 0-d (a CPU scalar multiplies device tensors as a scalar), or [N, 1]."""
        inv = 1.0 / self.tensor.to(dtype)
        return inv.reshape(-1, 1) if self.per_row else inv

    def kernel_args(self) -> Tuple[float, Optional[Tensor]]:
        """(T, None) for one temperature; (1.0, contiguous float32 [N] 1/T) per row: what the compiled
        kernels take."""
        return row_temperature(self.value())

    def rows(self, index: Union[Tensor, slice]) -> "Temperature":
        """The temperature of a subset of rows (an index tensor or a slice); one temperature is everyone's."""
        if not self.per_row:
            return self
        if isinstance(index, slice):
            return Temperature(self.tensor[index])
        return Temperature(self.tensor.index_select(0, index))

    def __repr__(self) -> str:
        return f"Temperature(per_row, {tuple(self.tensor.shape)})" if self.per_row else \
            f"Temperature({host_float(self.tensor)})"
