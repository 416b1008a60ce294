// Reduce-scatter on copy engines plus one bounded reduction kernel (protocol at the top of
// reduce_scatter.cc).
#pragma once

#include "group.h"
#include "reduce_kernels.h"

#include <cstddef>

namespace ce_overlap {

struct ReduceScatterArgs {
  const void* input;    // world_size * chunk_bytes, contiguous; chunk p (bytes [p*chunk, (p+1)*chunk)) goes to rank p
  void* output;         // chunk_bytes, contiguous; may be the input's own chunk (in place)
  size_t chunk_bytes;   // per rank (a multiple of the element size)
  ReduceDType dtype;
  ReduceOp op;
  cudaStream_t caller;  // the output is ready on this stream when the op is done
  cudaEvent_t join = nullptr;  // deferred join, as in AllGatherArgs
};

// Enqueues the op; returns at once (stream-ordered). Throws on bad state (group failed, CUDA graph
// capture, CUDA errors) with a message naming the op, group and rank.
void enqueue_reduce_scatter(Group& g, const ReduceScatterArgs& a);

// Bytes per rank and round (what one staging slot holds) for a group: min(CE_OVERLAP_RS_ROUND_MB,
// staging / 2 banks / (n - 1) slots), a multiple of the pool alignment.
size_t reduce_scatter_round_bytes(Group& g);

}  // namespace ce_overlap
