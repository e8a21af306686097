"""The vLLM serving matrix (tests/test_serving_archs.py, which says what each cell checks) on Mistral (a sliding
window) and Phi-3 (fused q/k/v and gate/up projections). A file of its own so that ``pytest -n`` runs it beside the
others."""

from __future__ import annotations

import pytest

from test_serving_archs import (  # noqa: F401 - the fixture, the hook and the tests run here for ARCHS
    pytest_generate_tests,
    served,
    test_each_export_serves_losslessly_with_selfspecs_acceptance_or_is_refused,
    test_vllm_decodes_each_target_as_hf_does_or_says_why_not,
)

ARCHS = ("mistral", "phi3")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.vllm_archs]
