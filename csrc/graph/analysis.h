// Graph algorithms over the IR: order, critical path, blocks, liveness, a two-stream timeline.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir.h"

namespace ce_overlap {

// Kahn's algorithm; among ready nodes the smallest id goes first, so an already topological
// graph keeps its order. Throws IrError naming the nodes on a cycle.
std::vector<int> topological_order(const Graph& g);

// Throws IrError unless `order` is a permutation of the node ids in which every input precedes its user.
void check_order(const Graph& g, const std::vector<int>& order);

struct CriticalPath {
  double length = 0;       // sum of durations along the path
  std::vector<int> nodes;  // node ids, first to last
};
// Longest path where each node weighs durations[id]; durations.size() must equal the node count.
CriticalPath critical_path(const Graph& g, const std::vector<double>& durations);

// For a view or wait node, the node whose memory it aliases (following view/wait chains);
// for any other node, itself.
int storage_owner(const Graph& g, int node_id);
// For a wait node, the collective it waits on (through view chains); -1 for other nodes.
int waited_collective(const Graph& g, int node_id);

// Detects transformer-like blocks from module_stack (rule in docs/ir.md), fills doc.blocks and
// every node's `block` in every graph. Nodes outside any instance get -1.
void detect_blocks(Document& doc);

struct MemoryEstimate {
  int64_t peak_bytes = 0;      // intermediate tensors alive at the worst point (placeholders excluded)
  int peak_node = -1;          // node at which the peak is reached
  int64_t input_bytes = 0;     // bytes of placeholders (held by the caller, alive throughout)
  std::vector<int64_t> live_bytes_after;  // per position in the order: live intermediate bytes after that node ran
};
// Liveness over `order` (checked with check_order): outputs allocated when a node runs, freed after
// the last use of the node or of any view/wait aliasing it; graph outputs stay live to the end.
MemoryEstimate peak_memory(const Graph& g, const std::vector<int>& order);

// Inductor fuses chains of pointwise and reduction kernels into one generated kernel, which reads what enters the
// chain from HBM once and writes only what leaves it. The IR keeps the unfused post-grad nodes, so memory time summed
// node by node counts every intermediate twice (written, read back). A fusion group approximates Inductor's fusion:
// FLOP-free compute nodes (torch's flop counter counts only GEMMs, convolutions and attention, which stay separate
// kernels) joined producer -> consumer, directly or through views, form one group, unless another kernel (a GEMM,
// attention, a collective or its wait) lies on a path from one of them to the other: Inductor cannot run one kernel
// both before and after it.
struct FusionGroup {
  std::vector<int> compute_nodes;  // positions of the group's kernels (its views cost nothing)
  int64_t bytes_in = 0;   // what enters: each outside producer's output once; read through a view, the view's bytes
  int64_t bytes_out = 0;  // what leaves: outputs of its compute nodes read outside the group (directly or through
                          // its views), or by nobody (kept: a graph output or an effect)
};
// The groups with at least one compute node, in order of their first node.
std::vector<FusionGroup> fusion_groups(const Graph& g);

enum class Stream { Compute = 0, Comm = 1 };

struct TimelineEvent {
  int node = -1;
  Stream stream = Stream::Compute;
  double start_us = 0;
  double end_us = 0;
};

// Two collectives of different groups that ran at the same time, and what sharing the GPU's NVLink added to each
// (only where their link shares together exceed the link: SimulateOptions::link_share).
struct CollectiveOverlap {
  int a = -1;             // collective node ids, a issued first
  int b = -1;
  double overlap_us = 0;  // time both ran (without the link's slowdown)
  double added_a_us = 0;  // what sharing the link added to a
  double added_b_us = 0;
};

struct Timeline {
  std::vector<TimelineEvent> events;   // one per node with a duration > 0 or a collective, in issue order
  double makespan_us = 0;
  double compute_busy_us = 0;
  double comm_busy_us = 0;
  // Time the compute stream sat blocked in a wait, per collective node id (index = node id, 0 if none).
  std::vector<double> exposed_us_by_collective;
  // Collectives of different groups that overlapped, in issue order of `a` (SimulateOptions::link_share).
  std::vector<CollectiveOverlap> overlaps;
};

struct SimulateOptions {
  // Per node id: the fraction of the GPU's NVLink (per direction) a collective keeps busy while it runs alone (its bus
  // bytes over its time, against the link's usable bandwidth); empty or 0: it shares nothing. Two collectives of
  // different groups that overlap with shares summing above 1 both slow down while they overlap: each progresses at
  // 1 / (sum) of its pace alone (the link split in proportion), so each gains overlap x (1 - 1 / sum).
  std::vector<double> link_share;
};

// List schedule in the given order over a compute stream and one comm stream per process group: every non-collective
// node runs on the compute stream in order, after its inputs are ready; a collective runs on its group's stream in
// order, once its inputs are ready and the compute stream has run everything issued before it (a collective's stream
// waits for the stream that issues it, as NCCL's and the CE runtime's do); a wait blocks the compute stream until
// its collective ends. Collectives of different groups run at the same time, sharing the link as `options` says
// (two passes: the overlaps of the first lengthen the collectives of the second). Views/other take their duration
// (normally 0) on the compute stream.
Timeline simulate(const Graph& g, const std::vector<int>& order, const std::vector<double>& durations_us,
                  const SimulateOptions& options = {});

}  // namespace ce_overlap
