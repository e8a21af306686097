"""The vLLM serving matrix (tests/test_serving_archs.py, which says what each cell checks) on the Qwen targets: q/k/v
bias, q/k norms, and a MoE whose router vLLM-CPU runs in its own kernel. A file of its own so that ``pytest -n`` runs
it beside the others."""

from __future__ import annotations

import pytest

from test_serving_archs import (  # noqa: F401 - the fixture, the hook and the tests run here for ARCHS
    pytest_generate_tests,
    served,
    test_each_export_serves_losslessly_with_selfspecs_acceptance_or_is_refused,
    test_vllm_decodes_each_target_as_hf_does_or_says_why_not,
)

ARCHS = ("qwen2", "qwen3", "qwen3_moe")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.vllm_archs]
