// Internal to csrc/graph: the pieces of the Plan's rules (docs/plan.md) that need no graph, shared by
// validate_plan (plan_validate.cc) and check_plan (plan_check.cc), which run them in different orders, and the
// path and message helpers of the Plan's reader (plan_json.cc). Every failure is a PlanRuleError.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "plan.h"

namespace ce_overlap::plan_rules {

inline constexpr int64_t kMaxBytes = int64_t{1} << 50;
inline constexpr int64_t kMaxBudget = int64_t{1} << 62;
inline constexpr int kMaxPrefetch = 1024;

// A JSON value (or string) as it appears in messages: quoted, cut at 60 characters.
std::string describe(const nlohmann::json& v);
std::string json_quoted(const std::string& s);
std::string at(const std::string& path, const char* key);
std::string at(const std::string& path, size_t i);
// The node of a bucket-level rule: "bucket 3".
std::string bucket_node(size_t index);

// Throws PlanRuleError(rule, node, path + ": " + message).
[[noreturn]] void fail(const char* rule, const std::optional<std::string>& node, const std::string& path,
                       const std::string& message);
// A malformed field (rule "schema"); the node is "buckets[<i>]" for a field inside bucket i, else none.
[[noreturn]] void fail_schema(const std::string& path, const std::string& message);

void check_pattern(const std::string& pattern, const std::string& path);  // a bucket pattern compiles

// Position in `order` of every name it lists.
using Positions = std::unordered_map<std::string_view, size_t>;

void check_header(const Plan& plan);              // graph, profile, config ("schema")
Positions check_order_names(const Plan& plan);    // non-empty and unique ("order.complete")
// id equals the position, block, block_path, at least one member ("bucket.members"), member fields ("schema").
void check_bucket_fields(const PlanBucket& b, size_t index);
void check_bucket_backend(const PlanBucket& b, size_t index);    // "bucket.backend", "bucket.reason"
void check_bucket_reduce_op(const PlanBucket& b, size_t index);  // reduce_op fits the type ("schema")
void check_bucket_predicted(const PlanBucket& b, size_t index);  // "bucket.predicted"
// The sum of the members' bytes ("bucket.bytes"), the cap for a bucket of several ("bucket.cap").
void check_bucket_bytes(const PlanBucket& b, size_t index, const PlanConfig& config);
// In `order` (every member's collective and wait must be in `position`): member collectives contiguous, member
// waits contiguous, the waits after the last member collective.
void check_bucket_order(const Plan& plan, size_t index, const Positions& position);
// Counts ("summary.counts"), the memory budget ("summary.memory_budget"), times and peaks ("schema").
void check_summary(const Plan& plan);

}  // namespace ce_overlap::plan_rules
