"""gpushare: a node-level GPU-sharing daemon built on NVIDIA MPS.

Importing this package never touches a GPU, NVML or CUDA: those are loaded on first use by the
modules under :mod:`gpushare.node` that own them.
"""

__version__ = "0.1.0"
