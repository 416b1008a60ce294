// The planner (docs/plan.md): buckets the collectives of one graph (csrc/graph/bucketing.h),
// schedules them (csrc/graph/schedule.h), picks NCCL or CE per bucket with the cost model's
// decide() over the compute between the bucket and its wait in the new order, and sums up the
// exposed communication and peak memory before and after.
#pragma once

#include <string>

#include "../graph/ir.h"
#include "../graph/plan.h"
#include "cost_model.h"

namespace ce_overlap {

// The Plan of graph `graph_name` of `doc` (a validated document: load_ir or validate()). The result
// satisfies every rule of docs/plan.md (it is checked with check_plan before it is returned).
// Throws IrError for an unknown graph or a bad config.
Plan make_plan(const Document& doc, const std::string& graph_name, const CostModel& model, const PlanConfig& config);

}  // namespace ce_overlap
