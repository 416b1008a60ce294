// The torch face of the runtime: ops registered with TORCH_LIBRARY(ce_overlap), their Meta kernels
// (so FakeTensor / torch.compile can trace them), argument checks, and caching-allocator lifetimes.
// The only translation unit that includes torch headers.
#include "all_gather.h"
#include "all_to_all.h"
#include "group.h"
#include "p2p.h"
#include "reduce_scatter.h"

#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <ATen/core/enum_tag.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <sstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ce_overlap {
namespace {

std::string shape_text(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

// Checks shared by the CUDA and the Meta kernels, so tracing fails with the same message as eager.
void check_input(const at::Tensor& input, int64_t group_size, const char* op, bool scatter = false) {
  TORCH_CHECK(input.defined(), "ce_overlap.", op, ": input is undefined");
  TORCH_CHECK(input.layout() == c10::kStrided, "ce_overlap.", op, ": input must be a strided (dense) tensor, got ",
              input.layout());
  TORCH_CHECK(input.dim() >= 1, "ce_overlap.", op, ": input must have at least one dimension (",
              scatter ? "it is split into group_size chunks along dim 0" : "the output stacks shards along dim 0",
              "); got a 0-dim tensor");
  TORCH_CHECK(group_size >= 1, "ce_overlap.", op, ": group_size must be >= 1, got ", group_size);
  TORCH_CHECK(input.is_contiguous(), "ce_overlap.", op, ": input must be contiguous (got sizes ", input.sym_sizes(),
              " and strides ", input.sym_strides(), "); call .contiguous() on it first");
}

// What every `out` argument must share with the input: defined, same dtype and device, contiguous.
void check_out_like_input(const at::Tensor& input, const at::Tensor& out, const char* op) {
  TORCH_CHECK(out.defined(), "ce_overlap.", op, ": out is undefined");
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "ce_overlap.", op, ": out has dtype ", out.scalar_type(),
              " but input has ", input.scalar_type());
  TORCH_CHECK(out.device() == input.device(), "ce_overlap.", op, ": out is on ", out.device(), " but input is on ",
              input.device());
  TORCH_CHECK(out.is_contiguous(), "ce_overlap.", op, ": out must be contiguous (got sizes ", out.sym_sizes(),
              " and strides ", out.sym_strides(), ")");
}

void check_out(const at::Tensor& input, const at::Tensor& out, int64_t group_size, const char* op) {
  check_out_like_input(input, out, op);
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

// How a tensor that a collective's streams use after the op returns is kept from the caching allocator.
//   stash (default): a deferred op (functional ops: the caller joins at wait_tensor) holds its inputs and outputs
//     until the first wait_tensor on one of its outputs has made the waiting stream wait for the op's end; then it
//     drops them, so their blocks go back to the allocator in that stream's order, like any tensor the stream used.
//     An op whose caller joins at once (the out= variants, broadcast_) needs nothing: the caller's stream is past
//     the op before anything later on it can reuse the memory. This is what ProcessGroupNCCL does for functional
//     collectives (TORCH_NCCL_AVOID_RECORD_STREAMS), and what the planner's memory model assumes (an input lives
//     until its wait).
//   record_stream (CE_OVERLAP_KEEP_ALIVE=record_stream, for comparison): recordStream on every stream of the op.
//     Freed blocks then return to the allocator only once those streams have passed the free *as the host sees
//     it*, so when the host runs ahead of the GPU (a training loop that never synchronizes) every block a
//     collective touched in the run-ahead window stays reserved, and new allocations take fresh memory.
// Point-to-point batches keep recordStream in both modes (their async tickets carry no tensors).
enum class KeepAlive { Stash, RecordStream };

KeepAlive keep_alive_mode() {
  static const KeepAlive mode = [] {
    const char* raw = std::getenv("CE_OVERLAP_KEEP_ALIVE");
    const std::string text = raw ? raw : "";
    if (text.empty() || text == "stash") return KeepAlive::Stash;
    if (text == "record_stream") return KeepAlive::RecordStream;
    TORCH_CHECK(false, "ce_overlap: environment variable CE_OVERLAP_KEEP_ALIVE='", text,
                "' must be 'stash' or 'record_stream'");
  }();
  return mode;
}

// recordStream of `t` on `streams` (tensors of the group's pool are not the allocator's: skipped).
void record_streams(Group& g, const at::Tensor& t, const std::vector<cudaStream_t>& streams) {
  if (t.numel() == 0 || g.pool().contains(t.data_ptr())) return;
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g.device());
  for (cudaStream_t s : streams) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getStreamFromExternal(s, device));
  }
}

// What a deferred op's streams read or write after it returned: held until the first wait on one of its outputs.
// Outputs are held by their storages, not their tensors: whether anyone can still wait for the op is whether a
// tensor other than ours refers to an output's storage (the result itself, or a view of it), which the storage's
// reference count says exactly (a tensor holds one reference to its storage however many references it has).
struct Stash {
  std::vector<at::Tensor> inputs;
  std::vector<c10::Storage> outputs;
  std::vector<c10::Storage> record_on_drop;  // the allocator's storages among both, for the unwaited case
  std::vector<cudaStream_t> streams;
  c10::DeviceIndex device = 0;

  // No tensor outside this stash refers to any output's storage: nobody can wait for the op any more.
  bool unreachable() const {
    for (const c10::Storage& out : outputs) {
      size_t ours = 0;
      for (const at::Tensor& t : inputs) ours += t.storage().is_alias_of(out) ? 1 : 0;
      for (const auto* list : {&outputs, &record_on_drop}) {
        for (const c10::Storage& st : *list) ours += st.is_alias_of(out) ? 1 : 0;
      }
      if (out.use_count() > ours) return false;
    }
    return true;
  }
};

// Deferred joins of the functional ops: output storage -> the event its op's end was recorded into, and the op's
// stash. The op returns without making the caller's stream wait (so the compute a graph places between a
// collective and its wait overlaps it, as with _c10d_functional); ce_overlap::wait_tensor(output) makes the current
// stream wait on the event and drops the stash. Events are reused only after a wait consumed them
// (cudaStreamWaitEvent snapshots the event).
class DeferredJoins {
 public:
  static DeferredJoins& get() {
    static DeferredJoins* joins = new DeferredJoins();  // leaked: no CUDA calls during static destruction
    return *joins;
  }

  cudaEvent_t take(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<cudaEvent_t>& free = free_[device];
    if (!free.empty()) {
      cudaEvent_t e = free.back();
      free.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    const cudaError_t st = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    TORCH_CHECK(st == cudaSuccess, "ce_overlap: cudaEventCreateWithFlags failed: ", cudaGetErrorString(st));
    return e;
  }

  // The op was not enqueued: the event goes back unused.
  void give_back(int device, cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(e);
  }

  // Registers the op's event and stash under each of its outputs' storages (several for a multi-output op: the
  // event goes back to the free list once every one of them was waited for or replaced). Ops whose results were
  // dropped without a wait (eager code calling a functional op directly) would hold their stash forever: they
  // are reaped here, their tensors handed to the allocator with recordStream on the op's streams instead.
  void add(const std::vector<const void*>& storages, int device, cudaEvent_t e, std::shared_ptr<Stash> stash) {
    std::vector<std::shared_ptr<Stash>> reaped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reap_unreachable_locked(reaped);
      refs_[e] += storages.size();
      for (const void* storage : storages) {
        auto [it, inserted] = pending_.try_emplace(storage, Entry{device, e, stash});
        if (!inserted) {  // memory of a result never waited for itself (a sibling output was) holds this one
          release_locked(it->second);
          it->second = Entry{device, e, stash};
        }
      }
      if (refs_[e] == 0) {  // no storage at all
        refs_.erase(e);
        free_[device].push_back(e);
      }
    }
    drop_unwaited(reaped);  // outside the lock: frees go to the allocator
  }

  // Makes `stream` wait for the op that produced `storage`, if one is pending; true if one was.
  bool join(const void* storage, cudaStream_t stream) {
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(storage);
      if (it == pending_.end()) return false;
      entry = it->second;
      pending_.erase(it);
    }
    const cudaError_t st = cudaStreamWaitEvent(stream, entry.event, 0);
    Stash dropped;  // destroyed after the lock is released: the frees go to the allocator in `stream`'s order
    {
      std::lock_guard<std::mutex> lock(mu_);
      release_locked(entry);
      if (st == cudaSuccess && entry.stash) {
        // The first wait ends the op for this stream; the other outputs' entries keep only the event.
        std::swap(dropped.inputs, entry.stash->inputs);
        std::swap(dropped.outputs, entry.stash->outputs);
        std::swap(dropped.record_on_drop, entry.stash->record_on_drop);
      }
    }
    TORCH_CHECK(st == cudaSuccess, "ce_overlap.wait_tensor: cudaStreamWaitEvent failed: ", cudaGetErrorString(st));
    return true;
  }

  // Ops whose results were dropped without a wait, reaped so far (a graph should have none).
  static std::atomic<int64_t>& reaped_total() {
    static std::atomic<int64_t> n{0};
    return n;
  }

  // Tensors held by pending ops (for tests: a stash that is never dropped is a leak).
  size_t stashed_tensors() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<const Stash*> seen;
    size_t n = 0;
    for (const auto& [storage, entry] : pending_) {
      if (!entry.stash || std::find(seen.begin(), seen.end(), entry.stash.get()) != seen.end()) continue;
      seen.push_back(entry.stash.get());
      n += entry.stash->inputs.size() + entry.stash->outputs.size();
    }
    return n;
  }

 private:
  struct Entry {
    int device = 0;
    cudaEvent_t event = nullptr;
    std::shared_ptr<Stash> stash;  // shared by the entries of one op's outputs; emptied by the first wait
  };
  // One reference of `entry`'s event is gone; the last one frees it (cudaStreamWaitEvent snapshots the event, so
  // it may be recorded again by a later op).
  void release_locked(const Entry& entry) {
    auto it = refs_.find(entry.event);
    if (it == refs_.end() || --it->second > 0) return;
    refs_.erase(it);
    free_[entry.device].push_back(entry.event);
  }

  // An op's outputs share one stash: each stash is judged once per call, however many entries it has.
  void reap_unreachable_locked(std::vector<std::shared_ptr<Stash>>& reaped) {
    std::vector<const Stash*> alive;
    for (auto it = pending_.begin(); it != pending_.end();) {
      const std::shared_ptr<Stash>& stash = it->second.stash;
      if (!stash || stash->outputs.empty() || std::find(alive.begin(), alive.end(), stash.get()) != alive.end()) {
        ++it;
        continue;
      }
      if (std::find(reaped.begin(), reaped.end(), stash) == reaped.end()) {
        if (!stash->unreachable()) {
          alive.push_back(stash.get());
          ++it;
          continue;
        }
        reaped.push_back(stash);
      }
      release_locked(it->second);
      it = pending_.erase(it);
    }
  }

  static void drop_unwaited(std::vector<std::shared_ptr<Stash>>& reaped) {
    reaped_total().fetch_add(reaped.size());
    for (const std::shared_ptr<Stash>& stash : reaped) {
      for (const c10::Storage& st : stash->record_on_drop) {
        for (cudaStream_t s : stash->streams) {
          c10::cuda::CUDACachingAllocator::recordStream(st.data_ptr(), c10::cuda::getStreamFromExternal(s, stash->device));
        }
      }
      stash->inputs.clear();
      stash->outputs.clear();
      stash->record_on_drop.clear();
    }
  }

  std::mutex mu_;
  std::unordered_map<const void*, Entry> pending_;
  std::unordered_map<cudaEvent_t, size_t> refs_;  // pending entries per event
  std::map<int, std::vector<cudaEvent_t>> free_;
};

// Enqueues an op that reads `inputs` and writes `outs` on `streams` after it returns. Deferred (functional ops):
// the join is registered under the outputs' storages with the tensors stashed until the first wait (KeepAlive).
// Otherwise the caller joins now.
template <typename Enqueue>
void enqueue_keeping_alive(Group& g, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outs,
                           std::vector<cudaStream_t> streams, bool deferred, Enqueue&& enqueue) {
  const bool record = keep_alive_mode() == KeepAlive::RecordStream;
  auto record_all = [&] {
    for (const auto* list : {&inputs, &outs}) {
      for (const at::Tensor& t : *list) record_streams(g, t, streams);
    }
  };
  if (!deferred) {
    enqueue(static_cast<cudaEvent_t>(nullptr));
    if (record) record_all();
    return;
  }
  DeferredJoins& joins = DeferredJoins::get();
  cudaEvent_t e = joins.take(g.device());
  try {
    enqueue(e);
  } catch (...) {
    joins.give_back(g.device(), e);
    throw;
  }
  auto stash = std::make_shared<Stash>();
  stash->device = static_cast<c10::DeviceIndex>(g.device());
  if (record) {
    record_all();
  } else {
    stash->inputs = inputs;
    for (const at::Tensor& out : outs) stash->outputs.push_back(out.storage());
    stash->streams = std::move(streams);
    for (const auto* list : {&inputs, &outs}) {
      for (const at::Tensor& t : *list) {
        if (t.numel() != 0 && !g.pool().contains(t.data_ptr())) stash->record_on_drop.push_back(t.storage());
      }
    }
  }
  std::vector<const void*> storages;
  for (const at::Tensor& out : outs) {
    const void* storage = out.storage().data_ptr().get();
    if (std::find(storages.begin(), storages.end(), storage) == storages.end()) storages.push_back(storage);
  }
  joins.add(storages, g.device(), e, record ? nullptr : std::move(stash));
}

void run_all_gather(Group& g, const at::Tensor& input, at::Tensor& out, bool deferred = false) {
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
  // The comm and self streams read `input` and write `out` after this call returns (pool tensors' frees are
  // deferred by the pool itself).
  enqueue_keeping_alive(g, {input}, {out}, {g.comm_stream(), g.self_stream()}, deferred, [&](cudaEvent_t join) {
    enqueue_all_gather(g, AllGatherArgs{{AllGatherPart{in, o, nbytes}}, caller.stream(), join});
  });
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
  run_all_gather(*g, input, out, /*deferred=*/true);
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

// The inputs of a multi-tensor op: at least one, each passing the one-tensor op's checks (check_one), all on one
// device.
template <typename CheckOne>
void check_parts(at::TensorList inputs, const char* op, CheckOne&& check_one) {
  TORCH_CHECK(!inputs.empty(), "ce_overlap.", op, ": needs at least one input tensor");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_one(i, inputs[i]);
    TORCH_CHECK(inputs[i].device() == inputs[0].device(), "ce_overlap.", op, ": inputs[", i, "] is on ",
                inputs[i].device(), " but inputs[0] is on ", inputs[0].device());
  }
}

// all_gather_into_tensors: several tensors gathered as one op (a bucket without a bucket buffer). Output i is what
// all_gather_into_tensor(inputs[i]) returns.
void check_ag_parts(at::TensorList inputs, int64_t group_size, const char* op) {
  check_parts(inputs, op, [&](size_t, const at::Tensor& t) { check_input(t, group_size, op); });
}

std::vector<at::Tensor> all_gather_tensors_cuda(at::TensorList inputs, int64_t group_size, std::string group_name) {
  static const char* kOp = "all_gather_into_tensors";
  check_ag_parts(inputs, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g->device());
  c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> outs;
  AllGatherArgs args;
  for (const at::Tensor& input : inputs) {
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] *= group_size;
    outs.push_back(at::empty(sizes, input.options()));
    args.parts.push_back(AllGatherPart{input.data_ptr(), outs.back().data_ptr(),
                                       static_cast<size_t>(input.numel()) * input.element_size()});
  }
  if (args.nbytes() == 0) return outs;
  args.caller = c10::cuda::getCurrentCUDAStream(device).stream();
  enqueue_keeping_alive(*g, inputs.vec(), outs, {g->comm_stream(), g->self_stream()}, /*deferred=*/true,
                        [&](cudaEvent_t join) {
                          args.join = join;
                          enqueue_all_gather(*g, args);
                        });
  return outs;
}

std::vector<at::Tensor> all_gather_tensors_meta(at::TensorList inputs, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_ag_parts(inputs, group_size, "all_gather_into_tensors");
  std::vector<at::Tensor> outs;
  for (const at::Tensor& input : inputs) {
    std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
    sizes[0] = sizes[0] * group_size;
    outs.push_back(at::empty_symint(sizes, input.options()));
  }
  return outs;
}

// ---------------------------------------------------------------------------------------------------
// Reduce-scatter

ReduceDType reduce_dtype_of(c10::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat:
      return ReduceDType::F32;
    case at::kHalf:
      return ReduceDType::F16;
    case at::kBFloat16:
      return ReduceDType::BF16;
    default:
      TORCH_CHECK(false, "ce_overlap.", op, ": dtype ", t, " is not supported (float32, float16 and bfloat16 are)");
  }
}

ReduceOp reduce_op_of(const std::string& name, const char* op) {
  std::string low = name;
  std::transform(low.begin(), low.end(), low.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (low == "sum") return ReduceOp::Sum;
  if (low == "avg") return ReduceOp::Avg;
  TORCH_CHECK(false, "ce_overlap.", op, ": reduce_op '", name, "' is not supported (sum and avg are)");
}

void check_rs_input(const at::Tensor& input, const std::string& reduce_op, int64_t group_size, const char* op) {
  check_input(input, group_size, op, /*scatter=*/true);
  reduce_dtype_of(input.scalar_type(), op);
  reduce_op_of(reduce_op, op);
  TORCH_SYM_CHECK((input.sym_size(0) % group_size).sym_eq(0), "ce_overlap.", op, ": input.shape[0] = ",
                  input.sym_size(0), " is not divisible by group_size = ", group_size);
}

void check_rs_out(const at::Tensor& input, const at::Tensor& out, int64_t group_size, const char* op) {
  check_out_like_input(input, out, op);
  TORCH_SYM_CHECK((out.sym_numel() * group_size).sym_eq(input.sym_numel()), "ce_overlap.", op, ": out has ",
                  out.sym_numel(), " elements; it needs input.numel() / group_size = ", input.sym_numel(), " / ",
                  group_size);
}

void run_reduce_scatter(Group& g, const at::Tensor& input, at::Tensor& out, const std::string& reduce_op,
                        const char* op, bool deferred = false) {
  const size_t n = static_cast<size_t>(g.world_size());
  const size_t chunk = static_cast<size_t>(input.numel()) * input.element_size() / n;
  if (chunk == 0) return;
  const char* in = static_cast<const char*>(input.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const bool in_place = o == in + static_cast<size_t>(g.rank()) * chunk;
  TORCH_CHECK(in_place || in + n * chunk <= o || o + chunk <= in, "ce_overlap.", op, ": out overlaps input but is not "
              "input's chunk of rank ", g.rank(), " (the only overlap an in-place reduce-scatter allows)");

  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g.device());
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  // The comm stream reads the input, the reduce stream reads it and writes out after this returns.
  enqueue_keeping_alive(g, {input}, {out}, {g.comm_stream(), g.reduce_stream()}, deferred, [&](cudaEvent_t join) {
    enqueue_reduce_scatter(g, ReduceScatterArgs{{ReduceScatterPart{in, chunk}}, o, reduce_dtype_of(input.scalar_type(), op),
                                                reduce_op_of(reduce_op, op), caller.stream(), join});
  });
}

at::Tensor reduce_scatter_cuda(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name) {
  static const char* kOp = "reduce_scatter_tensor";
  check_rs_input(input, reduce_op, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] /= group_size;
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(sizes, input.options());
  run_reduce_scatter(*g, input, out, reduce_op, kOp, /*deferred=*/true);
  return out;
}

void reduce_scatter_out_cuda(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name,
                             at::Tensor out) {
  static const char* kOp = "reduce_scatter_tensor_out";
  check_rs_input(input, reduce_op, group_size, kOp);
  check_rs_out(input, out, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  run_reduce_scatter(*g, input, out, reduce_op, kOp);
}

at::Tensor reduce_scatter_meta(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_rs_input(input, reduce_op, group_size, "reduce_scatter_tensor");
  std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
  sizes[0] = sizes[0] / group_size;
  return at::empty_symint(sizes, input.options());
}

void reduce_scatter_out_meta(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name,
                             at::Tensor out) {
  (void)group_name;
  check_rs_input(input, reduce_op, group_size, "reduce_scatter_tensor_out");
  check_rs_out(input, out, group_size, "reduce_scatter_tensor_out");
}

// reduce_scatter_tensors: several tensors reduce-scattered as one op (a bucket without a bucket buffer). The output
// is 1-D: the concatenation, in input order, of what reduce_scatter_tensor(inputs[i]) returns, flattened.
void check_rs_parts(at::TensorList inputs, const std::string& reduce_op, int64_t group_size, const char* op) {
  check_parts(inputs, op, [&](size_t i, const at::Tensor& t) {
    check_rs_input(t, reduce_op, group_size, op);
    TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), "ce_overlap.", op, ": inputs[", i, "] has dtype ",
                t.scalar_type(), " but inputs[0] has ", inputs[0].scalar_type(), " (one op reduces one dtype)");
  });
}

// One reduce-scatter over several tensors (reduce_scatter_tensors and its unreduced form): every input's chunks are
// parts of one op, `args` says how the op ends, `make_out(numel per rank)` allocates the output; an empty output
// (nothing to move, or no peers) is returned without an op.
template <typename MakeOut>
at::Tensor run_reduce_scatter_parts(Group& g, at::TensorList inputs, int64_t group_size, ReduceScatterArgs args,
                                    MakeOut&& make_out) {
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g.device());
  c10::cuda::CUDAGuard guard(device);
  int64_t numel = 0;
  for (const at::Tensor& input : inputs) {
    numel += input.numel() / group_size;
    args.parts.push_back(ReduceScatterPart{input.data_ptr(),
                                           static_cast<size_t>(input.numel() / group_size) * input.element_size()});
  }
  at::Tensor out = make_out(numel);
  if (out.numel() == 0) return out;
  args.output = out.data_ptr();
  args.caller = c10::cuda::getCurrentCUDAStream(device).stream();
  // The comm stream reads the inputs (pushes), the reduce stream writes out (the reduction, or the copy-out).
  enqueue_keeping_alive(g, inputs.vec(), {out}, {g.comm_stream(), g.reduce_stream()}, /*deferred=*/true,
                        [&](cudaEvent_t join) {
                          args.join = join;
                          enqueue_reduce_scatter(g, args);
                        });
  return out;
}

at::Tensor reduce_scatter_tensors_cuda(at::TensorList inputs, std::string reduce_op, int64_t group_size,
                                       std::string group_name) {
  static const char* kOp = "reduce_scatter_tensors";
  check_rs_parts(inputs, reduce_op, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  ReduceScatterArgs args{};
  args.dtype = reduce_dtype_of(inputs[0].scalar_type(), kOp);
  args.op = reduce_op_of(reduce_op, kOp);
  return run_reduce_scatter_parts(*g, inputs, group_size, args,
                                  [&](int64_t numel) { return at::empty({numel}, inputs[0].options()); });
}

at::Tensor reduce_scatter_tensors_meta(at::TensorList inputs, std::string reduce_op, int64_t group_size,
                                       std::string group_name) {
  (void)group_name;
  check_rs_parts(inputs, reduce_op, group_size, "reduce_scatter_tensors");
  c10::SymInt numel = 0;
  for (const at::Tensor& input : inputs) numel = numel + input.sym_numel() / group_size;
  return at::empty_symint({numel}, inputs[0].options());
}

// reduce_scatter_tensors_unreduced: the exchange of reduce_scatter_tensors without its reduction. Returns
// [group_size - 1, N] (N = sum of numel / group_size over the inputs): row j is what the j-th OTHER rank (rank
// order, this rank skipped) holds for this rank, its inputs' chunks concatenated like reduce_scatter_tensors'
// output. The reduce-scatter's result is this rank's own chunks plus the sum of the rows (mean: divided by
// group_size), which the caller computes (the pass emits it as graph ops that Inductor fuses into the consumer).
// Any dtype (nothing is reduced here); all inputs share it.
void check_unreduced_parts(at::TensorList inputs, int64_t group_size, const char* op) {
  check_parts(inputs, op, [&](size_t i, const at::Tensor& t) {
    check_input(t, group_size, op, /*scatter=*/true);
    TORCH_SYM_CHECK((t.sym_size(0) % group_size).sym_eq(0), "ce_overlap.", op, ": inputs[", i, "].shape[0] = ",
                    t.sym_size(0), " is not divisible by group_size = ", group_size);
    TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), "ce_overlap.", op, ": inputs[", i, "] has dtype ",
                t.scalar_type(), " but inputs[0] has ", inputs[0].scalar_type(), " (one op moves one dtype)");
  });
}

at::Tensor reduce_scatter_tensors_unreduced_cuda(at::TensorList inputs, int64_t group_size, std::string group_name) {
  static const char* kOp = "reduce_scatter_tensors_unreduced";
  check_unreduced_parts(inputs, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  ReduceScatterArgs args{};
  args.unreduced = true;
  return run_reduce_scatter_parts(*g, inputs, group_size, args, [&](int64_t numel) {
    return at::empty({group_size - 1, numel}, inputs[0].options());  // no rows for a group of one
  });
}

at::Tensor reduce_scatter_tensors_unreduced_meta(at::TensorList inputs, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_unreduced_parts(inputs, group_size, "reduce_scatter_tensors_unreduced");
  c10::SymInt numel = 0;
  for (const at::Tensor& input : inputs) numel = numel + input.sym_numel() / group_size;
  return at::empty_symint({c10::SymInt(group_size - 1), numel}, inputs[0].options());
}

// ---------------------------------------------------------------------------------------------------
// All-to-all (equal splits) and broadcast

void check_a2a_input(const at::Tensor& input, int64_t group_size, const char* op) {
  check_input(input, group_size, op, /*scatter=*/true);
  TORCH_SYM_CHECK((input.sym_size(0) % group_size).sym_eq(0), "ce_overlap.", op, ": input.shape[0] = ",
                  input.sym_size(0), " is not divisible by group_size = ", group_size,
                  " (only equal splits are supported: uneven all-to-alls stay on NCCL)");
}

void check_a2a_out(const at::Tensor& input, const at::Tensor& out, const char* op) {
  check_out_like_input(input, out, op);
  TORCH_SYM_CHECK(out.sym_numel().sym_eq(input.sym_numel()), "ce_overlap.", op, ": out has ", out.sym_numel(),
                  " elements; it needs input.numel() = ", input.sym_numel());
}

void run_all_to_all(Group& g, const at::Tensor& input, at::Tensor& out, const char* op, bool deferred = false) {
  const size_t n = static_cast<size_t>(g.world_size());
  const size_t chunk = static_cast<size_t>(input.numel()) * input.element_size() / n;
  if (chunk == 0) return;
  const char* in = static_cast<const char*>(input.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  TORCH_CHECK(in + n * chunk <= o || o + n * chunk <= in, "ce_overlap.", op, ": out overlaps input (an all-to-all "
              "cannot run in place: every rank reads its peers' inputs while they write their outputs)");
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g.device());
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  enqueue_keeping_alive(g, {input}, {out}, {g.comm_stream(), g.self_stream()}, deferred, [&](cudaEvent_t join) {
    enqueue_all_to_all(g, AllToAllArgs{in, o, chunk, caller.stream(), join});
  });
}

at::Tensor all_to_all_cuda(const at::Tensor& input, int64_t group_size, std::string group_name) {
  static const char* kOp = "all_to_all_single";
  check_a2a_input(input, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(input.sizes(), input.options());
  run_all_to_all(*g, input, out, kOp, /*deferred=*/true);
  return out;
}

void all_to_all_out_cuda(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  static const char* kOp = "all_to_all_single_out";
  check_a2a_input(input, group_size, kOp);
  check_a2a_out(input, out, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  run_all_to_all(*g, input, out, kOp);
}

at::Tensor all_to_all_meta(const at::Tensor& input, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_a2a_input(input, group_size, "all_to_all_single");
  return at::empty_symint(input.sym_sizes(), input.options());
}

void all_to_all_out_meta(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  (void)group_name;
  check_a2a_input(input, group_size, "all_to_all_single_out");
  check_a2a_out(input, out, "all_to_all_single_out");
}

void check_broadcast(const at::Tensor& tensor, int64_t root, int64_t group_size) {
  TORCH_CHECK(tensor.defined() && tensor.layout() == c10::kStrided, "ce_overlap.broadcast_: tensor must be a defined "
              "strided tensor");
  TORCH_CHECK(tensor.is_contiguous(), "ce_overlap.broadcast_: tensor must be contiguous (got sizes ", tensor.sym_sizes(),
              " and strides ", tensor.sym_strides(), ")");
  TORCH_CHECK(group_size >= 1, "ce_overlap.broadcast_: group_size must be >= 1, got ", group_size);
  TORCH_CHECK(root >= 0 && root < group_size, "ce_overlap.broadcast_: root ", root, " is not a rank of a group of ",
              group_size);
}

void broadcast_cuda(at::Tensor tensor, int64_t root, int64_t group_size, std::string group_name) {
  check_broadcast(tensor, root, group_size);
  std::shared_ptr<Group> g = group_for(group_name, group_size, tensor, "broadcast_");
  const size_t nbytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (nbytes == 0) return;
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g->device());
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  // The caller's stream joins the op before this returns.
  enqueue_keeping_alive(*g, {tensor}, {}, {g->comm_stream()}, /*deferred=*/false, [&](cudaEvent_t) {
    enqueue_broadcast(*g, BroadcastArgs{tensor.data_ptr(), nbytes, static_cast<int>(root), caller.stream()});
  });
}

void broadcast_meta(at::Tensor tensor, int64_t root, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_broadcast(tensor, root, group_size);
}

// ---------------------------------------------------------------------------------------------------
// Point-to-point

// Async batches: ticket -> the end events of its ops, joined by _p2p_wait on the caller's current stream.
class P2pTickets {
 public:
  static P2pTickets& get() {
    static P2pTickets* t = new P2pTickets();  // leaked: no CUDA calls during static destruction
    return *t;
  }
  int64_t add(std::vector<cudaEvent_t> events) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = ++next_;
    pending_[id] = std::move(events);
    return id;
  }
  std::vector<cudaEvent_t> take(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    TORCH_CHECK(it != pending_.end(), "ce_overlap._p2p_wait: no pending point-to-point batch #", id,
                " (already waited for, or never issued)");
    std::vector<cudaEvent_t> events = std::move(it->second);
    pending_.erase(it);
    return events;
  }

 private:
  std::mutex mu_;
  int64_t next_ = 0;
  std::unordered_map<int64_t, std::vector<cudaEvent_t>> pending_;
};

void check_p2p_args(at::TensorList send, c10::IntArrayRef send_peers, at::TensorList recv, c10::IntArrayRef recv_peers) {
  TORCH_CHECK(send.size() == send_peers.size(), "ce_overlap.batch_isend_irecv: ", send.size(), " send tensors but ",
              send_peers.size(), " send peers");
  TORCH_CHECK(recv.size() == recv_peers.size(), "ce_overlap.batch_isend_irecv: ", recv.size(), " recv tensors but ",
              recv_peers.size(), " recv peers");
  for (at::TensorList list : {send, recv}) {
    for (const at::Tensor& t : list) {
      TORCH_CHECK(t.defined() && t.layout() == c10::kStrided, "ce_overlap.batch_isend_irecv: every tensor must be a "
                  "defined strided tensor");
      TORCH_CHECK(t.is_contiguous(), "ce_overlap.batch_isend_irecv: tensors must be contiguous (got sizes ",
                  t.sym_sizes(), " and strides ", t.sym_strides(), "); call .contiguous() on it first");
    }
  }
}

int64_t batch_p2p_cuda(at::TensorList send, c10::IntArrayRef send_peers, at::TensorList recv,
                       c10::IntArrayRef recv_peers, std::string group_name, bool async_op) {
  check_p2p_args(send, send_peers, recv, recv_peers);
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "batch_isend_irecv");
  P2pBatchArgs args;
  std::vector<const at::Tensor*> tensors;
  for (bool is_send : {true, false}) {
    at::TensorList list = is_send ? send : recv;
    c10::IntArrayRef peers = is_send ? send_peers : recv_peers;
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& t = list[i];
      TORCH_CHECK(t.is_cuda() && t.device().index() == g->device(), "ce_overlap.batch_isend_irecv: a tensor is on ",
                  t.device(), " but group '", group_name, "' (rank ", g->rank(), ") lives on cuda:", g->device());
      args.ops.push_back(P2pOp{is_send, static_cast<int>(peers[i]), t.numel() ? t.data_ptr() : nullptr,
                               static_cast<size_t>(t.numel()) * t.element_size()});
      tensors.push_back(&t);
    }
  }
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g->device());
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  args.caller = caller.stream();
  if (async_op) {
    for (size_t i = 0; i < args.ops.size(); ++i) {
      cudaEvent_t e = nullptr;
      const cudaError_t st = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      if (st != cudaSuccess) {
        for (cudaEvent_t made : args.joins) cudaEventDestroy(made);
        TORCH_CHECK(false, "ce_overlap.batch_isend_irecv: cudaEventCreateWithFlags failed: ", cudaGetErrorString(st));
      }
      args.joins.push_back(e);
    }
  }
  try {
    enqueue_p2p_batch(*g, args);
  } catch (...) {
    for (cudaEvent_t e : args.joins) cudaEventDestroy(e);
    throw;
  }
  std::lock_guard<std::mutex> lock(g->mutex());  // p2p_stream: the channel streams exist now, but are the group's
  for (size_t i = 0; i < args.ops.size(); ++i) {
    if (args.ops[i].nbytes == 0) continue;
    record_streams(*g, *tensors[i], {g->p2p_stream(args.ops[i].peer, args.ops[i].send)});
  }
  return async_op ? P2pTickets::get().add(std::move(args.joins)) : 0;
}

int64_t batch_p2p_meta(at::TensorList send, c10::IntArrayRef send_peers, at::TensorList recv,
                       c10::IntArrayRef recv_peers, std::string group_name, bool async_op) {
  (void)group_name;
  (void)async_op;
  check_p2p_args(send, send_peers, recv, recv_peers);
  return 0;
}

// Makes the current stream wait for every op of async batch `ticket` (no host wait) and raises a watchdog failure.
void p2p_wait(int64_t ticket) {
  std::vector<cudaEvent_t> events = P2pTickets::get().take(ticket);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
  cudaError_t st = cudaSuccess;
  for (cudaEvent_t e : events) {
    if (st == cudaSuccess) st = cudaStreamWaitEvent(current.stream(), e, 0);
    cudaEventDestroy(e);  // deferred by CUDA until the work waiting on it has consumed it
  }
  TORCH_CHECK(st == cudaSuccess, "ce_overlap._p2p_wait: cudaStreamWaitEvent failed: ", cudaGetErrorString(st));
  if (std::optional<std::string> err = Runtime::get().first_failure()) {
    TORCH_CHECK(false, "ce_overlap.batch_isend_irecv: ", *err);
  }
}

int64_t p2p_round_bytes_op(std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "p2p_round_bytes");
  return static_cast<int64_t>(p2p_round_bytes(*g));
}

// Tensors that deferred ops hold until their wait (stash mode), and the mode ("stash" | "record_stream").
int64_t stashed_tensors() { return static_cast<int64_t>(DeferredJoins::get().stashed_tensors()); }

int64_t reaped_unwaited() { return DeferredJoins::reaped_total().load(); }

std::string keep_alive_mode_op() { return keep_alive_mode() == KeepAlive::Stash ? "stash" : "record_stream"; }

// The functional ops return before the caller's stream waits for them (DeferredJoins): this makes the current
// stream wait for the op that produced `tensor` (no host wait), and surfaces a watchdog failure (timeout) as
// an exception at the point the result is consumed. A tensor with no pending op passes through.
at::Tensor wait_tensor(const at::Tensor& tensor) {
  if (std::optional<std::string> err = Runtime::get().first_failure()) {
    TORCH_CHECK(false, "ce_overlap.wait_tensor: ", *err);
  }
  if (tensor.is_cuda() && tensor.has_storage()) {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(tensor.device().index());
    DeferredJoins::get().join(tensor.storage().data_ptr().get(), current.stream());
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

std::string set_ag_mode(std::string mode) {
  try {
    return set_all_gather_mode(mode);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap._set_all_gather_mode: ", e.what());
  }
}

// Tuning between ops (the probe sweeps these; values <= 0 leave a knob unchanged). pull_split and
// reduce_ctas are local to this rank; rs_round_bytes must be set to the same value on every rank before the
// next reduce-scatter (SPMD, like the op itself): it is part of every round's signature, so ranks that
// disagree get a "different collective" timeout, never wrong bytes. Returns the group's resulting
// "pull_split=.. reduce_ctas=.. rs_round_bytes=.." (rs_round_bytes as configured; the effective round is
// also capped by the staging slot, see _reduce_scatter_round_bytes).
std::string tune(std::string group_name, int64_t pull_split, int64_t reduce_ctas, int64_t rs_round_bytes) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "_tune");
  std::lock_guard<std::mutex> lk(g->mutex());  // between enqueues: no op sees half a change
  try {
    if (pull_split > 0) g->set_pull_split(static_cast<int>(std::min<int64_t>(pull_split, 1 << 20)));
    if (reduce_ctas > 0) g->set_reduce_ctas(static_cast<int>(std::min<int64_t>(reduce_ctas, 1 << 20)));
    if (rs_round_bytes > 0) g->set_rs_round_bytes(static_cast<size_t>(rs_round_bytes));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap._tune: ", e.what());
  }
  return "pull_split=" + std::to_string(g->pull_split()) + " reduce_ctas=" + std::to_string(g->reduce_ctas()) +
         " rs_round_bytes=" + std::to_string(g->rs_round_bytes());
}

// Probe: the reduce-scatter's reduction kernel alone, as the op runs it for 2 ranks: out = a + b (fp32
// accumulation; b stands for the one staging slot), at most `ctas` CTAs, on the current stream.
void reduce_bench(at::Tensor out, const at::Tensor& a, const at::Tensor& b, int64_t ctas) {
  static const char* kOp = "_reduce_bench";
  TORCH_CHECK(out.is_cuda() && a.is_cuda() && b.is_cuda() && out.device() == a.device() && a.device() == b.device(),
              "ce_overlap._reduce_bench: out, a and b must be on one CUDA device");
  TORCH_CHECK(out.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "ce_overlap._reduce_bench: out, a and b must be contiguous");
  TORCH_CHECK(out.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type() &&
                  out.numel() == a.numel() && a.numel() == b.numel(),
              "ce_overlap._reduce_bench: out, a and b must have one dtype and one size");
  TORCH_CHECK(ctas >= 1 && ctas <= 1024, "ce_overlap._reduce_bench: ctas must be in 1..1024, got ", ctas);
  const ReduceDType dt = reduce_dtype_of(a.scalar_type(), kOp);
  if (a.numel() == 0) return;
  c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  const size_t bytes = static_cast<size_t>(a.numel()) * a.element_size();
  ReduceParams p{out.data_ptr(), a.data_ptr(), b.data_ptr(), (bytes + 15) / 16 * 16, static_cast<size_t>(a.numel()),
                 2, 0, ReduceOp::Sum};
  const cudaError_t err = launch_reduce(dt, p, static_cast<int>(ctas), stream);
  TORCH_CHECK(err == cudaSuccess, "ce_overlap._reduce_bench: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

int64_t rs_round_bytes(std::string group_name) {
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "reduce_scatter_tensor");
  return static_cast<int64_t>(reduce_scatter_round_bytes(*g));
}

// Probe: one copy of src into dst (same GPU, same byte count) on the current stream, by `mode` (see
// local_copy_with in group.h). Raises when the CUDA call refuses (no fallback: the probe measures a mode).
void local_copy(at::Tensor dst, const at::Tensor& src, std::string mode) {
  TORCH_CHECK(dst.is_cuda() && src.is_cuda() && dst.device() == src.device(),
              "ce_overlap._local_copy: dst and src must be on one CUDA device, got ", dst.device(), " and ", src.device());
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "ce_overlap._local_copy: dst and src must be contiguous");
  const size_t nbytes = static_cast<size_t>(src.numel()) * src.element_size();
  TORCH_CHECK(static_cast<size_t>(dst.numel()) * dst.element_size() == nbytes, "ce_overlap._local_copy: dst has ",
              dst.numel() * dst.element_size(), " bytes, src ", nbytes);
  if (nbytes == 0) return;
  c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  TORCH_CHECK(!((mode == "batch" || mode == "batch_hint") && is_legacy_stream(stream)), "ce_overlap._local_copy(mode='",
              mode, "'): cudaMemcpyBatchAsync refuses the legacy default stream (torch's default stream); run it "
              "under torch.cuda.stream(side_stream)");
  cudaError_t err = cudaSuccess;
  try {
    err = local_copy_with(mode, dst.data_ptr(), src.data_ptr(), nbytes, src.device().index(), stream);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "ce_overlap._local_copy: ", e.what());
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "ce_overlap._local_copy(mode='", mode, "'): ", cudaGetErrorName(err), " (",
                cudaGetErrorString(err), ")");
  }
}

std::string local_copy_mode_op() { return local_copy_mode(); }

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
  // Several tensors as one collective (a bucket with no bucket buffer): output i / the chunks of input i are what
  // the one-tensor op gives for tensor i.
  m.def("all_gather_into_tensors(Tensor[] inputs, int group_size, str group_name) -> Tensor[]", pt2);
  m.def("reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor", pt2);
  m.def("reduce_scatter_tensors(Tensor[] inputs, str reduce_op, int group_size, str group_name) -> Tensor", pt2);
  m.def("reduce_scatter_tensors_unreduced(Tensor[] inputs, int group_size, str group_name) -> Tensor", pt2);
  m.def("reduce_scatter_tensor_out(Tensor input, str reduce_op, int group_size, str group_name, *, Tensor(a!) out) -> ()",
        pt2);
  // Hands back its input, and says so: the alias annotation keeps torch's custom-op aliasing check (an error
  // under CI, a deprecation warning elsewhere) quiet and tells Inductor's reinplacing that the result is the
  // collective's buffer, not a fresh one.
  m.def("all_to_all_single(Tensor input, int group_size, str group_name) -> Tensor", pt2);
  m.def("all_to_all_single_out(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> ()", pt2);
  m.def("broadcast_(Tensor(a!) tensor, int root, int group_size, str group_name) -> ()", pt2);
  m.def("wait_tensor(Tensor(a) tensor) -> Tensor(a)",
        torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(wait_tensor)), pt2);

  m.def("_batch_p2p(Tensor[] send, int[] send_peers, Tensor(a!)[] recv, int[] recv_peers, str group_name, "
        "bool async_op) -> int");
  m.def("_p2p_wait(int ticket) -> ()", &p2p_wait);
  m.def("_p2p_round_bytes(str group_name) -> int", &p2p_round_bytes_op);
  m.def("_pool_create(str group_name, int rank, int world_size, int device) -> Tensor", &pool_create);
  m.def("_pool_open(str group_name, Tensor handles) -> ()", &pool_open);
  m.def("_pool_abort(str group_name) -> ()", &pool_abort);
  m.def("_pool_blob_bytes() -> int", &pool_blob_bytes);
  m.def("_has_group(str group_name) -> bool", &has_group);
  m.def("_describe(str group_name) -> str", &describe_group);
  m.def("_synchronize(str group_name, float timeout_s) -> ()", &synchronize_group);
  m.def("_symmetric_free_ranges(str group_name, bool block) -> int[]", &symmetric_free_ranges);
  m.def("_empty_symmetric_at(int[] size, ScalarType dtype, str group_name, int offset) -> Tensor", &empty_symmetric_at);
  m.def("_pool_alignment() -> int", &pool_alignment);
  m.def("_set_all_gather_mode(str mode) -> str", &set_ag_mode);
  m.def("_reduce_scatter_round_bytes(str group_name) -> int", &rs_round_bytes);
  m.def("_tune(str group_name, int pull_split, int reduce_ctas, int rs_round_bytes) -> str", &tune);
  m.def("_reduce_bench(Tensor(a!) out, Tensor a, Tensor b, int ctas) -> ()", &reduce_bench);
  m.def("_local_copy_mode() -> str", &local_copy_mode_op);
  m.def("_local_copy(Tensor(a!) dst, Tensor src, str mode) -> ()", &local_copy);
  m.def("_symmetric_offset(Tensor tensor, str group_name) -> int", &symmetric_offset);
  m.def("_range_allocator_self_test(int seed, int steps) -> int", &range_allocator_self_test);
  m.def("_stashed_tensors() -> int", &stashed_tensors);
  m.def("_keep_alive_mode() -> str", &keep_alive_mode_op);
  m.def("_reaped_unwaited() -> int", &reaped_unwaited);
}

TORCH_LIBRARY_IMPL(ce_overlap, CUDA, m) {
  m.impl("all_gather_into_tensor", TORCH_FN(ce_overlap::all_gather_cuda));
  m.impl("all_gather_into_tensor_out", TORCH_FN(ce_overlap::all_gather_out_cuda));
  m.impl("all_gather_into_tensors", TORCH_FN(ce_overlap::all_gather_tensors_cuda));
  m.impl("reduce_scatter_tensors", TORCH_FN(ce_overlap::reduce_scatter_tensors_cuda));
  m.impl("reduce_scatter_tensors_unreduced", TORCH_FN(ce_overlap::reduce_scatter_tensors_unreduced_cuda));
  m.impl("reduce_scatter_tensor", TORCH_FN(ce_overlap::reduce_scatter_cuda));
  m.impl("reduce_scatter_tensor_out", TORCH_FN(ce_overlap::reduce_scatter_out_cuda));
  m.impl("all_to_all_single", TORCH_FN(ce_overlap::all_to_all_cuda));
  m.impl("all_to_all_single_out", TORCH_FN(ce_overlap::all_to_all_out_cuda));
  m.impl("broadcast_", TORCH_FN(ce_overlap::broadcast_cuda));
  m.impl("_batch_p2p", TORCH_FN(ce_overlap::batch_p2p_cuda));
}

TORCH_LIBRARY_IMPL(ce_overlap, Meta, m) {
  m.impl("all_gather_into_tensor", TORCH_FN(ce_overlap::all_gather_meta));
  m.impl("all_gather_into_tensor_out", TORCH_FN(ce_overlap::all_gather_out_meta));
  m.impl("all_gather_into_tensors", TORCH_FN(ce_overlap::all_gather_tensors_meta));
  m.impl("reduce_scatter_tensors", TORCH_FN(ce_overlap::reduce_scatter_tensors_meta));
  m.impl("reduce_scatter_tensors_unreduced", TORCH_FN(ce_overlap::reduce_scatter_tensors_unreduced_meta));
  m.impl("reduce_scatter_tensor", TORCH_FN(ce_overlap::reduce_scatter_meta));
  m.impl("reduce_scatter_tensor_out", TORCH_FN(ce_overlap::reduce_scatter_out_meta));
  m.impl("all_to_all_single", TORCH_FN(ce_overlap::all_to_all_meta));
  m.impl("all_to_all_single_out", TORCH_FN(ce_overlap::all_to_all_out_meta));
  m.impl("broadcast_", TORCH_FN(ce_overlap::broadcast_meta));
  m.impl("_batch_p2p", TORCH_FN(ce_overlap::batch_p2p_meta));
}
