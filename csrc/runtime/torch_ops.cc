// The torch face of the runtime: ops registered with TORCH_LIBRARY(ce_overlap), their Meta kernels
// (so FakeTensor / torch.compile can trace them), argument checks, and caching-allocator lifetimes.
// The only translation unit that includes torch headers.
#include "all_gather.h"
#include "group.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/enum_tag.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <sstream>

namespace ce_overlap {
namespace {

std::string shape_text(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

// Checks shared by the CUDA and the Meta kernels, so tracing fails with the same message as eager.
void check_input(const at::Tensor& input, int64_t group_size, const char* op) {
  TORCH_CHECK(input.defined(), "ce_overlap.", op, ": input is undefined");
  TORCH_CHECK(input.layout() == c10::kStrided, "ce_overlap.", op, ": input must be a strided (dense) tensor, got ",
              input.layout());
  TORCH_CHECK(input.dim() >= 1, "ce_overlap.", op,
              ": input must have at least one dimension (the output stacks shards along dim 0); got a 0-dim tensor");
  TORCH_CHECK(group_size >= 1, "ce_overlap.", op, ": group_size must be >= 1, got ", group_size);
  TORCH_CHECK(input.is_contiguous(), "ce_overlap.", op, ": input must be contiguous (got sizes ", input.sym_sizes(),
              " and strides ", input.sym_strides(), "); call .contiguous() on it first");
}

void check_out(const at::Tensor& input, const at::Tensor& out, int64_t group_size, const char* op) {
  TORCH_CHECK(out.defined(), "ce_overlap.", op, ": out is undefined");
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "ce_overlap.", op, ": out has dtype ", out.scalar_type(),
              " but input has ", input.scalar_type());
  TORCH_CHECK(out.device() == input.device(), "ce_overlap.", op, ": out is on ", out.device(), " but input is on ",
              input.device());
  TORCH_CHECK(out.is_contiguous(), "ce_overlap.", op, ": out must be contiguous (got sizes ", out.sym_sizes(),
              " and strides ", out.sym_strides(), ")");
  TORCH_CHECK(out.sym_numel() == input.sym_numel() * group_size, "ce_overlap.", op, ": out has ", out.sym_numel(),
              " elements; it needs group_size * input.numel() = ", group_size, " * ", input.sym_numel());
}

std::shared_ptr<Group> group_for(const std::string& group_name, int64_t group_size, const at::Tensor& input,
                                 const char* op) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, op);
  TORCH_CHECK(group_size == g->world_size(), "ce_overlap.", op, ": group_size=", group_size, " but group '",
              group_name, "' has ", g->world_size(), " ranks");
  TORCH_CHECK(input.is_cuda() && input.device().index() == g->device(), "ce_overlap.", op, ": input is on ",
              input.device(), " but group '", group_name, "' (rank ", g->rank(), ") lives on cuda:", g->device());
  return g;
}

void run_all_gather(Group& g, const at::Tensor& input, at::Tensor& out) {
  const size_t nbytes = static_cast<size_t>(input.numel()) * input.element_size();
  if (nbytes == 0) return;
  const char* in = static_cast<const char*>(input.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const size_t out_bytes = nbytes * static_cast<size_t>(g.world_size());
  const bool in_place = in == o + static_cast<size_t>(g.rank()) * nbytes;
  TORCH_CHECK(in_place || in + nbytes <= o || o + out_bytes <= in, "ce_overlap.all_gather_into_tensor: input overlaps "
              "out but is not out's shard of rank ", g.rank(), " (the only overlap an in-place all-gather allows)");

  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g.device());
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  enqueue_all_gather(g, AllGatherArgs{in, o, nbytes, caller.stream()});

  // The comm and self streams read `input` and write `out` after this call returns: keep the caching
  // allocator from handing their blocks out again before those streams are past them. (Pool tensors
  // are not the allocator's; their frees are deferred by the pool itself.)
  const c10::cuda::CUDAStream comm = c10::cuda::getStreamFromExternal(g.comm_stream(), device);
  const c10::cuda::CUDAStream self = c10::cuda::getStreamFromExternal(g.self_stream(), device);
  if (!g.pool().contains(in)) {
    c10::cuda::CUDACachingAllocator::recordStream(input.storage().data_ptr(), comm);
    c10::cuda::CUDACachingAllocator::recordStream(input.storage().data_ptr(), self);
  }
  if (!g.pool().contains(o)) {
    c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), comm);
    c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), self);
  }
}

// ---------------------------------------------------------------------------------------------------
// Public ops

at::Tensor all_gather_cuda(const at::Tensor& input, int64_t group_size, std::string group_name) {
  check_input(input, group_size, "all_gather_into_tensor");
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, "all_gather_into_tensor");
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] *= group_size;
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(sizes, input.options());
  run_all_gather(*g, input, out);
  return out;
}

void all_gather_out_cuda(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  check_input(input, group_size, "all_gather_into_tensor_out");
  check_out(input, out, group_size, "all_gather_into_tensor_out");
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, "all_gather_into_tensor_out");
  run_all_gather(*g, input, out);
}

at::Tensor all_gather_meta(const at::Tensor& input, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_input(input, group_size, "all_gather_into_tensor");
  std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
  sizes[0] = sizes[0] * group_size;
  return at::empty_symint(sizes, input.options());
}

void all_gather_out_meta(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  (void)group_name;
  check_input(input, group_size, "all_gather_into_tensor_out");
  check_out(input, out, group_size, "all_gather_into_tensor_out");
}

// Stream-ordered ops need no host wait; this keeps a wait node in rewritten graphs and surfaces a
// watchdog failure (timeout) as an exception at the point the result is consumed.
at::Tensor wait_tensor(const at::Tensor& tensor) {
  if (std::optional<std::string> err = Runtime::get().first_failure()) {
    TORCH_CHECK(false, "ce_overlap.wait_tensor: ", *err);
  }
  return tensor;
}

// ---------------------------------------------------------------------------------------------------
// Internal ops used by python/ce_overlap/runtime (rendezvous, pool, tests)

at::Tensor pool_create(std::string group_name, int64_t rank, int64_t world_size, int64_t device) {
  std::shared_ptr<Group> g = Runtime::get().create_group(group_name, static_cast<int>(rank),
                                                         static_cast<int>(world_size), static_cast<int>(device));
  try {
    const PoolHandleBlob blob = g->export_blob();
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

at::Tensor empty_symmetric(c10::IntArrayRef size, c10::ScalarType dtype, std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "empty_symmetric");
  int64_t numel = 1;
  for (int64_t s : size) {
    TORCH_CHECK(s >= 0, "ce_overlap.empty_symmetric: negative size ", s, " in ", shape_text(size));
    numel *= s;
  }
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lk(g->mutex());
    g->throw_if_unusable_locked("empty_symmetric");
    offset = g->pool().allocate_user(nbytes);
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

int64_t range_allocator_self_test(int64_t seed, int64_t steps) {
  return RangeAllocator::self_test(static_cast<uint64_t>(seed), steps);
}

int64_t pool_blob_bytes() { return static_cast<int64_t>(sizeof(PoolHandleBlob)); }

}  // namespace
}  // namespace ce_overlap

TORCH_LIBRARY(ce_overlap, m) {
  using namespace ce_overlap;
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  m.def("all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor", pt2);
  // Returns nothing: torch.compile functionalizes mutating custom ops only when no output aliases an input.
  m.def("all_gather_into_tensor_out(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> ()", pt2);
  m.def("wait_tensor(Tensor tensor) -> Tensor",
        torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(wait_tensor)), pt2);

  m.def("_pool_create(str group_name, int rank, int world_size, int device) -> Tensor", &pool_create);
  m.def("_pool_open(str group_name, Tensor handles) -> ()", &pool_open);
  m.def("_pool_abort(str group_name) -> ()", &pool_abort);
  m.def("_pool_blob_bytes() -> int", &pool_blob_bytes);
  m.def("_has_group(str group_name) -> bool", &has_group);
  m.def("_describe(str group_name) -> str", &describe_group);
  m.def("_synchronize(str group_name, float timeout_s) -> ()", &synchronize_group);
  m.def("_empty_symmetric(int[] size, ScalarType dtype, str group_name) -> Tensor", &empty_symmetric);
  m.def("_symmetric_offset(Tensor tensor, str group_name) -> int", &symmetric_offset);
  m.def("_range_allocator_self_test(int seed, int steps) -> int", &range_allocator_self_test);
}

TORCH_LIBRARY_IMPL(ce_overlap, CUDA, m) {
  m.impl("all_gather_into_tensor", TORCH_FN(ce_overlap::all_gather_cuda));
  m.impl("all_gather_into_tensor_out", TORCH_FN(ce_overlap::all_gather_out_cuda));
}

TORCH_LIBRARY_IMPL(ce_overlap, Meta, m) {
  m.impl("all_gather_into_tensor", TORCH_FN(ce_overlap::all_gather_meta));
  m.impl("all_gather_into_tensor_out", TORCH_FN(ce_overlap::all_gather_out_meta));
}
