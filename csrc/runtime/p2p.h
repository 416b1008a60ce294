// Point-to-point send / recv on copy engines (pipeline parallelism), batched and deadlock-free (protocol at the top
// of p2p.cc).
#pragma once

#include "group.h"

#include <cstddef>
#include <vector>

namespace ce_overlap {

struct P2pOp {
  bool send = false;
  int peer = -1;          // group rank of the other side; not this rank
  void* tensor = nullptr; // contiguous; send: read, recv: overwritten. Zero-copy ("direct") when it lies in the
                          // group's user region: then the other side's tensor must lie there at the same offset
  size_t nbytes = 0;      // must equal the other side's
};

struct P2pBatchArgs {
  std::vector<P2pOp> ops;  // matched with the peers' ops in order, per peer and direction (as NCCL's send / recv)
  cudaStream_t caller;     // every op starts after the caller's work so far
  // Empty: the caller's stream waits for every op before its next work (stream-ordered). Otherwise one event per op,
  // recorded at the op's end, and the caller's stream does not wait (the caller joins later: ce_overlap._p2p_wait).
  std::vector<cudaEvent_t> joins;
};

// Enqueues every op of the batch on its channel's stream; returns at once. Throws on bad arguments (a peer outside
// the group or this rank) before anything is enqueued, and on bad state (group failed, CUDA graph capture, CUDA
// errors) with a message naming the op, group and rank.
void enqueue_p2p_batch(Group& g, const P2pBatchArgs& a);

// Bytes per landing bank (what one round of a staged message moves): RuntimeConfig.p2p_mb / (n - 1) senders / 2 banks.
size_t p2p_round_bytes(Group& g);

}  // namespace ce_overlap
