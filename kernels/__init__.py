"""Triton kernels of fsdp_native (installed as ``fsdp_native.kernels``)."""
