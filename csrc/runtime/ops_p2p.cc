// Point-to-point ops of TORCH_LIBRARY(ce_overlap) (pipeline parallelism; ce_overlap.runtime.batch_isend_irecv and
// friends): a batch of sends and receives, each on its channel's stream, joined now or through a ticket.
#include "torch_common.h"

#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

namespace ce_overlap {
namespace {

// Async batches: ticket -> the handle of its ops, joined by _p2p_wait on the caller's current stream.
class P2pTickets {
 public:
  static P2pTickets& get() {
    static P2pTickets* t = new P2pTickets();  // leaked: no CUDA calls during static destruction
    return *t;
  }
  int64_t add(OpHandle handle) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = ++next_;
    pending_.emplace(id, std::move(handle));
    return id;
  }
  OpHandle take(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    TORCH_CHECK(it != pending_.end(), "ce_overlap._p2p_wait: no pending point-to-point batch #", id,
                " (already waited for, or never issued)");
    OpHandle handle = std::move(it->second);
    pending_.erase(it);
    return handle;
  }

 private:
  std::mutex mu_;
  int64_t next_ = 0;
  std::unordered_map<int64_t, OpHandle> pending_;
};

void check_p2p_args(at::TensorList send, c10::IntArrayRef send_peers, at::TensorList recv, c10::IntArrayRef recv_peers) {
  TORCH_CHECK(send.size() == send_peers.size(), "ce_overlap.batch_isend_irecv: ", send.size(), " send tensors but ",
              send_peers.size(), " send peers");
  TORCH_CHECK(recv.size() == recv_peers.size(), "ce_overlap.batch_isend_irecv: ", recv.size(), " recv tensors but ",
              recv_peers.size(), " recv peers");
  for (at::TensorList list : {send, recv}) {
    for (const at::Tensor& t : list) check_p2p_tensor(t, "batch_isend_irecv");
  }
}

std::vector<int> peers_of(c10::IntArrayRef peers) { return std::vector<int>(peers.begin(), peers.end()); }

// Returns 0 (async_op=False: the caller's stream waits for every op) or the batch's ticket for _p2p_wait.
int64_t batch_p2p_cuda(at::TensorList send, c10::IntArrayRef send_peers, at::TensorList recv,
                       c10::IntArrayRef recv_peers, std::string group_name, bool async_op) {
  check_p2p_args(send, send_peers, recv, recv_peers);
  std::shared_ptr<Group> g = Runtime::get().require(group_name, "batch_isend_irecv");
  OpHandle handle = run_p2p(*g, send.vec(), peers_of(send_peers), recv.vec(), peers_of(recv_peers),
                            async_op ? Join::Handle : Join::Now);
  return async_op && !handle.empty() ? P2pTickets::get().add(std::move(handle)) : 0;
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
  if (ticket != 0) P2pTickets::get().take(ticket).join(c10::cuda::getCurrentCUDAStream().stream());
  if (std::optional<std::string> err = Runtime::get().first_failure()) {
    TORCH_CHECK(false, "ce_overlap.batch_isend_irecv: ", *err);
  }
}

}  // namespace
}  // namespace ce_overlap

TORCH_LIBRARY_FRAGMENT(ce_overlap, m) {
  m.def("_batch_p2p(Tensor[] send, int[] send_peers, Tensor(a!)[] recv, int[] recv_peers, str group_name, "
        "bool async_op) -> int");
  m.def("_p2p_wait(int ticket) -> ()", &ce_overlap::p2p_wait);
}

TORCH_LIBRARY_IMPL(ce_overlap, CUDA, m) { m.impl("_batch_p2p", TORCH_FN(ce_overlap::batch_p2p_cuda)); }

TORCH_LIBRARY_IMPL(ce_overlap, Meta, m) { m.impl("_batch_p2p", TORCH_FN(ce_overlap::batch_p2p_meta)); }
