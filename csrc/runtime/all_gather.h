// All-gather into tensor on copy engines (the protocol is described at the top of all_gather.cc).
#pragma once

#include "group.h"

#include <cstddef>
#include <string>

namespace ce_overlap {

// PULL (default): every rank copies the peers' shards out of their pools into its output.
// PUSH: every rank copies its own shard into every peer's output; needs the output in the group's user
// region (empty_symmetric, same offset on every rank); an op whose output is not there is pulled.
enum class AllGatherMode : int { Pull = 0, Push = 1 };

// Process-wide mode: CE_OVERLAP_AG_MODE (pull|push, default pull) read at first use, or the last
// set_all_gather_mode. Every rank must use the same mode for an op (a mismatch is caught as a
// "different collective" timeout). Throws naming the variable when it holds anything else.
AllGatherMode all_gather_mode();
// Sets the mode ("pull" or "push"); returns the previous one. Throws std::invalid_argument otherwise.
std::string set_all_gather_mode(const std::string& mode);

struct AllGatherArgs {
  const void* input;    // nbytes, contiguous; zero-copy when it lies in the group's user region
  void* output;         // world_size * nbytes, contiguous; shard p at byte p * nbytes
  size_t nbytes;        // per rank
  cudaStream_t caller;  // the output is ready on this stream when the op is done
  // Deferred join (functional ops in graphs): when set, the op's end is recorded into this event and the caller's
  // stream does NOT wait here; ce_overlap::wait_tensor makes it wait, so compute between the two overlaps the op.
  cudaEvent_t join = nullptr;
};

// Enqueues the op; returns at once (stream-ordered). Throws on bad state (group failed, CUDA graph
// capture, CUDA errors) with a message naming the op, group and rank.
void enqueue_all_gather(Group& g, const AllGatherArgs& a);

}  // namespace ce_overlap
