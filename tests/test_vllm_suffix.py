"""serve/vllm_suffix.py's proposer outside vLLM: what a verified chain teaches its calibration."""

from __future__ import annotations

import numpy as np

from selfspec.serve.vllm_suffix import SuffixProposer, default_curve


def call(proposer: SuffixProposer, history: list[int], new: int) -> list[int]:
    """One vLLM step for one row whose tokens are ``history``, the last ``new`` of them this step's."""
    ids = np.zeros((1, 256), dtype=np.int64)
    ids[0, :len(history)] = history
    return proposer.propose([history[-new:]], np.array([len(history)]), ids)[0]


def test_a_chain_teaches_the_depths_up_to_its_first_rejected_token_only():
    proposer = SuffixProposer.standalone(8, 256, default_curve(8))
    pattern = list(range(10, 30))
    history = pattern + pattern[:5]  # the pattern seen once: its continuation is the chain
    chain = call(proposer, history, 1)
    assert chain[:3] == pattern[5:8] and len(chain) >= 3
    calibration = proposer.rows[0].drafter.calibration
    before = dict(calibration.scored)
    # vLLM accepted the chain's first token and rejected its second (sampling 99 there instead)
    call(proposer, history + [chain[0], 99], 2)
    learned = {key[1]: calibration.scored[key] - before.get(key, 0.0) for key in calibration.scored}
    assert learned.get(1, 0) > 0 and learned.get(2, 0) > 0  # the accepted depth and the rejected one
    assert all(v == 0 for d, v in learned.items() if d > 2)  # never reached: not counted as rejected
    accepted = {key[1]: calibration.accepted.get(key, 0.0) for key in calibration.accepted}
    assert accepted.get(1, 0) >= 1 and accepted.get(2, 0) == 0
