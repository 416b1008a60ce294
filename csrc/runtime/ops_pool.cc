// Rendezvous, pool, symmetric-tensor and process-settings ops of TORCH_LIBRARY(ce_overlap) (used by
// python/ce_overlap/runtime: rendezvous, empty_symmetric, describe, synchronize, RuntimeConfig).
#include "torch_common.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace ce_overlap {
namespace {

// Rendezvous, step 1: this rank's pool for the group, with RuntimeConfig's group fields (validated here, naming the
// field), and its handle blob to publish.
at::Tensor pool_create(std::string group_name, int64_t rank, int64_t world_size, int64_t device, double pool_mb,
                       double staging_mb, double p2p_mb, double timeout_s, double reduce_sms, double rs_round_mb,
                       double pull_split, double copy_rate_gbps, std::string fault_inject, std::string node) {
  GroupConfig config;
  try {
    config = GroupConfig::make(pool_mb, staging_mb, p2p_mb, timeout_s, reduce_sms, rs_round_mb, pull_split,
                               copy_rate_gbps, fault_inject);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  std::shared_ptr<Group> g = Runtime::get().create_group(group_name, static_cast<int>(rank),
                                                         static_cast<int>(world_size), static_cast<int>(device), config);
  try {
    const PoolHandleBlob blob = g->export_blob(node);
    at::Tensor t = at::empty({static_cast<int64_t>(sizeof(blob))}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(t.data_ptr(), &blob, sizeof(blob));
    return t;
  } catch (...) {
    Runtime::get().remove(group_name);
    throw;
  }
}

void pool_open(std::string group_name, const at::Tensor& handles) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "rendezvous");
  try {
    TORCH_CHECK(handles.device().is_cpu() && handles.scalar_type() == at::kByte && handles.dim() == 2 &&
                    handles.size(0) == g->world_size() && handles.size(1) == static_cast<int64_t>(sizeof(PoolHandleBlob)),
                "ce_overlap.rendezvous: expected a CPU uint8 tensor of shape [", g->world_size(), ", ",
                sizeof(PoolHandleBlob), "] holding every rank's pool handle, got ", handles.sizes(), " ",
                handles.scalar_type(), " on ", handles.device());
    at::Tensor h = handles.contiguous();
    std::vector<PoolHandleBlob> blobs(static_cast<size_t>(g->world_size()));
    std::memcpy(blobs.data(), h.data_ptr(), blobs.size() * sizeof(PoolHandleBlob));
    g->open(blobs);
  } catch (...) {
    Runtime::get().remove(group_name);
    throw;
  }
}

void pool_abort(std::string group_name) { Runtime::get().remove(group_name); }

bool has_group(std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().find(group_name);
  return g != nullptr;
}

std::string describe_group(std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().find(group_name);
  return g ? g->describe() : "group '" + group_name + "' has no ce_overlap pool in this process";
}

void synchronize_group(std::string group_name, double timeout_s) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "synchronize");
  g->synchronize(timeout_s > 0 ? timeout_s : g->timeout_s() + 30);
}

// [pending_bytes, offset_0, size_0, offset_1, size_1, ...]: this rank's free user-region ranges as pool
// offsets, after reclaiming the deferred frees whose GPU work is done (`block`: waiting for all of them,
// by polling, never inside a CUDA call and never holding the group lock, so the watchdog can still act).
std::vector<int64_t> symmetric_free_ranges(std::string group_name, bool block) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "empty_symmetric");
  size_t pending = 0;
  std::vector<std::pair<size_t, size_t>> ranges;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(g->timeout_s() + 30);
  while (true) {
    {
      std::lock_guard<std::mutex> lk(g->mutex());
      g->throw_if_unusable_locked("empty_symmetric");
      ranges = g->pool().free_user_ranges(false, &pending);
    }
    if (!block || pending == 0) break;
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "ce_overlap.empty_symmetric: group '", group_name,
                "': ", pending, " bytes of freed symmetric tensors are still in use by the GPU after ",
                g->timeout_s() + 30, " s");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::vector<int64_t> out{static_cast<int64_t>(pending)};
  for (const auto& [off, size] : ranges) {
    out.push_back(static_cast<int64_t>(off));
    out.push_back(static_cast<int64_t>(size));
  }
  return out;
}

// A tensor at an agreed pool offset (python/ce_overlap/runtime/_symalloc.py decides it from every rank's
// free ranges). Throws, naming the range, when it is not free on this rank.
at::Tensor empty_symmetric_at(c10::IntArrayRef size, c10::ScalarType dtype, std::string group_name, int64_t offset) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "empty_symmetric");
  int64_t numel = 1;
  for (int64_t s : size) {
    TORCH_CHECK(s >= 0, "ce_overlap.empty_symmetric: negative size ", s, " in ", shape_text(size));
    numel *= s;
  }
  TORCH_CHECK(offset >= 0, "ce_overlap.empty_symmetric: negative pool offset ", offset);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  {
    std::lock_guard<std::mutex> lk(g->mutex());
    g->throw_if_unusable_locked("empty_symmetric");
    g->pool().allocate_user_at(static_cast<size_t>(offset), nbytes);
  }
  void* ptr = g->pool().local_base() + offset;
  auto release = [g, offset, nbytes](void*) {
    if (Runtime::get().shutting_down()) return;  // process exit: the pool dies with it
    try {
      const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g->device());
      g->release_symmetric(offset, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
    } catch (const std::exception& e) {
      // A deleter must not throw; the range stays allocated (leaked), which is safe.
      std::fprintf(stderr, "ce_overlap: could not release a symmetric tensor of group '%s': %s\n",
                   g->name().c_str(), e.what());
    }
  };
  return at::from_blob(ptr, size, release,
                       at::TensorOptions().dtype(dtype).device(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(g->device()))));
}

int64_t symmetric_offset(const at::Tensor& t, std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().find(group_name);
  if (!g || !t.defined() || !t.is_cuda()) return -1;
  std::optional<size_t> off =
      g->pool().user_region_offset(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  return off ? static_cast<int64_t>(*off) : -1;
}

int64_t pool_alignment() { return static_cast<int64_t>(kPoolAlignment); }

int64_t pool_blob_bytes() { return static_cast<int64_t>(sizeof(PoolHandleBlob)); }

// RuntimeConfig's process-wide fields (every op reads them when it is enqueued).
void configure_process(std::string all_gather_mode, std::string local_copy, std::string keep_alive) {
  TORCH_CHECK(local_copy == "ce" || local_copy == "memcpy", "ce_overlap: RuntimeConfig.local_copy='", local_copy,
              "' must be 'ce' or 'memcpy'");
  TORCH_CHECK(keep_alive == "stash" || keep_alive == "record_stream", "ce_overlap: RuntimeConfig.keep_alive='",
              keep_alive, "' must be 'stash' or 'record_stream'");
  try {
    set_all_gather_mode(all_gather_mode);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap: RuntimeConfig.all_gather_mode: ", e.what());
  }
  set_local_copy_hint(local_copy == "ce");
  set_keep_alive_mode(keep_alive == "stash" ? KeepAlive::Stash : KeepAlive::RecordStream);
}

}  // namespace
}  // namespace ce_overlap

TORCH_LIBRARY_FRAGMENT(ce_overlap, m) {
  using namespace ce_overlap;
  m.def("_pool_create(str group_name, int rank, int world_size, int device, float pool_mb, float staging_mb, "
        "float p2p_mb, float timeout_s, float reduce_sms, float rs_round_mb, float pull_split, float copy_rate_gbps, "
        "str fault_inject, str node=\"\") "
        "-> Tensor", &pool_create);
  m.def("_pool_open(str group_name, Tensor handles) -> ()", &pool_open);
  m.def("_pool_abort(str group_name) -> ()", &pool_abort);
  m.def("_pool_blob_bytes() -> int", &pool_blob_bytes);
  m.def("_has_group(str group_name) -> bool", &has_group);
  m.def("_describe(str group_name) -> str", &describe_group);
  m.def("_synchronize(str group_name, float timeout_s) -> ()", &synchronize_group);
  m.def("_symmetric_free_ranges(str group_name, bool block) -> int[]", &symmetric_free_ranges);
  m.def("_empty_symmetric_at(int[] size, ScalarType dtype, str group_name, int offset) -> Tensor", &empty_symmetric_at);
  m.def("_symmetric_offset(Tensor tensor, str group_name) -> int", &symmetric_offset);
  m.def("_pool_alignment() -> int", &pool_alignment);
  m.def("_configure_process(str all_gather_mode, str local_copy, str keep_alive) -> ()", &configure_process);
}
