// What the torch-facing translation units share (ops_*.cc, c10d_backend.cc): argument checks (the CUDA and the
// Meta kernels run the same ones, so tracing fails with the same message as eager), the group lookup, how a
// collective's tensors are kept from the caching allocator while its streams use them, and one `run_*` function per
// collective that enqueues it on at::Tensors and says how the caller joins it. Only these files see torch headers.
#pragma once

#include "all_gather.h"
#include "all_to_all.h"
#include "group.h"
#include "p2p.h"
#include "reduce_scatter.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ce_overlap {

// ---------------------------------------------------------------------------------------------------
// Checks

std::string shape_text(c10::IntArrayRef sizes);
void check_input(const at::Tensor& input, int64_t group_size, const char* op, bool scatter = false);
// What every `out` argument must share with the input: defined, same dtype and device, contiguous.
void check_out_like_input(const at::Tensor& input, const at::Tensor& out, const char* op);
void check_out(const at::Tensor& input, const at::Tensor& out, int64_t group_size, const char* op);
// The group of `group_name` (rendezvoused), which must have group_size ranks and live on input's device.
std::shared_ptr<Group> group_for(const std::string& group_name, int64_t group_size, const at::Tensor& input,
                                 const char* op);
ReduceDType reduce_dtype_of(c10::ScalarType t, const char* op);
ReduceOp reduce_op_of(const std::string& name, const char* op);
void check_rs_input(const at::Tensor& input, const std::string& reduce_op, int64_t group_size, const char* op);
void check_rs_out(const at::Tensor& input, const at::Tensor& out, int64_t group_size, const char* op);
// The inputs of a multi-tensor op: at least one, each passing the one-tensor op's checks, all on one device (and,
// for the reduce-scatters, of one dtype).
void check_ag_parts(at::TensorList inputs, int64_t group_size, const char* op);
void check_rs_parts(at::TensorList inputs, const std::string& reduce_op, int64_t group_size, const char* op);
void check_unreduced_parts(at::TensorList inputs, int64_t group_size, const char* op);
void check_a2a_input(const at::Tensor& input, int64_t group_size, const char* op);
void check_a2a_out(const at::Tensor& input, const at::Tensor& out, const char* op);
void check_broadcast(const at::Tensor& tensor, int64_t root, int64_t group_size);
void check_p2p_tensor(const at::Tensor& t, const char* op);

// ---------------------------------------------------------------------------------------------------
// Lifetimes: how a tensor that a collective's streams use after the op returns is kept from the caching allocator.
//   stash (default): an op the caller joins later (functional ops at wait_tensor, a c10d Work at wait()) holds its
//     inputs and outputs until that join has made the waiting stream wait for the op's end; then it drops them, so
//     their blocks go back to the allocator in that stream's order, like any tensor the stream used. An op whose
//     caller joins at once (the out= variants, broadcast_) needs nothing: the caller's stream is past the op before
//     anything later on it can reuse the memory. This is what ProcessGroupNCCL does for functional collectives
//     (TORCH_NCCL_AVOID_RECORD_STREAMS), and what the planner's memory model assumes (an input lives until its wait).
//   record_stream (RuntimeConfig.keep_alive, for comparison): recordStream on every stream of the op. Freed blocks
//     then return to the allocator only once those streams have passed the free *as the host sees it*, so when the
//     host runs ahead of the GPU (a training loop that never synchronizes) every block a collective touched in the
//     run-ahead window stays reserved, and new allocations take fresh memory.
// Point-to-point batches of the ce_overlap ops keep recordStream in both modes (their async tickets carry no tensors).
enum class KeepAlive { Stash, RecordStream };
KeepAlive keep_alive_mode();
void set_keep_alive_mode(KeepAlive mode);  // process-wide (RuntimeConfig.keep_alive)

// recordStream of `t` on `streams` (tensors of the group's pool are not the allocator's: skipped).
void record_streams(Group& g, const at::Tensor& t, const std::vector<cudaStream_t>& streams);

// What a deferred op's streams read or write after it returned, held until the caller joins it. Outputs are held by
// their storages, not their tensors: whether anyone can still wait for the op is whether a tensor other than ours
// refers to an output's storage (the result itself, or a view of it), which the storage's reference count says.
struct Stash {
  std::vector<at::Tensor> inputs;
  std::vector<c10::Storage> outputs;
  std::vector<c10::Storage> record_on_drop;  // the allocator's storages among both, for the unwaited case
  std::vector<cudaStream_t> streams;
  c10::DeviceIndex device = 0;

  // No tensor outside this stash refers to any output's storage: nobody can wait for the op any more.
  bool unreachable() const;
  // The op will never be joined: its tensors go back to the allocator with recordStream on the op's streams.
  void drop_unjoined();
  // Moves the held tensors out (to be destroyed by the caller once its stream waits for the op).
  Stash take();
};

// How the caller of a run_* function joins the op.
enum class Join {
  Now,         // its current stream waits for the op before run_* returns (out= variants)
  Functional,  // later, at ce_overlap::wait_tensor on an output (registered in DeferredJoins)
  Handle,      // later, through the returned OpHandle (a c10d Work)
};

// An op enqueued with Join::Handle: the events its end was recorded into (owned: destroyed with the handle; one per
// stream the op ends on, e.g. one per send / receive of a point-to-point batch) and its stash. join() makes a stream
// wait for the op and releases the tensors; a handle destroyed unjoined hands them to the allocator with
// recordStream. complete() says whether the op has finished on the GPU.
class OpHandle {
 public:
  OpHandle() = default;
  OpHandle(int device, std::vector<cudaEvent_t> events, std::shared_ptr<Stash> stash)
      : device_(device), events_(std::move(events)), stash_(std::move(stash)) {}
  ~OpHandle();
  OpHandle(const OpHandle&) = delete;
  OpHandle& operator=(const OpHandle&) = delete;
  OpHandle(OpHandle&& other) noexcept;
  OpHandle& operator=(OpHandle&& other) noexcept;

  bool empty() const { return events_.empty(); }  // nothing was enqueued (an empty op)
  void join(cudaStream_t stream);
  bool complete() const;

 private:
  void release();
  int device_ = 0;
  std::vector<cudaEvent_t> events_;
  std::shared_ptr<Stash> stash_;
};

// Deferred joins of the functional ops: output storage -> the event its op's end was recorded into, and the op's
// stash. The op returns without making the caller's stream wait (so the compute a graph places between a collective
// and its wait overlaps it, as with _c10d_functional); ce_overlap::wait_tensor(output) makes the current stream wait
// on the event and drops the stash. Events are reused only after a wait consumed them (cudaStreamWaitEvent
// snapshots the event). Ops whose results were dropped without a wait (eager code calling a functional op directly)
// are reaped: their tensors go to the allocator with recordStream on the op's streams.
class DeferredJoins {
 public:
  static DeferredJoins& get();
  cudaEvent_t take(int device);
  void give_back(int device, cudaEvent_t e);  // the op was not enqueued: the event goes back unused
  void add(const std::vector<const void*>& storages, int device, cudaEvent_t e, std::shared_ptr<Stash> stash);
  // Makes `stream` wait for the op that produced `storage`, if one is pending; true if one was.
  bool join(const void* storage, cudaStream_t stream);
  static std::atomic<int64_t>& reaped_total();  // ops reaped so far (a graph should have none)
  size_t stashed_tensors();                     // tensors held by pending ops (tests: a stash never dropped leaks)

 private:
  struct Entry {
    int device = 0;
    cudaEvent_t event = nullptr;
    std::shared_ptr<Stash> stash;  // shared by the entries of one op's outputs; emptied by the first wait
  };
  void release_locked(const Entry& entry);
  void reap_unreachable_locked(std::vector<std::shared_ptr<Stash>>& reaped);

  std::mutex mu_;
  std::unordered_map<const void*, Entry> pending_;
  std::unordered_map<cudaEvent_t, size_t> refs_;  // pending entries per event
  std::map<int, std::vector<cudaEvent_t>> free_;
};

// ---------------------------------------------------------------------------------------------------
// The collectives on tensors. Each enqueues its op on the caller's current stream's order and joins it as `join`
// says; with Join::Handle it returns the handle (empty when there was nothing to move). Tensors are checked by the
// callers (the ops' schemas differ in what they accept); these check what only the group can (overlaps, in place).

OpHandle run_all_gather(Group& g, const at::Tensor& input, const at::Tensor& out, Join join);
OpHandle run_all_gather_parts(Group& g, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outs,
                              Join join);
OpHandle run_reduce_scatter(Group& g, const at::Tensor& input, const at::Tensor& out, const std::string& reduce_op,
                            const char* op, Join join);
// Several inputs reduce-scattered as one op into `out` (1-D: their chunks of this rank, concatenated) or, with
// `unreduced`, into `out` of [n - 1, N] rows (the peers' chunks, unsummed).
OpHandle run_reduce_scatter_parts(Group& g, const std::vector<at::Tensor>& inputs, const at::Tensor& out,
                                  ReduceScatterArgs args, Join join);
OpHandle run_all_to_all(Group& g, const at::Tensor& input, const at::Tensor& out, const char* op, Join join);
// Joined at once on the caller's stream (the runtime's broadcast has no deferred join); with Join::Handle the handle
// holds an event recorded on the caller's stream after it, so complete() still says when it finished.
OpHandle run_broadcast(Group& g, const at::Tensor& tensor, int root, Join join);
// Sends and receives (group ranks), each on its channel's stream. Join::Now or Join::Handle.
OpHandle run_p2p(Group& g, const std::vector<at::Tensor>& sends, const std::vector<int>& send_peers,
                 const std::vector<at::Tensor>& recvs, const std::vector<int>& recv_peers, Join join);

}  // namespace ce_overlap
