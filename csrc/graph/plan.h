// The Plan (schema ce_overlap.plan/1, docs/plan.md): buckets of collectives, their backends and a new
// order of one IR graph. The planner fills it (csrc/cost_model/planner.h); the FX rewriter applies it.
// This core owns the Plan's schema, defaults and rules: loading validates every field and the rules that need
// no graph, naming the field by its JSON path (like the IR loader); check_plan checks every rule of
// docs/plan.md against the graph (the FX rewriter calls it through _core.check_plan). plan_json.cc reads and
// writes, plan_validate.cc holds the rules that need no graph, plan_check.cc those against the graph.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ir.h"

namespace ce_overlap {

inline constexpr const char* kPlanSchema = "ce_overlap.plan/1";

// A Plan that breaks a rule of docs/plan.md ("Rules" lists every name). what() is "<JSON path>: <message>" as
// for any IrError; rule() names the rule ("schema" for a malformed field, "order.topological", "bucket.bytes",
// ...); node() where it broke: the graph node's name, "bucket <id>" for a bucket-level rule, "buckets[<i>]" for
// a malformed field inside a bucket, or nothing (plan-level rules).
class PlanRuleError : public IrError {
 public:
  PlanRuleError(std::string rule, std::optional<std::string> node, const std::string& message)
      : IrError(message), rule_(std::move(rule)), node_(node ? std::optional<std::string>(printable_utf8(*node))
                                                             : std::nullopt) {}
  const std::string& rule() const { return rule_; }
  const std::optional<std::string>& node() const { return node_; }

 private:
  std::string rule_;
  std::optional<std::string> node_;
};

// config.ce: "auto" follows the cost model, "on" forces CE wherever CE can serve the group, "off" keeps NCCL.
enum class CeMode { Auto, On, Off };
const char* to_string(CeMode mode);

// config.ce_reduction: where a reduce-scatter on CE adds the ranks' chunks. "consumer": the runtime only moves
// them (copy engines) and the graph sums them in the kernel that reads the result, with every SM; "kernel": the
// runtime's bounded reduction kernel sums them beside the compute.
enum class CeReduction { Consumer, Kernel };
const char* to_string(CeReduction reduction);

struct PlanConfig {
  int64_t bucket_cap_bytes = int64_t{512} << 20;    // per-rank input bytes of one bucket, >= 1
  int64_t memory_budget_bytes = int64_t{4} << 30;   // peak-memory increase allowed over the captured order
  CeMode ce = CeMode::Auto;
  int64_t min_ce_bytes = int64_t{1} << 20;          // smaller buckets stay on NCCL
  int prefetch_blocks = 1;                          // all-gather buckets are issued this many blocks early
  std::vector<std::string> bucket_patterns;         // module-path regexes (ECMAScript) that key buckets
  CeReduction ce_reduction = CeReduction::Consumer;  // optional in a Plan's config (older plans lack it)
  // The collective types that may move to CE (each of kCeCollectiveTypes at most once, any order); a bucket of another
  // type stays on NCCL. Optional in a Plan's config: absent means all of them.
  std::vector<CollectiveType> ce_collectives = {CollectiveType::AllGather, CollectiveType::ReduceScatter};
  // Pacing (docs/plan.md "Copy rate"): a CE bucket whose copies the cost model puts under this fraction of its window
  // gets a copy rate (PlanBucket::copy_rate_gbps) that stretches them to fill it, so the copy engines run below full
  // speed beside the compute; 0 (default) paces nothing. In 0..1. Optional in a Plan's config (written when not 0).
  double copy_pace_fill = 0;
  // Price the captured order as it is: every collective a bucket of its own where it was captured, nothing moved
  // (docs/plan.md "Keeping the captured order"). How the cost model prices an order another scheduler made (Inductor's
  // overlap scheduler: ce_overlap.analyzer.step_model). Optional in a Plan's config (written when true).
  bool keep_order = false;
};

// The collective types the copy-engine runtime serves: the choices of config.ce_collectives.
inline constexpr CollectiveType kCeCollectiveTypes[] = {CollectiveType::AllGather, CollectiveType::ReduceScatter};
bool ce_allows(const PlanConfig& config, CollectiveType type);

// A config object; every key is optional (the defaults above), unknown keys are rejected, and errors
// name the field under `path` ("config.prefetch_blocks: expected an integer in 0..1024, got -1").
// Patterns are compiled here, so a bad regex fails early. plan_config_to_json writes every key; a Plan's config
// (save_plan) writes the optional keys (ce_reduction, ce_collectives) only where they differ from the default.
PlanConfig plan_config_from_json(const nlohmann::json& j, const std::string& path = "config");
nlohmann::json plan_config_to_json(const PlanConfig& config);

struct PlanMember {
  std::string collective;           // FX node name
  std::optional<std::string> wait;  // the wait_tensor that consumes it; null if none does
  int64_t bytes = 0;                // per-rank input bytes (the IR's collective.bytes)
};

struct PlanPrediction {
  double nccl_us = 0;                 // bucket time on NCCL beside its window (its own slowdown included)
  std::optional<double> ce_us;        // same on CE; null when CE cannot serve the group
  double window_us = 0;               // compute between the bucket collective and its wait, new order
  double nccl_cost_us = 0;            // what it adds to the step on NCCL: exposed + slowdown of the window
  std::optional<double> ce_cost_us;   // same on CE; null when CE cannot serve the group
  double exposed_us = 0;              // part of the chosen backend's time the window does not hide
  // The hierarchical choice's time and cost, for a group across nodes it can serve (optional: absent otherwise).
  std::optional<double> hier_us;
  std::optional<double> hier_cost_us;
};

// A collective of another group (a tensor-parallel one) that a bucket ran beside, and what sharing the GPU's NVLink
// cost each side (the timeline's CollectiveOverlap, the planner's order and backends).
struct PlanOverlap {
  std::string collective;      // its FX node name
  double overlap_us = 0;       // time both ran
  double collective_added_us = 0;  // what the bucket added to it
  double bucket_added_us = 0;      // what it added to the bucket
};

struct PlanBucket {
  int id = 0;
  CollectiveType type = CollectiveType::AllGather;
  std::optional<int> block;               // the members' block; null outside blocks (or mixed, with patterns)
  std::optional<std::string> block_path;  // the block's path, or the text a bucket pattern matched
  std::string group;
  int group_size = 1;
  std::optional<std::string> dtype;       // of the collective's output; null only if it has no tensors
  std::optional<std::string> reduce_op;
  std::vector<PlanMember> members;        // bucket layout order
  int64_t bytes = 0;                      // sum of the members' bytes
  std::string backend;                    // "nccl", "ce" or "hier" (copy engines inside nodes, NCCL across)
  std::string reason;                     // one line starting with "<backend>: "
  PlanPrediction predicted;
  // A CE bucket's copy rate, GB/s per peer copy (the runtime's pacing; config.copy_pace_fill); null: unpaced.
  std::optional<double> copy_rate_gbps;
  CollectiveRole role = CollectiveRole::Unknown;  // its members' (optional in a Plan: written when known)
  std::vector<PlanOverlap> overlaps;              // optional in a Plan: written when not empty
};

struct PlanSummary {
  int64_t collectives = 0;
  int64_t buckets = 0;
  int64_t ce_buckets = 0;
  double exposed_comm_us_before = 0;
  double exposed_comm_us_after = 0;
  // The two-stream timeline's end (the graph's step time, contention aside), before and after; optional on load
  // (plans written before they existed lack them), always written by the planner.
  std::optional<double> makespan_us_before;
  std::optional<double> makespan_us_after;
  int64_t peak_memory_bytes_before = 0;
  int64_t peak_memory_bytes_after = 0;
  int64_t memory_budget_bytes = 0;
  double plan_ms = 0;
};

struct Plan {
  std::string graph;
  std::string profile;
  PlanConfig config;
  std::vector<PlanBucket> buckets;
  std::vector<std::string> order;  // every node of the graph once, by name
  PlanSummary summary;
};

// Parse and validate (structure, and every rule that needs no graph: ids, byte sums, the cap,
// backends and reasons, `order` unique, bucket members and waits contiguous in `order`, summary
// counts, the memory budget). Throws PlanRuleError("buckets[2].members[0].bytes: ...").
Plan load_plan(const std::string& json_text);
Plan plan_from_json(const nlohmann::json& j);
// Parse only: JSON, structure and field types (PlanRuleError with rule "schema"), none of the rules between
// fields; for check_plan, which runs every rule in its own order.
Plan parse_plan(const std::string& json_text);
// Canonical text (fixed key order, one bucket and one order entry per line): load_plan(save_plan(p))
// == p, and save_plan(load_plan(s)) == s for any s that save_plan wrote. Validates first.
std::string save_plan(const Plan& plan);
nlohmann::ordered_json plan_to_json(const Plan& plan);
// The loader's rules on a Plan built in memory; throws PlanRuleError.
void validate_plan(const Plan& plan);

// Every rule of docs/plan.md (validate_plan's included) against the graph `plan.graph` of `doc`: names exist,
// `order` is a topological order with placeholders first and `output` last, bucket fields match the member
// nodes, every collective is in exactly one bucket with its own wait, inputs come before the first member and
// wait users after the last member wait. Throws PlanRuleError naming the rule, the node and the field. Rules
// are checked in a fixed order (the schema; `order` against the graph; per bucket: its fields, backend and
// reason, each member, its bytes and cap, merge-ability, its order; coverage; the summary), so a Plan that
// breaks several reports the same first one every time.
void check_plan(const Document& doc, const Plan& plan);

}  // namespace ce_overlap
