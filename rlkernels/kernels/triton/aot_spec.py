"""What a kernel module declares for the ahead-of-time compile check (tests/kernels/test_aot.py).

Each kernel module exposes ``aot_specs() -> list[AotSpec]``: one entry per constexpr configuration
its launcher can choose, so that CI compiles exactly what a GPU run could launch.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class LoopGate:
    """What a streaming kernel's hot loop may spend on sm_90 (aot.LOOP_GATE_TARGET): SASS instructions per element
    (a loop iteration's instructions over the `elements` one thread handles in it) and barriers (BAR.*) inside it;
    its PTX has no non-ftz ex2 but `non_ftz` (once-per-row exponentials whose bits another kernel fixes), and a loop
    staged through shared memory (`staged`) has cp.async in it."""

    elements: int
    per_element: float
    barriers: int = 0
    staged: bool = False
    non_ftz: int = 0


@dataclass(frozen=True)
class AotSpec:
    name: str  # e.g. "token_stats_fwd[BLOCK_V=4096,HAS_ENTROPY=1]"
    fn: Any  # the @triton.jit function
    signature: Dict[str, str]  # every argument -> "*fp32", "*bf16", "i64", "i32", "fp32" or "constexpr"
    constexprs: Dict[str, Any]  # constexpr argument -> value
    num_warps: int = 4
    num_stages: int = 3
    aligned: Tuple[str, ...] = field(default=())  # pointer/int args a real launch sees 16-divisible
    loop_gate: Optional[LoopGate] = None  # the static gate of the hot loop, where the spec has one
