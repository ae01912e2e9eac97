"""Triton kernels: one kernel (or kernel family) and its launcher per module. Launchers allocate,
choose the grid and BLOCK_* and launch; they never touch autograd."""
