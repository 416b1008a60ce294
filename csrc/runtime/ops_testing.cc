// Test and benchmark hooks, registered as TORCH_LIBRARY(ce_overlap_testing): kept out of the production op set
// (ce_overlap), which is what the pass emits and ce_overlap.runtime calls. Used by tests/runtime, bench/ and
// calibrate (ce_overlap.runtime.testing wraps them).
#include "torch_common.h"

#include "symmetric_pool.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

namespace ce_overlap {
namespace {

std::string set_ag_mode(std::string mode) {
  try {
    return set_all_gather_mode(mode);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap_testing._set_all_gather_mode: ", e.what());
  }
}

// Tuning between ops (benchmarks sweep these). A knob is left unchanged by a value <= 0 (pull_split, reduce_ctas,
// rs_round_bytes), < 0 (peer_lanes, bcast_segments, peer_sync: 0 means one lane per peer / chosen from the size /
// each peer in turn) or -1 (copy_rate_gbps: 0 means unlimited). pull_split, reduce_ctas, peer_lanes, peer_sync and
// copy_rate_gbps are local to this rank;
// rs_round_bytes and bcast_segments must be set to the same value on every rank before the next reduce-scatter /
// broadcast (SPMD, like the op itself): they are part of every round's signature, so ranks that disagree get a
// "different collective" timeout, never wrong bytes. Returns the group's resulting "pull_split=.. reduce_ctas=..
// rs_round_bytes=.. peer_lanes=.. bcast_segments=.. copy_rate_gbps=.. peer_sync=.." (rs_round_bytes as configured; the effective
// round is also capped by the staging slot, see _reduce_scatter_round_bytes).
std::string tune(std::string group_name, int64_t pull_split, int64_t reduce_ctas, int64_t rs_round_bytes,
                 int64_t peer_lanes, int64_t bcast_segments, double copy_rate_gbps, int64_t peer_sync) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "_tune");
  std::lock_guard<std::mutex> lk(g->mutex());  // between enqueues: no op sees half a change
  try {
    if (pull_split > 0) g->set_pull_split(static_cast<int>(std::min<int64_t>(pull_split, 1 << 20)));
    if (reduce_ctas > 0) g->set_reduce_ctas(static_cast<int>(std::min<int64_t>(reduce_ctas, 1 << 20)));
    if (rs_round_bytes > 0) g->set_rs_round_bytes(static_cast<size_t>(rs_round_bytes));
    if (peer_lanes >= 0) g->set_peer_lanes(static_cast<int>(std::min<int64_t>(peer_lanes, 1 << 20)));
    if (bcast_segments >= 0) g->set_bcast_segments(static_cast<int>(std::min<int64_t>(bcast_segments, 1 << 20)));
    if (copy_rate_gbps != -1) g->set_copy_rate_gbps(copy_rate_gbps);
    if (peer_sync >= 0) g->set_peer_sync(static_cast<int>(std::min<int64_t>(peer_sync, 1 << 20)));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap_testing._tune: ", e.what());
  }
  return "pull_split=" + std::to_string(g->pull_split()) + " reduce_ctas=" + std::to_string(g->reduce_ctas()) +
         " rs_round_bytes=" + std::to_string(g->rs_round_bytes()) + " peer_lanes=" + std::to_string(g->peer_lanes()) +
         " bcast_segments=" + std::to_string(g->bcast_segments()) +
         " copy_rate_gbps=" + std::to_string(g->copy_rate_gbps()) + " peer_sync=" + std::to_string(g->peer_sync());
}

// Probe: the reduce-scatter's reduction kernel alone, as the op runs it for 2 ranks: out = a + b (fp32
// accumulation; b stands for the one staging slot), at most `ctas` CTAs, on the current stream.
void reduce_bench(at::Tensor out, const at::Tensor& a, const at::Tensor& b, int64_t ctas) {
  static const char* kOp = "_reduce_bench";
  TORCH_CHECK(out.is_cuda() && a.is_cuda() && b.is_cuda() && out.device() == a.device() && a.device() == b.device(),
              "ce_overlap_testing._reduce_bench: out, a and b must be on one CUDA device");
  TORCH_CHECK(out.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "ce_overlap_testing._reduce_bench: out, a and b must be contiguous");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && out.numel() == a.numel() && a.numel() == b.numel(),
              "ce_overlap_testing._reduce_bench: out, a and b must have one size, a and b one dtype");
  TORCH_CHECK(ctas >= 1 && ctas <= 1024, "ce_overlap_testing._reduce_bench: ctas must be in 1..1024, got ", ctas);
  const ReduceDType dt = reduce_dtype_of(a.scalar_type(), kOp);
  const ReduceDType out_dt = reduce_dtype_of(out.scalar_type(), kOp);
  TORCH_CHECK(reduce_dtypes_supported(dt, out_dt), "ce_overlap_testing._reduce_bench: out has dtype ",
              out.scalar_type(), "; it must be a's dtype ", a.scalar_type(), " or float32 (a widening reduction)");
  if (a.numel() == 0) return;
  c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  const size_t bytes = static_cast<size_t>(a.numel()) * a.element_size();
  ReduceParams p{out.data_ptr(), a.data_ptr(), b.data_ptr(), (bytes + 15) / 16 * 16, static_cast<size_t>(a.numel()),
                 2, 0, ReduceOp::Sum};
  const cudaError_t err = launch_reduce(dt, out_dt, p, static_cast<int>(ctas), stream);
  TORCH_CHECK(err == cudaSuccess, "ce_overlap_testing._reduce_bench: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

int64_t rs_round_bytes(std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "reduce_scatter_tensor");
  return static_cast<int64_t>(reduce_scatter_round_bytes(*g));
}

int64_t p2p_round_bytes_op(std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "p2p_round_bytes");
  return static_cast<int64_t>(p2p_round_bytes(*g));
}

// Probe: one copy of src into dst (same GPU, same byte count) on the current stream, by `mode` (see
// local_copy_with in group.h). Raises when the CUDA call refuses (no fallback: the probe measures a mode).
void local_copy(at::Tensor dst, const at::Tensor& src, std::string mode) {
  TORCH_CHECK(dst.is_cuda() && src.is_cuda() && dst.device() == src.device(),
              "ce_overlap_testing._local_copy: dst and src must be on one CUDA device, got ", dst.device(), " and ", src.device());
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "ce_overlap_testing._local_copy: dst and src must be contiguous");
  const size_t nbytes = static_cast<size_t>(src.numel()) * src.element_size();
  TORCH_CHECK(static_cast<size_t>(dst.numel()) * dst.element_size() == nbytes, "ce_overlap_testing._local_copy: dst has ",
              dst.numel() * dst.element_size(), " bytes, src ", nbytes);
  if (nbytes == 0) return;
  c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  TORCH_CHECK(!((mode == "batch" || mode == "batch_hint") && is_legacy_stream(stream)), "ce_overlap_testing._local_copy(mode='",
              mode, "'): cudaMemcpyBatchAsync refuses the legacy default stream (torch's default stream); run it "
              "under torch.cuda.stream(side_stream)");
  cudaError_t err = cudaSuccess;
  try {
    err = local_copy_with(mode, dst.data_ptr(), src.data_ptr(), nbytes, src.device().index(), stream);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap_testing._local_copy: ", e.what());
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "ce_overlap_testing._local_copy(mode='", mode, "'): ", cudaGetErrorName(err), " (",
                cudaGetErrorString(err), ")");
  }
}

std::string local_copy_mode_op() { return local_copy_mode(); }

int64_t range_allocator_self_test(int64_t seed, int64_t steps) {
  return RangeAllocator::self_test(static_cast<uint64_t>(seed), steps);
}

// Tensors that deferred ops hold until their wait (stash mode), ops reaped unwaited, and the mode.
int64_t stashed_tensors() { return static_cast<int64_t>(DeferredJoins::get().stashed_tensors()); }

int64_t reaped_unwaited() { return DeferredJoins::reaped_total().load(); }

std::string keep_alive_mode_op() { return keep_alive_mode() == KeepAlive::Stash ? "stash" : "record_stream"; }

}  // namespace
}  // namespace ce_overlap

TORCH_LIBRARY(ce_overlap_testing, m) {
  using namespace ce_overlap;
  m.def("_set_all_gather_mode(str mode) -> str", &set_ag_mode);
  m.def("_tune(str group_name, int pull_split, int reduce_ctas, int rs_round_bytes, int peer_lanes=-1, "
        "int bcast_segments=-1, float copy_rate_gbps=-1, int peer_sync=-1) -> str",
        &tune);
  m.def("_reduce_bench(Tensor(a!) out, Tensor a, Tensor b, int ctas) -> ()", &reduce_bench);
  m.def("_reduce_scatter_round_bytes(str group_name) -> int", &rs_round_bytes);
  m.def("_p2p_round_bytes(str group_name) -> int", &p2p_round_bytes_op);
  m.def("_local_copy(Tensor(a!) dst, Tensor src, str mode) -> ()", &local_copy);
  m.def("_local_copy_mode() -> str", &local_copy_mode_op);
  m.def("_range_allocator_self_test(int seed, int steps) -> int", &range_allocator_self_test);
  m.def("_stashed_tensors() -> int", &stashed_tensors);
  m.def("_reaped_unwaited() -> int", &reaped_unwaited);
  m.def("_keep_alive_mode() -> str", &keep_alive_mode_op);
}
