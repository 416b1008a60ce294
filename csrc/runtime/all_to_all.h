// All-to-all (equal splits) and broadcast on copy engines only (protocols at the top of all_to_all.cc).
#pragma once

#include "group.h"

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

// A broadcast's link rate times its per-round latency (~400 GB/s x ~10 us): what a round costs in bytes it could
// have moved. broadcast_segments weighs the scatter + all-gather's extra rounds against the root's extra bytes with it.
constexpr size_t kBroadcastRoundBytes = 4u << 20;

// The segments a broadcast of `nbytes` over `world_size` ranks is pipelined over as a scatter + all-gather (protocol
// in all_to_all.cc), or 0: every non-root pulls the whole tensor from the root (2 ranks, or small tensors). `tuned`
// > 0 (Group::bcast_segments) forces that count from 3 ranks on.
size_t broadcast_segments(int world_size, size_t nbytes, int tuned);

}  // namespace ce_overlap
