// The planner's list scheduler (docs/plan.md): a new topological order of one graph in which every
// bucket's collectives and waits are contiguous, all-gather buckets are prefetched a few blocks
// early, waits sink to their first use, and the peak-memory increase stays within the budget.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "analysis.h"
#include "bucketing.h"
#include "ir.h"
#include "plan.h"

namespace ce_overlap {

struct Schedule {
  std::vector<Bucket> buckets;      // the buckets scheduled (split apart where merging them made a cycle)
  std::vector<int> order;           // node ids
  std::vector<int> prefetch;        // per bucket: blocks of prefetch used (all-gathers; 0 otherwise)
  std::vector<std::string> notes;   // per bucket: what the scheduler changed for it ("" if nothing)
  std::vector<int> issue_position;  // per bucket: position in `order` of its first member collective
  std::vector<int> wait_position;   // per bucket: position of its first member wait (-1: no wait)
  int64_t peak_bytes_before = 0;    // captured order, peak_memory()
  int64_t peak_bytes_after = 0;     // new order with the bucket buffers (bucketed_peak_memory)
  bool kept_captured_order = false; // nothing within the budget: singletons in the captured order
};

// Schedules g. Keys per node, then a priority-queue topological sort (smallest key first): a node
// keeps its captured position; placeholders go first and `output` last; an all-gather bucket's
// collectives take the start of the block `prefetch_blocks` blocks before theirs (block order as
// the graph runs them), never before an earlier all-gather bucket; other buckets go right after
// their last input; waits, and nodes that read only waits (and such nodes), go just before their
// first user. Every key is lowered to its users' keys, so inputs move along with what needs them.
// While the peak memory (bucket buffers counted) exceeds the captured order's by more than
// config.memory_budget_bytes, the prefetch of the all-gather bucket whose buffer is held across
// the peak only because of its prefetch (the one needed last) drops by one block; if that cannot
// help, every bucket becomes a singleton in the captured order.
Schedule schedule_graph(const Graph& g, std::vector<Bucket> buckets, const PlanConfig& config);

// Peak memory of `order` by the liveness rule of peak_memory(), the buckets applied: a bucket of
// several members allocates one copy-in buffer (its bytes) right before its first member and one
// output buffer (the members' outputs together) that lives until the last use of any member.
// Singleton buckets change nothing. order must keep each bucket's collectives contiguous.
MemoryEstimate bucketed_peak_memory(const Graph& g, const std::vector<Bucket>& buckets, const std::vector<int>& order);

}  // namespace ce_overlap
