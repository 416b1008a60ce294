// The analyzer: blocks, collectives, compute and estimated exposed communication of a captured
// program, as a JSON report (schema ce_overlap.analysis/1) that the CLI renders.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "../graph/ir.h"
#include "cost_model.h"

namespace ce_overlap {

inline constexpr const char* kAnalysisSchema = "ce_overlap.analysis/1";

// Validates doc, simulates every graph in its captured order with the model's durations and returns
// the report described in docs/analysis.md. ordered_json keeps the documented key order when dumped.
nlohmann::ordered_json analyze(const Document& doc, const CostModel& model);

// The kernels the model runs for the graph named `graph` of doc, in the order of their first node, to hold against a
// GPU trace kernel by kernel (bench/kernel_kinds.py): each fusion group (fusion_groups) is one kernel, each compute
// node outside a group (GEMM, attention) one more. Per kernel: "nodes" (ids), "ops" (their op names), "bytes" (a
// group's bytes in + out, what durations_us charges; a node's bytes_accessed), "us" (the sum of its nodes'
// durations_us, the gap between kernels included), "fused" (a fusion group). Validates doc; an unknown graph name
// throws find_graph's IrError.
nlohmann::ordered_json graph_kernels(const Document& doc, const std::string& graph, const CostModel& model);

}  // namespace ce_overlap
