"""Benchmarks of rlkernels against naive PyTorch, torch.compile, verl and Liger-Kernel (see README.md)."""
