"""The temperature as the compiled kernels take it (Triton, CUDA, CPU): one float, or per row."""

import torch


def row_temperature(temperature):
    """(T, None) for one temperature; (1.0, contiguous float32 (N,) 1 / T) for a per-row one (1 / T formed in
    float64, then rounded once)."""
    if isinstance(temperature, torch.Tensor):
        return 1.0, (1.0 / temperature.to(torch.float64)).to(torch.float32).contiguous()
    return float(temperature), None
