"""Which backend runs a bucket when the group's own backend for CUDA tensors is gloo: gloo's in-graph all-gather on
CUDA tensors crashes the process (a segfault in torch 2.11, eager and compiled; pytorch/pytorch#152645), so the pass
puts such a bucket on the copy engines or stops the compile with an error naming the problem, never a graph that
segfaults. (On a shared GPU, tests/pass_gpu/run_pass_gpu.py's pass-auto variant runs the ce="auto" case end to end.)"""
from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ce_overlap import PassConfig
from ce_overlap.errors import CeOverlapError
from ce_overlap.inductor import backend_choice


def _bucket(kind: str, group_name: str, backend: str = "nccl", device: str = "cuda"):
    with FakeTensorMode():
        val = torch.empty(1024, device=device)
    member = types.SimpleNamespace(input=types.SimpleNamespace(meta={"val": val}), group=group_name)
    return types.SimpleNamespace(id=3, type=kind, members=[member, member], backend=backend, reason=f"{backend}: planned")


@pytest.mark.parametrize("ce", ["auto", "off"])
def test_a_gloo_cuda_all_gather_the_copy_engine_cannot_take_is_an_error(gloo_world1, ce):
    assert backend_choice.cuda_backend_of(gloo_world1.group_name) == "gloo"
    choose = backend_choice.backend_chooser(PassConfig(ce=ce), "forward")
    with pytest.raises(CeOverlapError, match=r"forward bucket 3 \(all_gather x2\).*gloo.*crashes.*152645"):
        choose(_bucket("all_gather", gloo_world1.group_name))


def test_other_buckets_keep_their_plan(gloo_world1):
    choose = backend_choice.backend_chooser(PassConfig(ce="auto"), "forward")
    assert choose(_bucket("all_reduce", gloo_world1.group_name)) == ("nccl", "nccl: planned")
    assert choose(_bucket("all_gather", gloo_world1.group_name, device="cpu")) == ("nccl", "nccl: planned")
    assert choose(_bucket("all_gather", "no-such-group")) == ("nccl", "nccl: planned")  # unknown: nothing to say


def test_a_gloo_cuda_all_gather_goes_to_the_copy_engine_when_it_can(gloo_world1, monkeypatch):
    monkeypatch.setattr(backend_choice, "ce_runtime_state", lambda device: (True, "stub: the runtime is here"))
    monkeypatch.setattr(backend_choice, "group_ready", lambda group: (True, ""))
    choose = backend_choice.backend_chooser(PassConfig(ce="auto"), "forward")
    backend, reason = choose(_bucket("all_gather", gloo_world1.group_name))
    assert backend == "ce" and "gloo" in reason and "152645" in reason
