"""Helpers for testing code that uses rlkernels, shared by the project's tests and benchmarks (neither imports
the other's helpers):

    spawn.py   real gloo (or NCCL) process groups spawned with torch.multiprocessing, a hung rank failing within
               a minute without progress, and a counter of the collectives each group runs
    stage.py   the per-sequence stage run on loose [N] tensors
    peers.py   the peer trainers' own code importable on a CPU without their whole stacks (verl without ray),
               and the repository's examples as modules (in a checkout)
    bounds.py  the Triton interpreter's loads and stores checked against the launch's tensors
    trainers.py  SkyRL's, OpenRLHF's, TorchTitan's and AReaL's own loss code, imported on a CPU without their
               stacks (stand-ins for the heavy imports, only while importing)

Nothing of the library imports this package.
"""
