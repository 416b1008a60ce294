"""The zoo model's options and the FSDP stand-ins bench/train.py relies on, on real CPU tensors."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from ce_overlap.inductor.capture import fake_process_group
from ce_overlap.in_graph.fully_shard import _LocalGather, fully_shard
from ce_overlap.models.llama import LLAMA_CONFIGS, Llama, init_weights
from ce_overlap.profiles import builtin_for_device, names


def _tiny(**changes) -> Llama:
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(LLAMA_CONFIGS["llama3-tiny"], **changes))
    init_weights(model)
    return model


def test_expanded_kv_heads_compute_the_same_loss_and_gradients_as_grouped_sdpa():
    grouped, expanded = _tiny(), _tiny(expand_kv=True)
    expanded.load_state_dict(grouped.state_dict())
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (grouped, expanded):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), (_, b) in zip(grouped.named_parameters(), expanded.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_local_gather_has_the_all_gather_shape_and_keeps_this_ranks_gradient_rows():
    shard = torch.arange(6.0).reshape(3, 2).requires_grad_()
    full = _LocalGather.apply(shard, 4, 2)
    assert full.shape == (12, 2)
    assert torch.equal(full[6:9], shard.detach())
    grad = torch.arange(24.0).reshape(12, 2)
    full.backward(grad)
    assert torch.equal(shard.grad, grad[6:9])  # this rank's rows, no reduction over ranks


def test_local_gather_model_trains_the_full_shapes_on_one_rank():
    with fake_process_group(1, 0):
        model = fully_shard(_tiny(), dist.group.WORLD, _local_gather=True)
        tokens = torch.randint(0, 1024, (1, 33), generator=torch.Generator().manual_seed(2))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    reference = _tiny()
    ref_loss = reference(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss, ref_loss)  # one rank: the stand-in gathers the whole parameter


def test_builtin_profile_for_device_names():
    assert builtin_for_device("NVIDIA H200") == "h200-sxm"
    assert builtin_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert builtin_for_device("NVIDIA H100 PCIe") == "h100-pcie"
    assert builtin_for_device("NVIDIA A100-SXM4-80GB") == "a100-sxm"
    assert builtin_for_device("NVIDIA GH200 480GB") is None
    assert builtin_for_device("Some Future GPU", default="h100-sxm") == "h100-sxm"
    assert {builtin_for_device(n) for n in ("H200", "H100", "H100 PCIe", "A100-SXM", "B200")} <= set(names())


@pytest.mark.parametrize("gpu,profile", [
    ("NVIDIA H200", "h200-sxm"), ("NVIDIA H200 NVL", "h200-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 PCIE", "h100-pcie"), ("NVIDIA H100 NVL", None),
    ("NVIDIA GH200 480GB", None), ("NVIDIA GB200", None), ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    ("NVIDIA A100-PCIE-40GB", None), ("NVIDIA A100 80GB PCIe", None), ("NVIDIA B200", "b200"),
    ("Tesla V100-SXM2-32GB", None),
])
def test_one_table_maps_gpu_names_to_profiles(gpu, profile):
    """The one GPU -> profile resolver (the pass's "auto", calibrate, the benchmarks): a GPU no built-in profile
    describes gets none (then DEFAULT, said), never a look-alike's."""
    assert builtin_for_device(gpu) == profile
    assert profile is None or profile in names()
