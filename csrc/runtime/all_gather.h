// All-gather into tensor on copy engines (the protocol is described at the top of all_gather.cc).
#pragma once

#include "group.h"

#include <cstddef>

namespace ce_overlap {

struct AllGatherArgs {
  const void* input;    // nbytes, contiguous; zero-copy when it lies in the group's user region
  void* output;         // world_size * nbytes, contiguous; shard p at byte p * nbytes
  size_t nbytes;        // per rank
  cudaStream_t caller;  // the output is ready on this stream when the op is done
};

// Enqueues the op; returns at once (stream-ordered). Throws on bad state (group failed, CUDA graph
// capture, CUDA errors) with a message naming the op, group and rank.
void enqueue_all_gather(Group& g, const AllGatherArgs& a);

}  // namespace ce_overlap
