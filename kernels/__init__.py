"""Kernels of the Qwen3.5 DeltaNet layers, installed as `optimum_qwen35.kernels`.

Each kernel sits beside its PyTorch reference; `dispatch` picks the implementation.
"""
