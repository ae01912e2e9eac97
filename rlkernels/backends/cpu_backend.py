"""The CPU kernels: the vocabulary passes as fused C++ loops (csrc/cpu/token_passes.cpp), over
`torch.ops.rlkernels_cpu.*`: the token statistics and their gradient, and the full-form divergences.

Why they exist: the torch backend's chunked ATen ops open several parallel regions per chunk, and on
a machine shared with another multi-threaded process each region waits for a descheduled thread;
these kernels open one region per pass (see the source's header).

How they are built: on first use, by the C++ compiler every PyTorch CPU user has (`$CXX`, else g++
or c++), against the installed torch's headers and libraries, for this machine's CPU
(`-march=native`), into a cache keyed by the source, the flags, the torch version and the CPU
(`$RLKERNELS_CACHE`, else `$XDG_CACHE_HOME/rlkernels`, else `~/.cache/rlkernels`); about 10-20 s once.
Not at install time: the README's install builds in pip's isolated environment, where torch is not
importable, and putting torch in the build requirements would download a second (unpinned, possibly
CUDA) torch to build against. Processes that start at once build it once: the first takes a lock
(flock), the others wait and load its file. If there is no compiler or the build fails, a warning
says why and "auto" keeps the torch backend. `RLKERNELS_CPU_KERNELS=0` turns them off.
"""

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from ..kernels.stage_options import HYPERPARAMETERS, option_codes
from .base import DIVERGENCE_STATS, paired_row_groups, row_groups
from .extension import ExtensionBackend, register_fakes
from .temperature import Temperature

OPS_NAMESPACE = "rlkernels_cpu"
# a checkout (or editable install) reads csrc/ at the repository root; a built package carries a copy
# (setup.py's build_py)
_PACKAGE = Path(__file__).resolve().parents[1]
SOURCE = next((p for p in (_PACKAGE.parent / "csrc" / "cpu" / "token_passes.cpp",
                           _PACKAGE / "_csrc" / "cpu" / "token_passes.cpp") if p.exists()),
              _PACKAGE.parent / "csrc" / "cpu" / "token_passes.cpp")
# -fno-trapping-math and -ffp-contract=fast let the row loops vectorise (selects, fused multiply-adds);
# nothing here reorders sums (no -ffast-math: -inf and NaN keep their IEEE meaning). -fopenmp gives
# at::parallel_for its threads (torch's own libgomp, already loaded, serves them).
CXX_FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=fast",
             "-fno-trapping-math", "-w"]
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
BUILD_TIMEOUT_S = 600


def _cpu_fingerprint() -> str:
    """The CPU the -march=native build is for: a cache shared by several machines must not hand one
    another's binary to a CPU without its instructions."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """rlkernels' cache folder: $RLKERNELS_CACHE, else $XDG_CACHE_HOME/rlkernels, else ~/.cache/rlkernels."""
    if os.environ.get("RLKERNELS_CACHE"):
        return Path(os.environ["RLKERNELS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlkernels"


def _compiler():
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_command(compiler: str, output: Path):
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dir = cpp_extension.library_paths()[0]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, *CXX_FLAGS, abi, *includes, str(SOURCE), "-o", str(output), f"-L{lib_dir}", "-lc10",
            "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]


def _build() -> Path:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++)")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CXX_FLAGS).encode(), torch.__version__.encode(),
                 _cpu_fingerprint().encode(), compiler.encode()):
        key.update(part)
    cache = cache_dir()
    library = cache / f"rlkernels_cpu_{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache / f"{library.name}.lock"):
        if library.exists():  # another process built it while this one waited
            return library
        print(f"rlkernels: compiling the CPU kernels once (~10-20 s), into {cache}", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            partial = Path(tmp) / library.name
            run = subprocess.run(build_command(compiler, partial), capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S)
            if run.returncode != 0:
                raise RuntimeError(f"{compiler} failed:\n{run.stderr[-2000:]}")
            os.replace(partial, library)  # atomic: a process that does not lock still sees a whole file
    return library


@contextlib.contextmanager
def _build_lock(path: Path):
    """One build at a time per library: the ranks of a node (or a test run's workers) that start together wait
    for the first one's build instead of each compiling the same file. Where there is no flock (Windows) each
    builds its own copy and renames it into place, as before."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@lru_cache(maxsize=None)
def _load_ops() -> bool:
    """Builds (once per machine) and loads the ops (once per process); True when usable."""
    if os.environ.get("RLKERNELS_CPU_KERNELS") == "0":
        return False
    if hasattr(torch.ops, OPS_NAMESPACE) and hasattr(getattr(torch.ops, OPS_NAMESPACE), "token_stats_fwd"):
        return True
    try:
        torch.ops.load_library(str(_build()))
    except Exception as exc:  # the torch backend stays available
        warnings.warn(f"rlkernels: the CPU kernels are unavailable, using the torch backend: {exc}", RuntimeWarning,
                      stacklevel=3)
        return False
    register_fakes(OPS_NAMESPACE)
    _register_divergence_fakes()
    return True


def _register_divergence_fakes() -> None:
    """Shapes of the full form's two ops (the CPU library has them; the CUDA extension does not)."""

    @torch.library.register_fake(f"{OPS_NAMESPACE}::full_divergences_fwd")
    def _(logits, reference, active, temperature, reference_temperature, inv_temperature=None,
          inv_reference_temperature=None):
        return logits.new_empty((logits.shape[0], DIVERGENCE_STATS), dtype=torch.float32)

    @torch.library.register_fake(f"{OPS_NAMESPACE}::full_divergences_bwd")
    def _(logits, reference, stats, coef, temperature, reference_temperature, inv_temperature=None,
          inv_reference_temperature=None):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)


class CpuBackend(ExtensionBackend):
    name = "cpu"
    namespace = OPS_NAMESPACE

    def is_built(self) -> bool:
        return _load_ops()

    def supports(self, logits: torch.Tensor) -> bool:
        return logits.device.type == "cpu" and logits.dtype in _SUPPORTED

    @staticmethod
    def sequence_stage(inputs, options: dict, hyper: dict, factors: bool = False) -> tuple:
        """The fused stage (stage/fused.py) as one C++ op: the Triton launcher's outputs, from float32 copies of
        inputs of other dtypes; with `factors`, what each token's coefficients are formed from instead."""
        codes = option_codes(options)
        f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
        cu = None if inputs.cu_seqlens is None else inputs.cu_seqlens.to(torch.int64).contiguous()
        loss, lp, coef, coef_entropy, weights, kept = torch.ops.rlkernels_cpu.sequence_stage(
            f32(inputs.lp), f32(inputs.entropy), f32(inputs.advantages), inputs.mask.to(torch.bool).contiguous(),
            f32(inputs.old), f32(inputs.rollout), f32(inputs.ref), f32(inputs.is_weights), cu,
            inputs.seq_id.contiguous(), inputs.seq_len, inputs.num_seqs, [int(value) for value in codes.values()],
            [float(hyper[name]) for name in HYPERPARAMETERS], factors)
        return (loss, lp, coef, None if inputs.entropy is None else coef_entropy,
                weights if codes["WEIGHTED"] else None, kept)

    @staticmethod
    def forward_gradient_covers(V: int) -> bool:
        """Every vocabulary: the op works a row at a time."""
        return True

    def forward_gradient(self, logits, labels, temperature, out, factors, codes: dict, hyper: dict,
                         compute_entropy: bool) -> tuple:
        """The statistics and dlogits of every row in one op, a row at a time (the gradient formed in the forward,
        SPEC §2.4): (logprobs, entropy or None), dlogits written into `out`."""
        scalar, inverse = Temperature.of(temperature).kernel_args()
        labels = labels.to(torch.int64).contiguous()
        factor = 1.0 if factors.factor is None else float(factors.factor)  # a CPU tensor: no device to wait for
        vectors = (factors.mask, factors.advantages, factors.proximal, factors.ref, factors.a, factors.weights,
                   factors.coef_entropy, labels, inverse)
        lp, entropy = [], []
        for start, rows, out_rows in paired_row_groups(logits, out):
            mask, adv, proximal, ref, a, weights, e, row_labels, inv = (
                None if v is None else v[start:start + rows.shape[0]] for v in vectors)
            piece_lp, piece_h = self._ops().forward_gradient(
                rows, row_labels, scalar, inv, out_rows, mask, adv, proximal, ref, a, weights, factor, e,
                [int(value) for value in codes.values()], [float(hyper[name]) for name in HYPERPARAMETERS],
                compute_entropy)
            lp.append(piece_lp)
            entropy.append(piece_h)
        cat = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731
        return cat(lp), cat(entropy) if compute_entropy else None

    # The full form (SPEC §9.2) as two C++ passes: two reads of both rows forward, one backward, as the Triton
    # kernels; a reference of another dtype takes the inherited chunked form (the ops read one dtype).
    def full_divergences_fwd(self, logits, reference, active, temperature, reference_temperature, with_tv=True):
        # the C++ pass always forms TV (with_tv is a hint: on the CPU its second read costs what the first does)
        if reference.dtype != logits.dtype:
            return super().full_divergences_fwd(logits, reference, active, temperature, reference_temperature)
        (t, inv_t), (t_r, inv_r) = Temperature.of(temperature).kernel_args(), \
            Temperature.of(reference_temperature).kernel_args()
        ref_rows = reference.reshape(-1, logits.shape[-1])
        flags = active.to(torch.bool).contiguous()
        pieces = [
            torch.ops.rlkernels_cpu.full_divergences_fwd(
                rows, ref_rows[start:start + rows.shape[0]], flags[start:start + rows.shape[0]], t, t_r,
                *(None if inv is None else inv[start:start + rows.shape[0]] for inv in (inv_t, inv_r)))
            for start, rows in row_groups(logits)
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def full_divergences_bwd(self, logits, reference, stats, coef, temperature, reference_temperature):
        if reference.dtype != logits.dtype:
            return super().full_divergences_bwd(logits, reference, stats, coef, temperature, reference_temperature)
        (t, inv_t), (t_r, inv_r) = Temperature.of(temperature).kernel_args(), \
            Temperature.of(reference_temperature).kernel_args()
        ref_rows = reference.reshape(-1, logits.shape[-1])
        stats, coef = stats.to(torch.float32).contiguous(), coef.to(torch.float32).contiguous()

        def rows_grad(rows, start):
            stop = start + rows.shape[0]
            return torch.ops.rlkernels_cpu.full_divergences_bwd(
                rows, ref_rows[start:stop], stats[start:stop], coef[start:stop], t, t_r,
                *(None if inv is None else inv[start:stop] for inv in (inv_t, inv_r)))

        groups = row_groups(logits)
        if len(groups) == 1:  # the op's contiguous result is the gradient: no copy
            return rows_grad(groups[0][1], 0).view(logits.shape)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for start, rows, out_rows in paired_row_groups(logits, grad):  # the causal-shift view: one call per row
            out_rows.copy_(rows_grad(rows, start))
        return grad
