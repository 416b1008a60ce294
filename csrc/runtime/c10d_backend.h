// The torch.distributed backend "ce_overlap" (a c10d::Backend): send, recv, all_gather_into_tensor (and its
// coalesced form), reduce_scatter_tensor (sum / avg of float32, float16, bfloat16), all_to_all_single with equal
// splits and broadcast run on the CE runtime's group of the same name; every other op, and every call the runtime
// cannot serve (a reduce op, dtype or layout it lacks, uneven splits, a group whose CE rendezvous failed), goes to an
// inner backend it owns (NCCL, or gloo where NCCL cannot run), with the reason logged once. Created from Python
// (ce_overlap/distributed.py: options, the inner backend, the rendezvous) through the `_c10d` module.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <map>
#include <string>

namespace ce_overlap {

// `ce_unavailable`: empty when the CE rendezvous of `group_name` succeeded on every rank (the runtime has the
// group), else why not (then every op goes to `inner`). `device`: the CUDA device the group lives on.
__attribute__((visibility("default"))) c10::intrusive_ptr<c10d::Backend> make_c10d_backend(
    int rank, int size, const std::string& group_name, int device, c10::intrusive_ptr<c10d::Backend> inner,
    const std::string& ce_unavailable);

// For the Python layer and tests: per op, how many calls ran on copy engines and how many went to the inner backend
// ("<op>:ce" / "<op>:inner" -> count); and the inner backend. Throws if `backend` is not a ce_overlap backend.
__attribute__((visibility("default"))) std::map<std::string, int64_t> c10d_backend_counts(
    const c10::intrusive_ptr<c10d::Backend>& backend);
__attribute__((visibility("default"))) c10::intrusive_ptr<c10d::Backend> c10d_backend_inner(
    const c10::intrusive_ptr<c10d::Backend>& backend);

}  // namespace ce_overlap
