// Bucketing (docs/plan.md): the collectives of one graph grouped per transformer block (or per
// bucket-pattern key), same type, group, group size, dtype and reduce op, under a byte cap.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir.h"
#include "plan.h"

namespace ce_overlap {

// How a collective is read. A collective is *bucketable* when exactly one wait reads it and that
// wait is its only direct user; others (coalesced collectives read by several waits through
// getitem views, collectives no wait reads, outputs read without a wait) stay singletons where
// they were captured, on NCCL.
struct CollectiveUse {
  int wait = -1;        // the wait that consumes it (through views); the first by id when several do
  int num_waits = 0;
  bool bucketable = false;
  // Bucketable, and the FX rewriter can merge it with others: the functional all_gather_into_tensor,
  // reduce_scatter_tensor or all_reduce of a tensor of at least one dimension (a reduce-scatter's
  // dim 0 divisible by the group size).
  bool mergeable = false;
};
// Indexed by node id; entries of non-collective nodes are left default.
std::vector<CollectiveUse> collective_uses(const Graph& g);

enum class BucketScope { Block, Pattern, Outside };

struct Bucket {
  CollectiveType type = CollectiveType::AllGather;
  std::string group;
  int group_size = 1;
  std::optional<std::string> dtype;
  std::optional<std::string> reduce_op;
  BucketScope scope = BucketScope::Outside;
  int block = -1;        // block shared by every member, else -1
  std::string key;       // block path (Block), matched text (Pattern), "" (Outside)
  std::vector<int> members;  // collective node ids in layout (graph) order
  std::vector<int> waits;    // per member, its wait (-1 if none)
  int64_t bytes = 0;         // sum of the members' collective.bytes
  bool planned = true;       // false: kept where captured (not bucketable), NCCL
  std::string kept_reason;   // why, when not planned ("read by 3 waits (coalesced)")
  CollectiveRole role = CollectiveRole::Unknown;  // its collectives' (they share the group)
  int nodes = 0;  // nodes the group's ranks are on (CollectiveInfo::nodes; 0: not known)
};

// Groups every collective of g into exactly one bucket. Keys: the first bucket pattern (in config
// order) whose regex is found in a module path of the collective's module_stack (outermost first)
// keys it by its match (the first capture group's text when the pattern has one); otherwise its
// block; collectives of no block bucket with their neighbours (no collective of a block or pattern
// key between them). Members go in graph order; a bucket closes when the next member would take it
// over config.bucket_cap_bytes, or when the next member depends on a member already in it. Only
// mergeable collectives (CollectiveUse) share buckets; any other is a bucket of its own.
// A tensor-parallel collective (role "tp") is a bucket of its own: it sits on the critical path of its block.
// Buckets come out ordered by their first member. `blocks` gives the block paths.
std::vector<Bucket> bucket_collectives(const Graph& g, const std::vector<Block>& blocks, const PlanConfig& config);

}  // namespace ce_overlap
