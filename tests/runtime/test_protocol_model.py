"""The signalling protocol of the CE collectives, checked on a model (tests/runtime/protocol_model.py, no GPU): random
op sequences (all-gather pull staged / zero-copy / in place, push, reduce-scatter with 1-5 rounds, all-to-all staged /
zero-copy, broadcast staged / symmetric / scatter + all-gather (staged) / push (symmetric; relayed on even ranks), batches of point-to-point
messages staged / direct between random pairs) on 2, 3, 4 and 8 ranks, each rank spreading its peer loops over a
random number of lanes (streams) and signalling each peer in turn or once per round, under random stream schedules never read stale or half-written bytes, never write
while a peer reads, never deadlock; and switching off any one safeguard of the enqueue code is caught."""
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
    ("a2a_no_done_wait", ["a2a_staged"]),
    ("a2a_no_final_wait", ["a2a_symm"]),
    ("bc_root_no_final_wait", ["bc_symm"]),
    ("bc_wait_root_only", ["bc_staged", "bc_symm"]),
    ("p2p_one_bank", ["p2p"]),
    ("p2p_credit_before_copy", ["p2p"]),
    ("p2p_no_landed_wait", ["p2p"]),
    ("p2p_no_caller_join", ["p2p"]),
    ("p2p_one_stream", ["p2p"]),  # one stream for every channel of a rank: opposite sends deadlock
    ("sg_no_bank_wait", ["bc_sg_staged"]),
    ("lanes_no_join", ["rs", "staged", "a2a_staged", "bc_sg_staged"]),
    ("bcp_no_pull_wait", ["bc_push"]),  # a piece pushed on before its pull from the root landed
    ("bcp_no_final_wait", ["bc_push"]),  # the tensor handed back before every piece was pushed into it
    ("bcp_relay_push_early", ["bc_push"]),  # relay order (even ranks): a piece pushed on before its pull landed
    ("round_waits_after_fork", ["staged", "a2a_staged", "rs"]),  # per-round signalling: a lane copies before ready
    ("round_done_before_join", ["staged", "a2a_staged", "rs"]),  # per-round signalling: done while a lane copies
])
def test_each_safeguard_is_needed(bug, kinds):
    for seed in range(2000):
        try:
            M.one(seed, bugs=frozenset({bug}), kinds=kinds)
        except M.Race:
            return
    pytest.fail(f"the model did not catch the bug {bug!r} in 2000 schedules: it has no teeth there")
