"""The signalling protocol of the CE collectives, checked on a model (tests/runtime/protocol_model.py, no GPU): random
op sequences (all-gather pull staged / zero-copy / in place, push, reduce-scatter with 1-5 rounds) on 2-4 ranks under
random stream schedules never read stale or half-written bytes, never write while a peer reads, never deadlock; and
switching off any one safeguard of the enqueue code is caught."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol_model as M  # noqa: E402


def test_random_schedules_are_safe():
    for seed in range(300):
        M.one(seed)


@pytest.mark.parametrize("bug,kinds", [
    ("rs_no_bank_wait", ["rs"]),
    ("rs_one_bank", ["rs"]),
    ("rs_no_arrival_wait", ["rs"]),
    ("rs_no_final_join", M.KINDS),
    ("push_no_final_done_wait", ["push_inplace", "push_from_input"]),
    ("zero_copy_no_final_wait", ["symm_input", "inplace"]),
    ("no_done_wait_before_round", ["staged", "symm_input", "inplace"]),
])
def test_each_safeguard_is_needed(bug, kinds):
    for seed in range(2000):
        try:
            M.one(seed, bugs=frozenset({bug}), kinds=kinds)
        except M.Race:
            return
    pytest.fail(f"the model did not catch the bug {bug!r} in 2000 schedules: it has no teeth there")
