"""The compiler contract (the product's `optimum_qwen35.backends.nxd.hlo_contract`, which the benchmarks use too) and
its reference graphs (`optimum_qwen35.backends.nxd.lowering.reference_hlos`), re-exported for the tests."""

from __future__ import annotations

from optimum_qwen35.backends.nxd.hlo_contract import (  # noqa: F401
    FORM_EXCEPTIONS,
    RANK_LIMIT,
    REFUSED,
    S64_ALLOWED,
    census,
    dtype_census,
    form,
    leaf_shapes,
    reference_census,
    violations,
)
from optimum_qwen35.backends.nxd.lowering import REFERENCE_MODELS, reference_hlos, tiny_reference_config  # noqa: F401
