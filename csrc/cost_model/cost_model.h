// Time estimates for IR nodes and collectives under NCCL or the copy engines, contention between a
// collective and the compute beside it, and the per-collective NCCL/CE decision. The model and its
// fit to measurements: docs/cost_model.md. Units: microseconds, bytes, GB/s = 1e9 bytes/s.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "../graph/ir.h"
#include "../graph/plan.h"
#include "profile.h"

namespace ce_overlap {

// A stretch of a collective with steady resource use. A CE reduce-scatter pipelines its rounds (the runtime
// reduces round k while the copies of round k+1 run): copies alone, copies beside the reduction kernel
// (reduce_sms SMs), then the last reduction alone.
struct CollectivePhase {
  double us = 0;
  int sms = 0;           // SMs it holds
  double hbm_bytes = 0;  // bytes it moves through this GPU's HBM (reads + writes)
  // The CE reduction kernel runs throughout the phase; reduction_hbm_bytes of hbm_bytes are its own traffic.
  // With contention.ce_reduction in the profile, its measured slowdown prices the kernel instead of the SM/HBM
  // formula (which charges its CTAs as SMs taken away).
  bool reduction = false;
  double reduction_hbm_bytes = 0;
  bool nccl = false;  // a hierarchical collective's NCCL half (its other phases are the copy engines')
};

struct CollectiveEstimate {
  Backend backend = Backend::Nccl;
  double us = 0;          // time alone
  double latency_us = 0;  // the part that does not scale with bytes
  std::string algorithm;  // "ring/ll128", "tree/simple", "ce/pull", "ce/a2a+reduce", ... ("curve" when calibrated)
  std::vector<CollectivePhase> phases;  // durations sum to us
  // Time the collective adds to the kernel that consumes its result, on the compute stream after the wait: a CE
  // reduce-scatter with CeReduction::Consumer leaves the sum of the peers' chunks to that kernel (one more read of
  // (n - 1) chunks at the HBM roofline). Not part of `us`.
  double consumer_us = 0;
};

// Fractional slowdowns (0.22 = 22% longer) of the two kernel classes beside some traffic.
struct Slowdown {
  double compute_bound = 0;
  double memory_bound = 0;
};

// The compute that runs beside a collective: kernel time alone, by class (CostModel::compute_bound).
struct OverlapWindow {
  double compute_bound_us = 0;
  double memory_bound_us = 0;
};

struct BackendCost {
  double comm_us = 0;      // collective time, including its own slowdown beside the window
  double slowdown_us = 0;  // extra time the window's kernels take because the collective runs beside them
  double exposed_us = 0;   // part of comm_us not hidden by the (slowed) window
  double cost_us = 0;      // exposed_us + slowdown_us + estimate.consumer_us: what the collective adds to the step
  Slowdown slowdown;       // time-weighted over the collective's phases
  CollectiveEstimate estimate;
};

struct Decision {
  Backend choice = Backend::Nccl;
  BackendCost nccl;
  std::optional<BackendCost> ce;  // absent when CE cannot serve the group (ce_blocker)
  // The hierarchical choice (Backend::Hier) for a group across nodes; absent where it cannot serve (hier_blocker).
  std::optional<BackendCost> hier;
  std::string reason;             // one line, "ce: ..." or "nccl: ..."
};

class CostModel {
 public:
  explicit CostModel(Profile profile);

  const Profile& profile() const { return profile_; }

  // Where a CE reduce-scatter sums the chunks (PlanConfig::ce_reduction; default Kernel, the runtime's reducing
  // op). Consumer: the estimate moves the chunks and copies them out with copy engines only (no SMs), and charges
  // the sum to the consuming kernel (CollectiveEstimate::consumer_us); a calibrated CE reduce-scatter curve
  // (measured with the kernel) is not used for it.
  void set_ce_reduction(CeReduction reduction) { ce_reduction_ = reduction; }
  CeReduction ce_reduction() const { return ce_reduction_; }

  // Roofline: max(flops / (peak(dtype) x GEMM efficiency(flops)), bytes_accessed / (hbm x memory eff)),
  // at least the launch floor. GEMM efficiency = gemm x flops / (flops + gemm_ramp_flops).
  // Only compute nodes cost time; view/other/wait nodes cost 0.
  double compute_us(const Node& node) const;
  // True when the FLOP side of the roofline (floor aside) dominates: SM contention slows it most.
  bool compute_bound(const Node& node) const;

  // NCCL time of one collective: what the captured graph runs and what the analyzer reports.
  double collective_us(const CollectiveInfo& c) const;
  // Either backend. Groups are placed on GPUs 0..n-1 (nodes filled in order). Throws IrError with
  // the blocker when backend is CE and the group cannot use it.
  CollectiveEstimate estimate(const CollectiveInfo& c, Backend backend) const;
  // Why CE cannot serve a group of this size ("group spans 2 nodes; ..."), or nullopt if it can. With the nodes its
  // ranks are on (CollectiveInfo::nodes; 0: placed on consecutive GPUs): a group on more than one node cannot.
  std::optional<std::string> ce_blocker(int group_size, int nodes = 0) const;
  // Why the hierarchical all-gather / reduce-scatter (Backend::Hier) cannot serve this collective, or nullopt: it
  // needs an all-gather or reduce-scatter over a group on 2 or more nodes with as many ranks, at least 2, on each.
  std::optional<std::string> hier_blocker(const CollectiveInfo& c) const;

  // Slowdown of kernels beside one phase of a collective (SM and HBM contention, kept apart).
  Slowdown slowdown_beside(const CollectivePhase& phase) const;
  // The collective's cost when `window` runs beside it.
  BackendCost cost(const CollectiveInfo& c, Backend backend, const OverlapWindow& window) const;
  // Predicted cost under NCCL and under CE, the cheaper one, and why. A group that spans nodes or
  // lacks P2P between any two of its GPUs always gets NCCL.
  Decision decide(const CollectiveInfo& c, const OverlapWindow& window) const;

  // The fraction of one GPU's NVLink (per direction, at its usable rate: the link's GB/s x
  // ce.bidirectional_efficiency, both directions busy) a collective keeps busy while it runs alone for `us`: its bus
  // bytes per GPU and direction (all-gather (n-1) x shard, reduce-scatter and all-to-all (n-1)/n x input, all-reduce
  // twice that, broadcast and send / recv the bytes) over that time, at most 1. 0 for a group of one rank or one that
  // spans nodes (its traffic leaves over the network). What simulate() shares the link by (SimulateOptions).
  double link_share(const CollectiveInfo& c, double us) const;

  // compute_us for compute nodes, collective_us for collectives, 0 otherwise.
  double node_us(const Node& node) const;
  // Every node's time in the graph, kernel fusion included: each fusion group (analysis.h, fusion_groups) takes
  // max(its bytes in + out at the fused kernels' HBM rate (efficiency.fused_memory, else memory), one launch), spread
  // over its compute nodes in proportion to their own bytes' time at that rate (never more than that sum); GEMMs,
  // attention, collectives and compute nodes in no group keep node_us. Plus efficiency.kernel_gap_us per kernel.
  // With `kernel_starts`, also marks the first node of every kernel the graph runs (a fusion group's first compute
  // node, or a compute node outside any group): the nodes that carry the gap.
  std::vector<double> durations_us(const Graph& g, std::vector<char>* kernel_starts = nullptr) const;

 private:
  struct Roofline {
    double flops_us = 0;   // FLOP side, with the GEMM ramp
    double memory_us = 0;  // HBM side
  };
  Roofline roofline(const Node& node) const;

  struct Placement {
    int nodes = 1;         // nodes the group spans
    double ring_gbps = 0;  // slowest intra-node link on the ring 0 -> 1 -> ... -> n-1 (-> 0 in one node)
  };
  // The group's placement: on `nodes` nodes when known (CollectiveInfo::nodes, its ranks spread evenly), else on
  // consecutive GPUs, nodes filled in order.
  Placement place(int group_size, int nodes = 0) const;
  CollectiveEstimate nccl_estimate(const CollectiveInfo& c) const;
  CollectiveEstimate ce_estimate(const CollectiveInfo& c) const;
  CollectiveEstimate hier_estimate(const CollectiveInfo& c) const;
  const Curve* find_curve(const CollectiveInfo& c, Backend backend) const;

  Profile profile_;
  CeReduction ce_reduction_ = CeReduction::Kernel;
  // ring_prefix_gbps_[k]: slowest link among pairs (i, i+1), i < k, within one node (k = 0: +inf).
  std::vector<double> ring_prefix_gbps_;
};

// "64 KiB", "1.5 MiB", "2 GiB": sizes in reasons and tables.
std::string format_bytes(double bytes);

}  // namespace ce_overlap
