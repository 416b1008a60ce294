// The torch.distributed backend "ce_overlap" (see c10d_backend.h).
//
// Semantics, as ProcessGroupNCCL's: an op is enqueued after the caller's current stream's work so far and returns a
// Work at once; Work::wait() makes the caller's current stream wait for the op (no host wait) and raises if the
// group failed; is_completed() polls the op's end events. A runtime timeout (a peer that never arrives) fails the
// group: every Work of it then reports the failure (is_success() false, exception() the watchdog's diagnosis, wait()
// raises), on every surviving rank, and later ops raise at once. Tensors are held by the Work until its wait (or,
// dropped unwaited, handed to the allocator with recordStream), like the functional ops' (torch_common.h).
//
// Whether a call runs on the copy engines depends only on what every rank passes alike (op, dtype, sizes, reduce op,
// splits) and on the group's rendezvous (agreed by all ranks when the backend was created), so all ranks of a
// collective take the same path.
#include "c10d_backend.h"

#include "torch_common.h"

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdio>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>

namespace ce_overlap {
namespace {

class CeWork final : public c10d::Work {
 public:
  CeWork(int rank, c10d::OpType type, std::shared_ptr<Group> group, std::vector<OpHandle> handles,
         std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type), group_(std::move(group)), handles_(std::move(handles)), outputs_(std::move(outputs)) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (group_->failed()) return true;
    for (const OpHandle& h : handles_) {
      if (!h.complete()) return false;
    }
    return true;
  }

  bool isSuccess() const override { return !group_->failed(); }

  std::exception_ptr exception() const override {
    return group_->failed() ? std::make_exception_ptr(std::runtime_error(group_->error())) : nullptr;
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  void synchronize() override { join_current_stream(); }

  bool wait(std::chrono::milliseconds timeout) override {
    (void)timeout;  // the runtime's watchdog bounds every op (RuntimeConfig.timeout_s)
    throw_if_failed();
    join_current_stream();
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    join_current_stream();
    const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(group_->device()));
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                           std::vector<c10::Device>{device});
    c10::cuda::CUDAGuard guard(device);
    future->markCompleted(c10::IValue(outputs_));  // records an event on the current stream, which now has the op
    return future;
  }

 private:
  void throw_if_failed() const {
    if (group_->failed()) throw std::runtime_error("ce_overlap backend: " + group_->error());
  }

  void join_current_stream() {
    std::lock_guard<std::mutex> lock(mu_);
    const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(group_->device());
    c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    for (OpHandle& h : handles_) h.join(stream);
  }

  std::shared_ptr<Group> group_;
  std::mutex mu_;
  std::vector<OpHandle> handles_;
  std::vector<at::Tensor> outputs_;
};

class CeBackend final : public c10d::Backend {
 public:
  CeBackend(int rank, int size, std::string group_name, int device, c10::intrusive_ptr<c10d::Backend> inner,
            std::string ce_unavailable)
      : c10d::Backend(rank, size),
        group_name_(std::move(group_name)),
        device_(device),
        inner_(std::move(inner)),
        ce_unavailable_(std::move(ce_unavailable)) {
    TORCH_CHECK(inner_, "ce_overlap backend: an inner backend is required");
    if (ce_unavailable_.empty()) {
      group_ = Runtime::get().find(group_name_);
      TORCH_CHECK(group_ && group_->world_size() == size && group_->rank() == rank, "ce_overlap backend: group '",
                  group_name_, "' has no CE pool of ", size, " ranks with this rank as ", rank,
                  " (rendezvous first)");
    }
  }

  const std::string getBackendName() const override { return "ce_overlap"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    std::string why = single(tensors);
    if (why.empty() && (opts.rootRank < 0 || opts.rootRank >= getSize())) why = "root rank out of range";
    if (!why.empty()) return delegate("broadcast", why, [&] { return inner_->broadcast(tensors, opts); });
    return ce("broadcast", c10d::OpType::BROADCAST, tensors,
              [&] { return one(run_broadcast(*group_, tensors[0], static_cast<int>(opts.rootRank), Join::Handle)); });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    std::string why = usable({in, out});
    if (why.empty() && (out.scalar_type() != in.scalar_type() || out.numel() != in.numel() * getSize())) {
      why = "output is not world_size x input of the input's dtype";
    }
    if (!why.empty()) return delegate("all_gather_into_tensor", why, [&] { return inner_->_allgather_base(out, in, opts); });
    return ce("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {out},
              [&] { return one(run_all_gather(*group_, in, out, Join::Handle)); });
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                 std::vector<at::Tensor>& ins,
                                                                 const c10d::AllgatherOptions& opts) override {
    std::string why = outs.size() == ins.size() && !ins.empty() ? "" : "unmatched inputs and outputs";
    for (size_t i = 0; why.empty() && i < ins.size(); ++i) {
      why = usable({ins[i], outs[i]});
      if (why.empty() && (outs[i].scalar_type() != ins[i].scalar_type() || outs[i].numel() != ins[i].numel() * getSize())) {
        why = "an output is not world_size x its input";
      }
    }
    if (!why.empty()) {
      return delegate("all_gather_into_tensor_coalesced", why,
                      [&] { return inner_->allgather_into_tensor_coalesced(outs, ins, opts); });
    }
    return ce("all_gather_into_tensor_coalesced", c10d::OpType::COALESCED, outs,
              [&] { return one(run_all_gather_parts(*group_, ins, outs, Join::Handle)); });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& opts) override {
    std::string why = usable({in, out});
    if (why.empty()) why = reducible(in, opts.reduceOp);
    if (why.empty() && (out.scalar_type() != in.scalar_type() || out.numel() * getSize() != in.numel())) {
      why = "output is not input / world_size of the input's dtype";
    }
    if (!why.empty()) {
      return delegate("reduce_scatter_tensor", why, [&] { return inner_->_reduce_scatter_base(out, in, opts); });
    }
    // Chunk r of the input is its r-th 1 / world_size in flat order, as in c10d's reduce_scatter_tensor.
    const std::string op = opts.reduceOp == c10d::ReduceOp::AVG ? "avg" : "sum";
    return ce("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {out}, [&] {
      return one(run_reduce_scatter(*group_, in, out, op, "reduce_scatter_tensor", Join::Handle));
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                 std::vector<at::Tensor>& ins,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    std::string why = outs.size() == ins.size() && !ins.empty() ? "" : "unmatched inputs and outputs";
    for (size_t i = 0; why.empty() && i < ins.size(); ++i) {
      why = usable({ins[i], outs[i]});
      if (why.empty()) why = reducible(ins[i], opts.reduceOp);
      if (why.empty() && (outs[i].scalar_type() != ins[i].scalar_type() || outs[i].numel() * getSize() != ins[i].numel())) {
        why = "an output is not its input / world_size";
      }
    }
    if (!why.empty()) {
      return delegate("reduce_scatter_tensor_coalesced", why,
                      [&] { return inner_->reduce_scatter_tensor_coalesced(outs, ins, opts); });
    }
    const std::string op = opts.reduceOp == c10d::ReduceOp::AVG ? "avg" : "sum";
    return ce("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, outs, [&] {
      std::vector<OpHandle> handles;
      for (size_t i = 0; i < ins.size(); ++i) {
        handles.push_back(run_reduce_scatter(*group_, ins[i], outs[i], op, "reduce_scatter_tensor_coalesced",
                                             Join::Handle));
      }
      return handles;
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    std::string why = usable({in, out});
    if (why.empty() && (in.dim() == 0 || out.dim() == 0 || in.size(0) % getSize() != 0 ||
                        out.size(0) % getSize() != 0 || out.numel() != in.numel() ||
                        out.scalar_type() != in.scalar_type())) {
      why = "input and output are not world_size equal chunks of one dtype";
    }
    if (why.empty() && !(equal_splits(out_splits, out) && equal_splits(in_splits, in))) why = "uneven splits";
    if (!why.empty()) {
      return delegate("all_to_all_single", why,
                      [&] { return inner_->alltoall_base(out, in, out_splits, in_splits, opts); });
    }
    return ce("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {out}, [&] {
      return one(run_all_to_all(*group_, in, out, "all_to_all_single", Join::Handle));
    });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    std::string why = single(tensors);
    if (why.empty() && (dst < 0 || dst >= getSize() || dst == getRank())) why = "the peer is this rank or not in the group";
    if (!why.empty()) return delegate("send", why, [&] { return inner_->send(tensors, dst, tag); });
    return ce("send", c10d::OpType::SEND, {}, [&] {
      return one(run_p2p(*group_, tensors, {dst}, {}, {}, Join::Handle));
    });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    std::string why = single(tensors);
    if (why.empty() && (src < 0 || src >= getSize() || src == getRank())) why = "the peer is this rank or not in the group";
    if (!why.empty()) return delegate("recv", why, [&] { return inner_->recv(tensors, src, tag); });
    return ce("recv", c10d::OpType::RECV, tensors, [&] {
      return one(run_p2p(*group_, {}, {}, tensors, {src}, Join::Handle));
    });
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    if (group_) {
      TORCH_CHECK(false, "ce_overlap backend (group '", group_name_, "'): recv from any source is not supported: the "
                  "sends of this group run on copy engines and match their receives by peer; name the source rank");
    }
    return delegate("recv_anysource", ce_unavailable_, [&] { return inner_->recvAnysource(tensors, tag); });
  }

  // Everything the runtime has no copy-engine form of.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return delegate("all_reduce", "no copy-engine all-reduce", [&] { return inner_->allreduce(t, o); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    return delegate("all_reduce_coalesced", "no copy-engine all-reduce", [&] { return inner_->allreduce_coalesced(t, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return delegate("reduce", "no copy-engine reduce", [&] { return inner_->reduce(t, o); });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                           const c10d::AllgatherOptions& o) override {
    return delegate("all_gather", "the list form (use all_gather_into_tensor)", [&] { return inner_->allgather(outs, ins, o); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                                     std::vector<at::Tensor>& ins, const c10d::AllgatherOptions& o) override {
    return delegate("all_gather_coalesced", "the list form", [&] { return inner_->allgather_coalesced(outs, ins, o); });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                        const c10d::GatherOptions& o) override {
    return delegate("gather", "no copy-engine gather", [&] { return inner_->gather(outs, ins, o); });
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                         const c10d::ScatterOptions& o) override {
    return delegate("scatter", "no copy-engine scatter", [&] { return inner_->scatter(outs, ins, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                                const c10d::ReduceScatterOptions& o) override {
    return delegate("reduce_scatter", "the list form (use reduce_scatter_tensor)",
                    [&] { return inner_->reduce_scatter(outs, ins, o); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                          const c10d::AllToAllOptions& o) override {
    return delegate("all_to_all", "the list form (use all_to_all_single)", [&] { return inner_->alltoall(outs, ins, o); });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    return delegate("barrier", "barriers run on the inner backend", [&] { return inner_->barrier(o); });
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    inner_->monitoredBarrier(o, wait_all_ranks);
  }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void abort() override { inner_->abort(); }

  void shutdown() override {
    inner_->shutdown();
    if (group_) {
      try {
        group_->synchronize(group_->timeout_s() + 30);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ce_overlap backend: shutting down group '%s': %s\n", group_name_.c_str(), e.what());
      }
      Runtime::get().remove(group_name_);  // the name may be reused by a later process group
      group_.reset();
    }
  }

  std::map<std::string, int64_t> counts() {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }
  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }

 private:
  static std::vector<OpHandle> one(OpHandle h) {
    std::vector<OpHandle> v;
    v.push_back(std::move(h));
    return v;
  }

  // Why these tensors cannot go to the runtime ("" when they can).
  std::string usable(std::initializer_list<at::Tensor> tensors) const {
    if (!group_) return "copy engines unavailable for this group: " + ce_unavailable_;
    for (const at::Tensor& t : tensors) {
      if (!t.defined() || t.layout() != c10::kStrided) return "a tensor that is not dense";
      if (!t.is_cuda()) return "a tensor on " + t.device().str();
      if (t.device().index() != device_) {
        return "a tensor on " + t.device().str() + " while the group lives on cuda:" + std::to_string(device_);
      }
      if (!t.is_contiguous()) return "a non-contiguous tensor";
    }
    return "";
  }

  std::string single(const std::vector<at::Tensor>& tensors) const {
    if (tensors.size() != 1) return "a list of " + std::to_string(tensors.size()) + " tensors";
    return usable({tensors[0]});
  }

  static std::string reducible(const at::Tensor& in, c10d::ReduceOp op) {
    if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG) return "a reduce op other than sum and avg";
    const auto t = in.scalar_type();
    if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) {
      return std::string("dtype ") + c10::toString(t) + " (the reduction kernel takes float32, float16, bfloat16)";
    }
    return "";
  }

  bool equal_splits(const std::vector<int64_t>& splits, const at::Tensor& t) const {
    if (splits.empty()) return true;
    if (static_cast<int>(splits.size()) != getSize() || t.dim() == 0) return false;
    for (int64_t s : splits) {
      if (s != t.size(0) / getSize() || t.size(0) % getSize() != 0) return false;
    }
    return true;
  }

  template <typename Run>
  c10::intrusive_ptr<c10d::Work> ce(const char* op, c10d::OpType type, std::vector<at::Tensor> outputs, Run&& run) {
    count(op, "ce");
    std::vector<OpHandle> handles = run();
    return c10::make_intrusive<CeWork>(getRank(), type, group_, std::move(handles), std::move(outputs));
  }

  template <typename Call>
  c10::intrusive_ptr<c10d::Work> delegate(const char* op, const std::string& why, Call&& call) {
    count(op, "inner");
    const std::string message = std::string(op) + " runs on the inner backend (" + inner_->getBackendName() + "): " + why;
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = logged_.insert(message).second;
    }
    if (first) std::fprintf(stderr, "ce_overlap backend (group '%s'): %s\n", group_name_.c_str(), message.c_str());
    return call();
  }

  void count(const char* op, const char* where) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[std::string(op) + ":" + where];
  }

  std::string group_name_;
  int device_;
  c10::intrusive_ptr<c10d::Backend> inner_;
  std::string ce_unavailable_;
  std::shared_ptr<Group> group_;
  std::mutex mu_;
  std::set<std::string> logged_;
  std::map<std::string, int64_t> counts_;
};

CeBackend& as_ce(const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto* ce = dynamic_cast<CeBackend*>(backend.get());
  TORCH_CHECK(ce != nullptr, "not a ce_overlap backend: ", backend ? backend->getBackendName() : "null");
  return *ce;
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_c10d_backend(int rank, int size, const std::string& group_name, int device,
                                                    c10::intrusive_ptr<c10d::Backend> inner,
                                                    const std::string& ce_unavailable) {
  return c10::make_intrusive<CeBackend>(rank, size, group_name, device, std::move(inner), ce_unavailable);
}

std::map<std::string, int64_t> c10d_backend_counts(const c10::intrusive_ptr<c10d::Backend>& backend) {
  return as_ce(backend).counts();
}

c10::intrusive_ptr<c10d::Backend> c10d_backend_inner(const c10::intrusive_ptr<c10d::Backend>& backend) {
  return as_ce(backend).inner();
}

}  // namespace ce_overlap
