"""Causal depthwise conv1d with SiLU: the PyTorch reference (`reference.py`), whole sequence and one step."""

from .reference import causal_conv1d, causal_conv1d_step  # noqa: F401
