"""Out-of-bounds checks of the Triton kernels on the CPU: every load and store a kernel makes under Triton's
interpreter (TRITON_INTERPRET=1) is checked against the elements of the tensors its launch was given.

    with bounds_checked() as violations:
        token_stats_fwd(guarded(logits), labels, 0.7, True, True)
    assert not violations, violations

Why this and not the two tools issue 36 names: `ttsem` is not on the package index this project installs from,
and triton-viz 3.0's sanitizer does not import under Triton 3.9 (its patch table names
`InterpreterBuilder.create_make_block_ptr`, which 3.9 removed). What a check needs is two hooks of the
interpreter that have stayed put across Triton 3.x: the launch, with its arguments (`GridExecutor`), and every
load and store, with its addresses and mask (`InterpreterBuilder.create_masked_load / create_masked_store`;
unmasked ones go through them too).

What it checks: each active lane (mask true) of a load or a store must address an element of one of the launch's
tensor arguments, of the width it reads. Elements, not allocations: a read that lands in the allocation but
outside the view (the position a causal shift leaves out, a padded row's padding, the next row after a partial
block) is caught, which a check of whole allocations would miss. `guarded` gives a kernel its input as a view
with a gap on every side (after each row, wider than any block a kernel loads), so that a stray access lands on
no element. A stray lane is reported with the kernel's source line and then dropped, never dereferenced. Stores
into tensors named read-only (a pass's inputs) are reported too.

What it does not check: races (the interpreter runs one program after another), and shapes beyond the
interpreter's speed (N * V > 2^31: tests/kernels/test_gpu_kernels.py runs those compiled on a GPU).
"""

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator, List

import numpy as np
import torch


@dataclass(frozen=True)
class Violation:
    kernel: str  # the @triton.jit function launched
    where: str  # "file:line" of the load or store in the kernel's source
    op: str  # "load" or "store"
    lanes: int  # how many active lanes addressed no element
    address: int  # the first of them

    def __str__(self) -> str:
        return f"{self.kernel}: {self.op} at {self.where}: {self.lanes} lanes outside every tensor (0x{self.address:x})"


class _Elements:
    """The byte addresses of every element of a launch's tensor arguments (views: their elements only), sorted,
    with each element's width."""

    def __init__(self, tensors: List[torch.Tensor]):
        addresses, widths = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for t in tensors:
            if t.numel() == 0:
                continue
            offsets = torch.zeros((), dtype=torch.int64)
            for size, stride in zip(t.shape, t.stride()):
                offsets = offsets[..., None] + torch.arange(size) * stride
            found = np.unique(offsets.reshape(-1).numpy() * t.element_size() + t.data_ptr()).astype(np.uint64)
            addresses.append(found)
            widths.append(np.full(found.shape, t.element_size()))
        addresses, widths = np.concatenate(addresses), np.concatenate(widths)
        order = np.argsort(addresses, kind="stable")
        self.addresses, self.widths = addresses[order], widths[order]

    def outside(self, pointers: np.ndarray, mask: np.ndarray, width: int) -> np.ndarray:
        """The active lanes whose address is no element of this width."""
        pointers = np.broadcast_to(pointers, mask.shape).astype(np.uint64)
        if not len(self.addresses):
            return mask.copy()
        i = np.minimum(np.searchsorted(self.addresses, pointers), len(self.addresses) - 1)
        hit = (self.addresses[i] == pointers) & (self.widths[i] == width)
        return mask & ~hit


def _tensors(values) -> List[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found += _tensors(v)
    return found


def _source_line() -> str:
    """file:line of the innermost frame outside Triton's package and this module: the kernel's tl.load / tl.store."""
    import triton

    triton_dir = os.path.dirname(triton.__file__) + os.sep
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(triton_dir) and path != __file__:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def bounds_checked(read_only=()) -> Iterator[List[Violation]]:
    """Checks every interpreted Triton launch inside the block; yields the list its violations are added to.
    `read_only`: tensors no kernel may store into (the inputs of an out-of-place pass)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("bounds_checked needs Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    originals = (executor._init_args_hst, executor.__call__, builder.create_masked_load, builder.create_masked_store)
    init_args, launch, masked_load, masked_store = originals
    violations: List[Violation] = []
    launches = []  # (kernel name, _Elements) of the launches under way
    protected = _Elements(list(read_only))

    def checked_init_args(self, args_dev, kwargs):
        hosted = init_args(self, args_dev, kwargs)  # the tensors the kernel's pointers address
        launches.append((self.fn.__name__, _Elements(_tensors(hosted[0]) + _tensors(hosted[1].values()))))
        return hosted

    def checked_launch(self, *args, **kwargs):
        depth = len(launches)
        try:
            return launch(self, *args, **kwargs)
        finally:
            del launches[depth:]

    def dropped(op, pointers, mask, bad):
        """`mask` without the `bad` lanes, reported (with the kernel's line) as one violation."""
        if not bad.any():
            return mask
        first = int(np.broadcast_to(pointers.data, bad.shape)[bad][0])
        kernel = launches[-1][0] if launches else "?"
        violations.append(Violation(kernel, _source_line(), op, int(bad.sum()), first))
        return type(mask)(np.asarray(mask.data, dtype=bool) & ~bad, mask.dtype)

    def checked_mask(op, pointers, mask):
        if not launches:
            return mask
        width = pointers.get_element_ty().primitive_bitwidth // 8
        stray = launches[-1][1].outside(pointers.data, np.asarray(mask.data, dtype=bool), width)
        return dropped(op, pointers, mask, stray)

    def load(self, pointers, mask, other, cache_policy, is_volatile):
        return masked_load(self, pointers, checked_mask("load", pointers, mask), other, cache_policy, is_volatile)

    def store(self, pointers, value, mask, cache_policy):
        mask = checked_mask("store", pointers, mask)
        if len(protected.addresses):
            width = pointers.get_element_ty().primitive_bitwidth // 8
            active = np.asarray(mask.data, dtype=bool)
            into = active & ~protected.outside(pointers.data, active, width)
            mask = dropped("store into a read-only tensor", pointers, mask, into)
        return masked_store(self, pointers, value, mask, cache_policy)

    executor._init_args_hst, executor.__call__ = checked_init_args, checked_launch
    builder.create_masked_load, builder.create_masked_store = load, store
    try:
        yield violations
    finally:
        executor._init_args_hst, executor.__call__, builder.create_masked_load, builder.create_masked_store = originals


# the gap after each row: wider than the widest block a kernel loads (8192), so that a row's overrun by up to a
# block lands in it rather than on the next row's elements
ROW_GAP = 8192


def guarded(t: torch.Tensor, gap: int = 3, row_gap: int = ROW_GAP) -> torch.Tensor:
    """`t`'s values as a view into a larger tensor with NaN (or -1 for integers) around it: `gap` elements on both
    sides of every dimension but the last, `row_gap` on both sides of the last. The strides are the larger
    tensor's, the last one stays 1, and any access outside the view lands on no element of it."""
    fill = float("nan") if t.is_floating_point() else -1
    gaps = [gap] * (t.dim() - 1) + [row_gap] if t.dim() else []
    outer = torch.full([s + 2 * g for s, g in zip(t.shape, gaps)], fill, dtype=t.dtype, device=t.device)
    view = outer[tuple(slice(g, g + s) for s, g in zip(t.shape, gaps))]
    view.copy_(t)
    return view
