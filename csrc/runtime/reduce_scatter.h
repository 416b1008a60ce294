// Reduce-scatter on copy engines plus one bounded reduction kernel (protocol at the top of
// reduce_scatter.cc).
#pragma once

#include "group.h"
#include "reduce_kernels.h"

#include <cstddef>
#include <optional>
#include <vector>

namespace ce_overlap {

// One tensor of a reduce-scatter: world_size * bytes in, chunk p (bytes [p * bytes, (p + 1) * bytes)) for rank p.
struct ReduceScatterPart {
  const void* input;  // world_size * bytes, contiguous
  size_t bytes;       // chunk bytes per rank (a multiple of the element size)
};

struct ReduceScatterArgs {
  // One part (reduce_scatter_tensor), or several reduced as ONE op (reduce_scatter_tensors): rank r's output is the
  // concatenation of every part's chunk r, reduced. The pushes read the parts' own chunks and the reduction writes
  // the output, so no kernel packs a bucket buffer. All parts have the op's dtype.
  std::vector<ReduceScatterPart> parts;
  void* output;         // sum of the parts' bytes, contiguous; with one part it may be the input's own chunk (in place)
  ReduceDType dtype;
  ReduceOp op;
  cudaStream_t caller;  // the output is ready on this stream when the op is done
  cudaEvent_t join = nullptr;  // deferred join, as in AllGatherArgs
  // Unreduced (reduce_scatter_tensors_unreduced): no reduction kernel. The output holds n - 1 rows of
  // chunk_bytes(), row j the chunk of the j-th peer in rank order (this rank skipped), copied out of the staging
  // slots by the copy engines; the caller sums them with its own chunk (a graph fuses that into the consumer).
  // dtype and op are then unused (any element type moves).
  bool unreduced = false;
  // The output's dtype when it differs from the inputs' (a widening reduction: 16-bit inputs, an fp32 output summed
  // in fp32; reduce_dtypes_supported). The output then holds chunk_bytes() / elem(dtype) elements of out_dtype.
  std::optional<ReduceDType> out_dtype = std::nullopt;

  size_t chunk_bytes() const { return parts_bytes(parts); }  // per rank, over all parts
};

// Enqueues the op; returns at once (stream-ordered). Throws on bad state (group failed, CUDA graph
// capture, CUDA errors) with a message naming the op, group and rank.
void enqueue_reduce_scatter(Group& g, const ReduceScatterArgs& a);

// Bytes per rank and round (what one staging slot holds) for a group: min(RuntimeConfig.rs_round_mb,
// staging / 2 banks / (n - 1) slots), a multiple of the pool alignment.
size_t reduce_scatter_round_bytes(Group& g);

}  // namespace ce_overlap
