// All-gather into tensor on copy engines (the protocol is described at the top of all_gather.cc).
#pragma once

#include "group.h"

#include <cstddef>
#include <string>
#include <vector>

namespace ce_overlap {

// PULL (default): every rank copies the peers' shards out of their pools into its output.
// PUSH: every rank copies its own shard into every peer's output; needs the output in the group's user
// region (empty_symmetric, same offset on every rank); an op whose output is not there is pulled.
enum class AllGatherMode : int { Pull = 0, Push = 1 };

// Process-wide mode (RuntimeConfig.all_gather_mode, default pull): the last set_all_gather_mode. Every rank must use
// the same mode for an op (a mismatch is caught as a "different collective" timeout).
AllGatherMode all_gather_mode();
// Sets the mode ("pull" or "push"); returns the previous one. Throws std::invalid_argument otherwise.
std::string set_all_gather_mode(const std::string& mode);

// One tensor of an all-gather: `bytes` per rank in, world_size * bytes out, rank p's shard at byte p * bytes.
struct AllGatherPart {
  const void* input;  // bytes, contiguous
  void* output;       // world_size * bytes, contiguous
  size_t bytes;
};

struct AllGatherArgs {
  // One part (all_gather_into_tensor), or several gathered as ONE op (all_gather_into_tensors): the protocol
  // moves their shards as one concatenated shard of sum(bytes) (what a bucketed all-gather moves), but every
  // copy reads from and writes to the parts' own tensors, so no kernel packs or unpacks a bucket buffer.
  // A single part is zero-copy when its input or output lies in the group's user region; several are zero-copy
  // when their inputs lie back to back in the user region (a symmetric slot), and staged otherwise.
  std::vector<AllGatherPart> parts;
  cudaStream_t caller;  // the outputs are ready on this stream when the op is done
  // Deferred join (functional ops in graphs): when set, the op's end is recorded into this event and the caller's
  // stream does NOT wait here; ce_overlap::wait_tensor makes it wait, so compute between the two overlaps the op.
  cudaEvent_t join = nullptr;

  size_t nbytes() const;  // per rank, over all parts
};

// Whether every part's input starts where the previous part's ends (one contiguous range, in part order).
bool parts_inputs_contiguous(const std::vector<AllGatherPart>& parts);

// Enqueues the op; returns at once (stream-ordered). Throws on bad state (group failed, CUDA graph
// capture, CUDA errors) with a message naming the op, group and rank.
void enqueue_all_gather(Group& g, const AllGatherArgs& a);

}  // namespace ce_overlap
