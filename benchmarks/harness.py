"""Timing, peak memory, the bytes model and the environment record.

One measurement = one (provider, op, case, N, V, dtype) in this process, both modes:
  fwd     the training forward (inputs require grad, so saved tensors count)
  fwdbwd  forward + loss.backward() into a fresh logits.grad
Memory is the peak working memory above the inputs and the gradient buffer:
  CUDA: torch.cuda.max_memory_allocated() - memory_allocated() after the inputs (- the grad for fwdbwd)
  CPU:  the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) minus its RSS after the
        inputs and a touched gradient-sized buffer; free heap is returned (malloc_trim) before each
        baseline so that memory freed by warm-up cannot hide the working set. Run one measurement
        per fresh process (benchmarks.worker) so nothing else inflates the peak.
Bytes model (essential traffic of the [N, V] logits): fwd = 1 read; fwdbwd = 2 reads + 1 write.
"""

import ctypes
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from typing import Callable, List, Optional

import torch

MODES = ("fwd", "fwdbwd")


# ---------------------------------------------------------------- environment
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args) -> Optional[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001
        return None


def environment(device: str) -> dict:
    import rlkernels
    from rlkernels import backends

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                               if hasattr(os, "sysconf") else None),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "rlkernels": rlkernels.__version__,
        "rlkernels_backends": backends.available(),
        "verl": _version("verl"),
        "liger_kernel": _version("liger_kernel") or _version("liger-kernel"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "device": device,
        # other processes on the machine distort CPU timings: the 1/5/15-minute load averages at the end
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   gpu_capability=f"{props.major}.{props.minor}")
    return env


# ---------------------------------------------------------------- bytes model
def bytes_model(N: int, V: int, element_size: int, mode: str) -> int:
    passes = 1 if mode == "fwd" else 3  # fwd: read; fwdbwd: read (fwd) + read and write (bwd)
    return passes * N * V * element_size


# ---------------------------------------------------------------- CPU memory
def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- timing
# ---------------------------------------------------------------- a measurement in a fresh process
WORKER_LINE = "@@"  # the line a memory worker prints its JSON record on


def run_memory_worker(module: str, argv: List[str], fallback: dict, timeout_s: float = 1800) -> dict:
    """`python -m <module> <argv>` in a fresh process (its peak RSS is one provider's), its record from the line
    that starts with WORKER_LINE; on failure `fallback` with the process's last stderr line as the error."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout_s,
                          cwd=root)
    for line in proc.stdout.splitlines():
        if line.startswith(WORKER_LINE):
            return json.loads(line[len(WORKER_LINE):])
    return dict(fallback, error=(proc.stderr.strip().splitlines() or ["?"])[-1][:200])


def cuda_graph(fn: Callable[[], object]):
    """(a CUDA graph of `fn`, the output of its captured call), `fn` warmed up three times on a side stream first so
    that lazy allocations and compiles stay out of the graph. Raises what the capture raises (a host sync in `fn`);
    the output holds the replay's memory, so keep it while replaying."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def quantiles(samples_ms: List[float]) -> dict:
    t = torch.tensor(samples_ms, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return {"p20": q[0], "median": q[1], "p80": q[2], "min": min(samples_ms), "reps": len(samples_ms)}


def time_runs(step: Callable[[], None], device: str, reps: int, max_seconds: float, min_reps: int = 3) -> List[float]:
    """Wall time per call in ms; stops after `reps` calls or `max_seconds` (but not before `min_reps`)."""
    samples = []
    start = time.perf_counter()
    while len(samples) < reps:
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= min_reps and time.perf_counter() - start > max_seconds:
            break
    return samples


# ---------------------------------------------------------------- one measurement
def measure(provider, op: str, case, N: int, V: int, dtype: str, device: str, *, modes=MODES, warmup: int = 1,
            reps: int = 5, max_seconds: float = 20.0, peak_gbps: Optional[float] = None, seed: int = 0) -> List[dict]:
    """Measure one provider on one problem, every mode; returns one record per mode."""
    from .problems import DTYPES, make_inputs

    layout = case.layout if case is not None else "mixed"
    base = {"provider": provider.name, "kind": provider.kind, "op": op, "case": case.name if case else None,
            "N": N, "V": V, "dtype": dtype, "layout": layout, "device": device}
    reason = provider.skip_reason(op, case, V, device)
    if reason:
        return [dict(base, mode=m, status="skipped", reason=reason) for m in modes]

    x = make_inputs(N, V, dtype, layout, device, seed)
    try:
        fn = provider.build(op, case, x)
    except Exception as exc:  # noqa: BLE001
        return [dict(base, mode=m, status="error", reason=f"build: {type(exc).__name__}: {exc}") for m in modes]
    leaf = x.get("liger_logits", x["logits"])  # the tensor whose gradient the backward produces
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()

    def forward():
        out = fn()
        return out if out.dim() == 0 else out.sum()

    def fwdbwd():
        leaf.grad = None
        forward().backward()

    out_records = []
    for mode in modes:
        rec = dict(base, mode=mode)
        step = (lambda: forward()) if mode == "fwd" else fwdbwd
        try:
            for _ in range(max(1, warmup)):
                step()
                _sync(device)
            # values for the agreement check (deterministic inputs: every provider sees the same)
            value = forward()
            rec["value"] = float(value.detach())
            if mode == "fwdbwd":
                leaf.grad = None
                value.backward()
                g = leaf.grad.float()
                if "liger_logits" in x:
                    g = g[:, :-1]
                rec["grad_abs_sum"] = float(g.abs().sum())
                del g
            del value
            leaf.grad = None
            rec.update(_peak_memory(step, device, mode, N, V, elem))
            samples = time_runs(step, device, reps, max_seconds)
            leaf.grad = None
        except Exception as exc:  # noqa: BLE001 - e.g. torch.compile failing on this machine
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            rec.update(status="error", reason=f"{type(exc).__name__}: {first_line}"[:500])
            out_records.append(rec)
            leaf.grad = None
            continue
        rec["status"] = "ok"
        rec["time_ms"] = quantiles(samples)
        rec["samples_ms"] = samples
        nbytes = bytes_model(N, V, elem, mode)
        rec["bytes_model"] = nbytes
        rec["gbps"] = nbytes / (rec["time_ms"]["median"] * 1e-3) / 1e9
        if peak_gbps:
            rec["pct_peak"] = 100.0 * rec["gbps"] / peak_gbps
        out_records.append(rec)
    return out_records


def _peak_memory(step, device: str, mode: str, N: int, V: int, elem: int) -> dict:
    grad_bytes = N * V * elem if mode == "fwdbwd" else 0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_mem_bytes": peak - base - grad_bytes, "mem_method": "cuda max_memory_allocated - inputs - grad"}
    release_free_heap()
    placeholder = torch.ones(grad_bytes // 4 + 1, dtype=torch.float32) if grad_bytes else None  # touched pages
    base = rss_bytes()
    del placeholder
    release_free_heap()
    exact = reset_peak_rss()
    step()
    peak = peak_rss_bytes()
    method = ("VmHWM (reset) - VmRSS(inputs + grad buffer)" if exact
              else "ru_maxrss - VmRSS(inputs + grad buffer) (HWM not resettable)")
    return {"peak_mem_bytes": peak - base, "mem_method": method}
