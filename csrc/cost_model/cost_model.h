// Time estimates for IR nodes. This is the interface the analyzer and planner use; issue-level
// upgrades (calibrated curves, CE transfers, contention) change the implementation, not the callers.
#pragma once

#include <vector>

#include "../graph/ir.h"
#include "profile.h"

namespace ce_overlap {

class CostModel {
 public:
  explicit CostModel(Profile profile);

  const Profile& profile() const { return profile_; }

  // Roofline: max(flops / (peak(dtype) * gemm eff), bytes_accessed / (hbm * memory eff)), at least
  // the launch floor. Only compute nodes cost time; view/other/wait nodes cost 0.
  double compute_us(const Node& node) const;
  // Alpha-beta NCCL time for one collective (ring algorithm; the inter-node link once the group
  // spans more than one node).
  double collective_us(const CollectiveInfo& c) const;
  // compute_us for compute nodes, collective_us for collectives, 0 otherwise.
  double node_us(const Node& node) const;
  std::vector<double> durations_us(const Graph& g) const;

 private:
  Profile profile_;
};

}  // namespace ce_overlap
