// The torch-facing layer shared by the ops and the c10d backend (see torch_common.h).
#include "torch_common.h"

#include <ATen/ops/empty.h>
#include <c10/core/SymBool.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cctype>
#include <sstream>
#include <utility>

namespace ce_overlap {

// ---------------------------------------------------------------------------------------------------
// Checks

std::string shape_text(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

// Checks shared by the CUDA and the Meta kernels, so tracing fails with the same message as eager.
void check_input(const at::Tensor& input, int64_t group_size, const char* op, bool scatter) {
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


template <typename CheckOne>
void check_parts(at::TensorList inputs, const char* op, CheckOne&& check_one) {
  TORCH_CHECK(!inputs.empty(), "ce_overlap.", op, ": needs at least one input tensor");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_one(i, inputs[i]);
    TORCH_CHECK(inputs[i].device() == inputs[0].device(), "ce_overlap.", op, ": inputs[", i, "] is on ",
                inputs[i].device(), " but inputs[0] is on ", inputs[0].device());
  }
}

void check_ag_parts(at::TensorList inputs, int64_t group_size, const char* op) {
  check_parts(inputs, op, [&](size_t, const at::Tensor& t) { check_input(t, group_size, op); });
}

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

void check_rs_parts(at::TensorList inputs, const std::string& reduce_op, int64_t group_size, const char* op) {
  check_parts(inputs, op, [&](size_t i, const at::Tensor& t) {
    check_rs_input(t, reduce_op, group_size, op);
    TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), "ce_overlap.", op, ": inputs[", i, "] has dtype ",
                t.scalar_type(), " but inputs[0] has ", inputs[0].scalar_type(), " (one op reduces one dtype)");
  });
}

void check_unreduced_parts(at::TensorList inputs, int64_t group_size, const char* op) {
  check_parts(inputs, op, [&](size_t i, const at::Tensor& t) {
    check_input(t, group_size, op, /*scatter=*/true);
    TORCH_SYM_CHECK((t.sym_size(0) % group_size).sym_eq(0), "ce_overlap.", op, ": inputs[", i, "].shape[0] = ",
                    t.sym_size(0), " is not divisible by group_size = ", group_size);
    TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), "ce_overlap.", op, ": inputs[", i, "] has dtype ",
                t.scalar_type(), " but inputs[0] has ", inputs[0].scalar_type(), " (one op moves one dtype)");
  });
}

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

void check_broadcast(const at::Tensor& tensor, int64_t root, int64_t group_size) {
  TORCH_CHECK(tensor.defined() && tensor.layout() == c10::kStrided, "ce_overlap.broadcast_: tensor must be a defined "
              "strided tensor");
  TORCH_CHECK(tensor.is_contiguous(), "ce_overlap.broadcast_: tensor must be contiguous (got sizes ", tensor.sym_sizes(),
              " and strides ", tensor.sym_strides(), ")");
  TORCH_CHECK(group_size >= 1, "ce_overlap.broadcast_: group_size must be >= 1, got ", group_size);
  TORCH_CHECK(root >= 0 && root < group_size, "ce_overlap.broadcast_: root ", root, " is not a rank of a group of ",
              group_size);
}

void check_p2p_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined() && t.layout() == c10::kStrided, "ce_overlap.", op, ": every tensor must be a defined "
              "strided tensor");
  TORCH_CHECK(t.is_contiguous(), "ce_overlap.", op, ": tensors must be contiguous (got sizes ", t.sym_sizes(),
              " and strides ", t.sym_strides(), "); call .contiguous() on it first");
}

// ---------------------------------------------------------------------------------------------------
// Lifetimes

namespace {
std::atomic<int> g_keep_alive{static_cast<int>(KeepAlive::Stash)};
}  // namespace

KeepAlive keep_alive_mode() { return static_cast<KeepAlive>(g_keep_alive.load()); }

void set_keep_alive_mode(KeepAlive mode) { g_keep_alive.store(static_cast<int>(mode)); }

void record_streams(Group& g, const at::Tensor& t, const std::vector<cudaStream_t>& streams) {
  if (t.numel() == 0 || g.pool().contains(t.data_ptr())) return;
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(g.device());
  for (cudaStream_t s : streams) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getStreamFromExternal(s, device));
  }
}

bool Stash::unreachable() const {
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

void Stash::drop_unjoined() {
  for (const c10::Storage& st : record_on_drop) {
    for (cudaStream_t s : streams) {
      c10::cuda::CUDACachingAllocator::recordStream(st.data_ptr(), c10::cuda::getStreamFromExternal(s, device));
    }
  }
  inputs.clear();
  outputs.clear();
  record_on_drop.clear();
}

Stash Stash::take() {
  Stash out;
  std::swap(out.inputs, inputs);
  std::swap(out.outputs, outputs);
  std::swap(out.record_on_drop, record_on_drop);
  out.streams = streams;
  out.device = device;
  return out;
}

OpHandle::~OpHandle() { release(); }

OpHandle::OpHandle(OpHandle&& other) noexcept
    : device_(other.device_), events_(std::move(other.events_)), stash_(std::move(other.stash_)) {
  other.events_.clear();
}

OpHandle& OpHandle::operator=(OpHandle&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    events_ = std::move(other.events_);
    stash_ = std::move(other.stash_);
    other.events_.clear();
  }
  return *this;
}

void OpHandle::join(cudaStream_t stream) {
  cudaError_t st = cudaSuccess;
  for (cudaEvent_t e : events_) {
    if (st == cudaSuccess) st = cudaStreamWaitEvent(stream, e, 0);
  }
  TORCH_CHECK(st == cudaSuccess, "ce_overlap: joining a collective: cudaStreamWaitEvent failed: ", cudaGetErrorString(st));
  if (stash_) {
    Stash dropped = stash_->take();  // freed in `stream`'s order, which now waits for the op
    stash_.reset();
  }
}

bool OpHandle::complete() const {
  for (cudaEvent_t e : events_) {
    const cudaError_t st = cudaEventQuery(e);
    if (st == cudaErrorNotReady) return false;
    if (st != cudaSuccess) (void)cudaGetLastError();  // a broken event counts as done; the group reports the error
  }
  return true;
}

void OpHandle::release() {
  if (stash_) {
    stash_->drop_unjoined();
    stash_.reset();
  }
  for (cudaEvent_t e : events_) cudaEventDestroy(e);  // deferred by CUDA until the recorded work completed
  events_.clear();
}

DeferredJoins& DeferredJoins::get() {
  static DeferredJoins* joins = new DeferredJoins();  // leaked: no CUDA calls during static destruction
  return *joins;
}

cudaEvent_t DeferredJoins::take(int device) {
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

void DeferredJoins::give_back(int device, cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  free_[device].push_back(e);
}

// Registers the op's event and stash under each of its outputs' storages (several for a multi-output op: the event
// goes back to the free list once every one of them was waited for or replaced).
void DeferredJoins::add(const std::vector<const void*>& storages, int device, cudaEvent_t e,
                        std::shared_ptr<Stash> stash) {
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
  // Outside the lock: frees go to the allocator.
  reaped_total().fetch_add(static_cast<int64_t>(reaped.size()));
  for (const std::shared_ptr<Stash>& s : reaped) s->drop_unjoined();
}

bool DeferredJoins::join(const void* storage, cudaStream_t stream) {
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
    // The first wait ends the op for this stream; the other outputs' entries keep only the event.
    if (st == cudaSuccess && entry.stash) dropped = entry.stash->take();
  }
  TORCH_CHECK(st == cudaSuccess, "ce_overlap.wait_tensor: cudaStreamWaitEvent failed: ", cudaGetErrorString(st));
  return true;
}

std::atomic<int64_t>& DeferredJoins::reaped_total() {
  static std::atomic<int64_t> n{0};
  return n;
}

size_t DeferredJoins::stashed_tensors() {
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

// One reference of `entry`'s event is gone; the last one frees it (cudaStreamWaitEvent snapshots the event, so it
// may be recorded again by a later op).
void DeferredJoins::release_locked(const Entry& entry) {
  auto it = refs_.find(entry.event);
  if (it == refs_.end() || --it->second > 0) return;
  refs_.erase(it);
  free_[entry.device].push_back(entry.event);
}

// An op's outputs share one stash: each stash is judged once per call, however many entries it has.
void DeferredJoins::reap_unreachable_locked(std::vector<std::shared_ptr<Stash>>& reaped) {
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

// ---------------------------------------------------------------------------------------------------
// The collectives on tensors

namespace {

std::shared_ptr<Stash> make_stash(Group& g, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outs,
                                  std::vector<cudaStream_t> streams) {
  auto stash = std::make_shared<Stash>();
  stash->device = static_cast<c10::DeviceIndex>(g.device());
  stash->inputs = inputs;
  for (const at::Tensor& out : outs) stash->outputs.push_back(out.storage());
  stash->streams = std::move(streams);
  for (const auto* list : {&inputs, &outs}) {
    for (const at::Tensor& t : *list) {
      if (t.numel() != 0 && !g.pool().contains(t.data_ptr())) stash->record_on_drop.push_back(t.storage());
    }
  }
  return stash;
}

std::vector<cudaEvent_t> fresh_events(size_t n) {
  std::vector<cudaEvent_t> events;
  for (size_t i = 0; i < n; ++i) {
    cudaEvent_t e = nullptr;
    const cudaError_t st = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (st != cudaSuccess) {
      for (cudaEvent_t made : events) cudaEventDestroy(made);
      TORCH_CHECK(false, "ce_overlap: cudaEventCreateWithFlags failed: ", cudaGetErrorString(st));
    }
    events.push_back(e);
  }
  return events;
}

// Enqueues an op that reads `inputs` and writes `outs` on `streams` after it returns, joined as `join` says:
// enqueue(events) gets no event (Join::Now: the op makes the caller wait) or `n_events` events to record the op's
// end(s) into, and the tensors are kept alive until the join (see KeepAlive).
template <typename Enqueue>
OpHandle enqueue_keeping_alive(Group& g, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outs,
                               std::vector<cudaStream_t> streams, Join join, size_t n_events, Enqueue&& enqueue) {
  const bool record = keep_alive_mode() == KeepAlive::RecordStream;
  auto record_all = [&] {
    for (const auto* list : {&inputs, &outs}) {
      for (const at::Tensor& t : *list) record_streams(g, t, streams);
    }
  };
  if (join == Join::Now) {
    enqueue(std::vector<cudaEvent_t>{});
    if (record) record_all();
    return OpHandle();
  }
  if (join == Join::Handle) {
    std::vector<cudaEvent_t> events = fresh_events(n_events);
    try {
      enqueue(events);
    } catch (...) {
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      throw;
    }
    if (record) record_all();
    return OpHandle(g.device(), std::move(events), record ? nullptr : make_stash(g, inputs, outs, std::move(streams)));
  }
  DeferredJoins& joins = DeferredJoins::get();
  cudaEvent_t e = joins.take(g.device());
  try {
    enqueue(std::vector<cudaEvent_t>{e});
  } catch (...) {
    joins.give_back(g.device(), e);
    throw;
  }
  std::shared_ptr<Stash> stash;
  if (record) {
    record_all();
  } else {
    stash = make_stash(g, inputs, outs, std::move(streams));
  }
  std::vector<const void*> storages;
  for (const at::Tensor& out : outs) {
    const void* storage = out.storage().data_ptr().get();
    if (std::find(storages.begin(), storages.end(), storage) == storages.end()) storages.push_back(storage);
  }
  joins.add(storages, g.device(), e, std::move(stash));
  return OpHandle();
}

cudaEvent_t first_or_null(const std::vector<cudaEvent_t>& events) { return events.empty() ? nullptr : events[0]; }

cudaStream_t caller_stream(Group& g) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(g.device())).stream();
}

}  // namespace

OpHandle run_all_gather(Group& g, const at::Tensor& input, const at::Tensor& out, Join join) {
  const size_t nbytes = static_cast<size_t>(input.numel()) * input.element_size();
  if (nbytes == 0) return OpHandle();
  const char* in = static_cast<const char*>(input.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const size_t out_bytes = nbytes * static_cast<size_t>(g.world_size());
  const bool in_place = in == o + static_cast<size_t>(g.rank()) * nbytes;
  TORCH_CHECK(in_place || in + nbytes <= o || o + out_bytes <= in, "ce_overlap.all_gather_into_tensor: input overlaps "
              "out but is not out's shard of rank ", g.rank(), " (the only overlap an in-place all-gather allows)");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  const cudaStream_t caller = caller_stream(g);
  // The comm and self streams read `input` and write `out` after this call returns (pool tensors' frees are
  // deferred by the pool itself).
  return enqueue_keeping_alive(g, {input}, {out}, {g.comm_stream(), g.self_stream()}, join, 1,
                               [&](const std::vector<cudaEvent_t>& ev) {
                                 enqueue_all_gather(g, AllGatherArgs{{AllGatherPart{in, o, nbytes}}, caller,
                                                                     first_or_null(ev)});
                               });
}

OpHandle run_all_gather_parts(Group& g, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outs,
                              Join join) {
  AllGatherArgs args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    args.parts.push_back(AllGatherPart{inputs[i].data_ptr(), outs[i].data_ptr(),
                                       static_cast<size_t>(inputs[i].numel()) * inputs[i].element_size()});
  }
  if (args.nbytes() == 0) return OpHandle();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  args.caller = caller_stream(g);
  return enqueue_keeping_alive(g, inputs, outs, {g.comm_stream(), g.self_stream()}, join, 1,
                               [&](const std::vector<cudaEvent_t>& ev) {
                                 args.join = first_or_null(ev);
                                 enqueue_all_gather(g, args);
                               });
}

OpHandle run_reduce_scatter(Group& g, const at::Tensor& input, const at::Tensor& out, const std::string& reduce_op,
                            const char* op, Join join) {
  const size_t n = static_cast<size_t>(g.world_size());
  const size_t chunk = static_cast<size_t>(input.numel()) * input.element_size() / n;
  if (chunk == 0) return OpHandle();
  const char* in = static_cast<const char*>(input.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const bool in_place = o == in + static_cast<size_t>(g.rank()) * chunk;
  TORCH_CHECK(in_place || in + n * chunk <= o || o + chunk <= in, "ce_overlap.", op, ": out overlaps input but is not "
              "input's chunk of rank ", g.rank(), " (the only overlap an in-place reduce-scatter allows)");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  const cudaStream_t caller = caller_stream(g);
  const ReduceDType dtype = reduce_dtype_of(input.scalar_type(), op);
  const ReduceOp rop = reduce_op_of(reduce_op, op);
  // The comm stream reads the input, the reduce stream reads it and writes out after this returns.
  return enqueue_keeping_alive(g, {input}, {out}, {g.comm_stream(), g.reduce_stream()}, join, 1,
                               [&](const std::vector<cudaEvent_t>& ev) {
                                 enqueue_reduce_scatter(g, ReduceScatterArgs{{ReduceScatterPart{in, chunk}}, o, dtype,
                                                                             rop, caller, first_or_null(ev)});
                               });
}

OpHandle run_reduce_scatter_parts(Group& g, const std::vector<at::Tensor>& inputs, const at::Tensor& out,
                                  ReduceScatterArgs args, Join join) {
  const int64_t n = g.world_size();
  for (const at::Tensor& input : inputs) {
    args.parts.push_back(ReduceScatterPart{input.data_ptr(), static_cast<size_t>(input.numel() / n) * input.element_size()});
  }
  if (out.numel() == 0) return OpHandle();  // nothing to move, or no peers
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  args.output = out.data_ptr();
  args.caller = caller_stream(g);
  // The comm stream reads the inputs (pushes), the reduce stream writes out (the reduction, or the copy-out).
  return enqueue_keeping_alive(g, inputs, {out}, {g.comm_stream(), g.reduce_stream()}, join, 1,
                               [&](const std::vector<cudaEvent_t>& ev) {
                                 args.join = first_or_null(ev);
                                 enqueue_reduce_scatter(g, args);
                               });
}

OpHandle run_all_to_all(Group& g, const at::Tensor& input, const at::Tensor& out, const char* op, Join join) {
  const size_t n = static_cast<size_t>(g.world_size());
  const size_t chunk = static_cast<size_t>(input.numel()) * input.element_size() / n;
  if (chunk == 0) return OpHandle();
  const char* in = static_cast<const char*>(input.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  TORCH_CHECK(in + n * chunk <= o || o + n * chunk <= in, "ce_overlap.", op, ": out overlaps input (an all-to-all "
              "cannot run in place: every rank reads its peers' inputs while they write their outputs)");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  const cudaStream_t caller = caller_stream(g);
  return enqueue_keeping_alive(g, {input}, {out}, {g.comm_stream(), g.self_stream()}, join, 1,
                               [&](const std::vector<cudaEvent_t>& ev) {
                                 enqueue_all_to_all(g, AllToAllArgs{in, o, chunk, caller, first_or_null(ev)});
                               });
}

OpHandle run_broadcast(Group& g, const at::Tensor& tensor, int root, Join join) {
  const size_t nbytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (nbytes == 0) return OpHandle();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  const cudaStream_t caller = caller_stream(g);
  // The caller's stream joins the op before this returns.
  enqueue_keeping_alive(g, {tensor}, {}, {g.comm_stream()}, Join::Now, 0, [&](const std::vector<cudaEvent_t>&) {
    enqueue_broadcast(g, BroadcastArgs{tensor.data_ptr(), nbytes, root, caller});
  });
  if (join != Join::Handle) return OpHandle();
  std::vector<cudaEvent_t> events = fresh_events(1);
  const cudaError_t st = cudaEventRecord(events[0], caller);
  if (st != cudaSuccess) {
    cudaEventDestroy(events[0]);
    TORCH_CHECK(false, "ce_overlap.broadcast: cudaEventRecord failed: ", cudaGetErrorString(st));
  }
  return OpHandle(g.device(), std::move(events), nullptr);
}

OpHandle run_p2p(Group& g, const std::vector<at::Tensor>& sends, const std::vector<int>& send_peers,
                 const std::vector<at::Tensor>& recvs, const std::vector<int>& recv_peers, Join join) {
  TORCH_CHECK(join != Join::Functional, "ce_overlap: point-to-point ops have no functional form");
  P2pBatchArgs args;
  std::vector<const at::Tensor*> tensors;
  for (bool is_send : {true, false}) {
    const std::vector<at::Tensor>& list = is_send ? sends : recvs;
    const std::vector<int>& peers = is_send ? send_peers : recv_peers;
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& t = list[i];
      TORCH_CHECK(t.is_cuda() && t.device().index() == g.device(), "ce_overlap.batch_isend_irecv: a tensor is on ",
                  t.device(), " but group '", g.name(), "' (rank ", g.rank(), ") lives on cuda:", g.device());
      args.ops.push_back(P2pOp{is_send, peers[i], t.numel() ? t.data_ptr() : nullptr,
                               static_cast<size_t>(t.numel()) * t.element_size()});
      tensors.push_back(&t);
    }
  }
  if (args.ops.empty()) return OpHandle();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g.device()));
  args.caller = caller_stream(g);
  if (join == Join::Handle) args.joins = fresh_events(args.ops.size());
  try {
    enqueue_p2p_batch(g, args);
  } catch (...) {
    for (cudaEvent_t e : args.joins) cudaEventDestroy(e);
    throw;
  }
  std::vector<cudaStream_t> streams;
  {
    std::lock_guard<std::mutex> lock(g.mutex());  // p2p_stream: the channel streams exist now, but are the group's
    for (const P2pOp& op : args.ops) {
      if (op.nbytes != 0) streams.push_back(g.p2p_stream(op.peer, op.send));
    }
  }
  if (join == Join::Now || keep_alive_mode() == KeepAlive::RecordStream) {
    size_t s = 0;
    for (size_t i = 0; i < args.ops.size(); ++i) {
      if (args.ops[i].nbytes != 0) record_streams(g, *tensors[i], {streams[s++]});
    }
    return join == Join::Now ? OpHandle() : OpHandle(g.device(), std::move(args.joins), nullptr);
  }
  return OpHandle(g.device(), std::move(args.joins), make_stash(g, sends, recvs, std::move(streams)));
}

}  // namespace ce_overlap
