"""The gated delta rule: the PyTorch reference (`reference.py`), the NKI decode kernel (`tkg.py`) and the NKI prefill
kernel (`cte.py`), each with the same math; `fused.py` holds the fused DeltaNet seams (raw projections in; the output and
the slots' updated states out) as a PyTorch reference and as the NKI kernels' host-side wrappers.

`optimum_qwen35.kernels.gated_delta_rule` keeps exporting the reference functions it always did.
"""

from .reference import (  # noqa: F401
    CHUNK_SIZE,
    chunk_gated_delta_rule,
    expand_key_heads,
    mask_padding,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_step,
    invert_unit_lower,
)
