// The analyzer: blocks, collectives, compute and estimated exposed communication of a captured
// program, as a JSON report (schema ce_overlap.analysis/1) that the CLI renders.
#pragma once

#include <nlohmann/json.hpp>

#include "../graph/ir.h"
#include "cost_model.h"

namespace ce_overlap {

inline constexpr const char* kAnalysisSchema = "ce_overlap.analysis/1";

// Validates doc, simulates every graph in its captured order with the model's durations and returns
// the report described in docs/analysis.md. ordered_json keeps the documented key order when dumped.
nlohmann::ordered_json analyze(const Document& doc, const CostModel& model);

}  // namespace ce_overlap
