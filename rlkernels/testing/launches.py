"""What a call launches, counted on any device: the ATen ops it runs below autograd, and those among them that make
the host wait for the device.

On a GPU each ATen op that is not a view is (at least) one kernel launch from the host, so their number is the
host-side cost of a call that the device never hides: the per-sequence stage of a loss is hundreds of [N]-sized
ops, each a few microseconds of host time against nanoseconds of GPU work. Counted with a `TorchDispatchMode`
(what `make_fx` would trace, at a fiftieth of its cost), on the CPU as on a GPU, so the budgets are tests that run
anywhere (tests/test_launch_budgets.py) and a benchmark (benchmarks/launches.py).

A sync is an op whose result the host must read before it can go on: `.item()` / `bool()` of a tensor
(`_local_scalar_dense`), the data-dependent shapes (`nonzero`, `masked_select`, `unique`, boolean indexing,
`repeat_interleave` without its output size), `equal`, and a `segment_reduce` that reads its lengths on the host.
On the CPU they cost nothing; on a GPU each one drains the stream. A copy from the device to the host is one too,
seen here only when the call runs on a GPU (`_to_copy` to the CPU of a CUDA tensor).
"""

import contextlib
import sys
from collections import Counter
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# the ops whose result is read on the host, whatever their arguments
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "equal", "is_nonzero", "masked_scatter", "repeat_interleave"}
# indexing with a boolean tensor becomes a nonzero inside the op
_BOOL_INDEXING_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


class LaunchCount(NamedTuple):
    ops: Counter  # ATen op name -> times run
    views: int  # of them, views (no kernel: a new tensor header on the same storage)
    syncs: List[str]  # the ops that made the host wait, in order
    dtypes: Dict[str, set]  # ATen op name -> the dtypes of its results

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def launching(self) -> int:
        """The ops that launch a kernel on a GPU: every op but the views."""
        return self.total - self.views

    def __add__(self, other: "LaunchCount") -> "LaunchCount":
        dtypes = {name: self.dtypes.get(name, set()) | other.dtypes.get(name, set())
                  for name in {*self.dtypes, *other.dtypes}}
        return LaunchCount(self.ops + other.ops, self.views + other.views, self.syncs + other.syncs, dtypes)


def _is_sync(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in ("_local_scalar_dense", "nonzero") and _reading_host_tensor():
        return False
    if name in _SYNC_OPS:
        return name != "repeat_interleave" or kwargs.get("output_size") is None
    if name in _BOOL_INDEXING_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))
    if name == "segment_reduce":
        return not kwargs.get("unsafe", False)
    if name == "_to_copy":
        source, device = args[0], kwargs.get("device")
        return source.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    return False


def _python_implementation(func) -> Optional[Callable]:
    """The Python function behind a `torch.library.custom_op` of this package (None for any other op: ATen's, or
    the compiled extensions', whose work is one launch)."""
    if func.namespace != "rlkernels":
        return None
    opdef = custom_ops._maybe_get_opdef(func)
    return None if opdef is None else opdef._init_fn


# Reads that never touch a device, by design, that a CPU run cannot tell from a sync by their tensors: (function,
# file) of the code that makes them. The one temperature travels as a 0-d CPU tensor (backends.temperature); the
# torch backend zeroes rows through an index on the CPU only, and with a masked fill on a device.
_HOST_READS = {("host_float", "temperature.py"), ("_zero_rows", "torch_backend.py"), ("_host_value", "coefficients.py")}


def _reading_host_tensor() -> bool:
    """Whether this read is one of _HOST_READS."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if (code.co_name, code.co_filename.rsplit("/", 1)[-1]) in _HOST_READS:
            return True
        frame = frame.f_back
    return False


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.views = 0
        self.syncs: List[str] = []
        self.dtypes: Dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        implementation = _python_implementation(func)
        if implementation is not None:  # a custom op of ours: what its implementation runs, counted inside it
            with self:
                return implementation(*args, **kwargs)
        self.ops[name] += 1
        if func.is_view:
            self.views += 1
        if _is_sync(func, args, kwargs):
            self.syncs.append(name)
        out = func(*args, **kwargs)
        self.dtypes.setdefault(name, set()).update(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def count(self) -> LaunchCount:
        return LaunchCount(self.ops, self.views, self.syncs, self.dtypes)


@contextlib.contextmanager
def _triton_launches_counted(recorder: _Recorder):
    """Each Triton kernel launch counted as one op, "triton:<kernel>", and nothing it runs inside: under
    TRITON_INTERPRET=1 the interpreter copies every argument through torch ops (set_, copy_, empty) that a GPU launch
    never runs."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    classes = (jit.JITFunction, interpreter.InterpretedFunction)
    originals = [cls.run for cls in classes]

    def counted(original):
        def run(self, *args, **kwargs):
            recorder.ops[f"triton:{getattr(self.fn, '__name__', self.fn)}"] += 1
            with _disable_current_modes():
                return original(self, *args, **kwargs)
        return run

    for cls, original in zip(classes, originals):
        cls.run = counted(original)
    try:
        yield
    finally:
        for cls, original in zip(classes, originals):
            cls.run = original


def count_launches(fn: Callable[..., Any], *args, **kwargs) -> Tuple[Any, LaunchCount]:
    """(fn(*args, **kwargs), what it ran)."""
    with _Recorder() as recorder, _triton_launches_counted(recorder):
        result = fn(*args, **kwargs)
    return result, recorder.count()


def count_step(loss_fn: Callable[[], Any]) -> Tuple[LaunchCount, LaunchCount, LaunchCount]:
    """(forward, backward, metrics) of one training step: `loss_fn()` returns an output with `.loss` (or the loss
    itself), whose backward is then counted, then a logger's read of its `.metrics` (a fused stage's are computed
    there; nothing to count where the call computed them)."""
    out, forward = count_launches(loss_fn)
    loss = out.loss if hasattr(out, "loss") else out
    _, backward = count_launches(loss.backward)
    _, metrics = count_launches(lambda: dict(getattr(out, "metrics", {})))
    return forward, backward, metrics

