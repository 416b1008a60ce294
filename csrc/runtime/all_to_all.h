// All-to-all (equal splits) and broadcast on copy engines only (protocols at the top of all_to_all.cc).
#pragma once

#include "group.h"
#include "cost_model/ce_algorithms.h"

#include <cstddef>

namespace ce_overlap {

struct AllToAllArgs {
  const void* input;    // world_size * chunk_bytes, contiguous; chunk p goes to rank p
  void* output;         // world_size * chunk_bytes, contiguous; chunk p comes from rank p; must not overlap input
  size_t chunk_bytes;   // per rank pair
  cudaStream_t caller;  // the output is ready on this stream when the op is done
  cudaEvent_t join = nullptr;  // deferred join, as in AllGatherArgs
};

// Enqueues the op; returns at once (stream-ordered). Throws on bad state (group failed, CUDA graph capture, CUDA
// errors) with a message naming the op, group and rank.
void enqueue_all_to_all(Group& g, const AllToAllArgs& a);

struct BroadcastArgs {
  void* tensor;         // nbytes, contiguous: read on the root, overwritten with the root's bytes everywhere else
  size_t nbytes;
  int root;             // group rank
  cudaStream_t caller;  // the tensor is ready on this stream when the op is done
};

void enqueue_broadcast(Group& g, const BroadcastArgs& a);

// The broadcast's algorithm (whole pull, scatter + all-gather, or push broadcast, relayed or not, and their segments):
// broadcast_segments, broadcast_push_segments, broadcast_relays and broadcast_relay_order in cost_model/ce_algorithms.h,
// shared with the cost model.

}  // namespace ce_overlap
