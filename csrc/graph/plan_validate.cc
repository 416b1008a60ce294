// The Plan's rules that need no graph (docs/plan.md "Rules"): validate_plan, run by every load and save, and
// the pieces check_plan (plan_check.cc) runs in its own order. Each failure names its rule (PlanRuleError).
#include <algorithm>
#include <climits>
#include <cmath>

#include "plan.h"
#include "plan_rules.h"

namespace ce_overlap {
namespace plan_rules {
namespace {

constexpr const char* kReduceOps[] = {"sum", "avg", "max", "min", "product"};

bool reduces(CollectiveType t) { return t == CollectiveType::ReduceScatter || t == CollectiveType::AllReduce; }

void validate_config(const PlanConfig& c, const std::string& path) {
  if (c.bucket_cap_bytes < 1 || c.bucket_cap_bytes > kMaxBytes) {
    fail_schema(at(path, "bucket_cap_bytes"),
                "expected an integer in 1..2^50, got " + std::to_string(c.bucket_cap_bytes));
  }
  if (c.memory_budget_bytes < 0 || c.memory_budget_bytes > kMaxBudget) {
    fail_schema(at(path, "memory_budget_bytes"),
                "expected an integer in 0..2^62, got " + std::to_string(c.memory_budget_bytes));
  }
  if (c.min_ce_bytes < 0 || c.min_ce_bytes > kMaxBytes) {
    fail_schema(at(path, "min_ce_bytes"), "expected an integer in 0..2^50, got " + std::to_string(c.min_ce_bytes));
  }
  if (c.prefetch_blocks < 0 || c.prefetch_blocks > kMaxPrefetch) {
    fail_schema(at(path, "prefetch_blocks"),
                "expected an integer in 0..1024, got " + std::to_string(c.prefetch_blocks));
  }
  for (size_t i = 0; i < c.ce_collectives.size(); ++i) {
    const CollectiveType t = c.ce_collectives[i];
    const bool served = std::find(std::begin(kCeCollectiveTypes), std::end(kCeCollectiveTypes), t) !=
                        std::end(kCeCollectiveTypes);
    if (!served) fail_schema(at(at(path, "ce_collectives"), i), "expected \"all_gather\" or \"reduce_scatter\"");
    if (std::find(c.ce_collectives.begin(), c.ce_collectives.begin() + i, t) != c.ce_collectives.begin() + i) {
      fail_schema(at(at(path, "ce_collectives"), i), std::string("\"") + to_string(t) + "\" is listed twice");
    }
  }
  if (!(c.copy_pace_fill >= 0 && c.copy_pace_fill <= 1)) {
    fail_schema(at(path, "copy_pace_fill"), "expected a number in 0..1 (0: no pacing), got " +
                                                std::to_string(c.copy_pace_fill));
  }
  try {
    (void)to_string(c.ce);
    (void)to_string(c.ce_reduction);
  } catch (const IrError& e) {
    fail_schema(path, e.what());
  }
  for (size_t i = 0; i < c.bucket_patterns.size(); ++i) {
    check_pattern(c.bucket_patterns[i], at(at(path, "bucket_patterns"), i));
  }
}

// The first position in [first, last] of `order` that `taken` does not hold: the node that splits a run.
std::string gap_in(const Plan& plan, size_t first, size_t last, const std::vector<char>& taken) {
  for (size_t p = first; p <= last; ++p) {
    if (!taken[p - first]) return plan.order[p];
  }
  return plan.order[first];
}

}  // namespace

void check_header(const Plan& plan) {
  if (plan.graph.empty()) fail_schema("graph", "expected a non-empty string");
  if (plan.profile.empty()) fail_schema("profile", "expected a non-empty string");
  validate_config(plan.config, "config");
}

Positions check_order_names(const Plan& plan) {
  Positions position;
  position.reserve(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) {
    if (plan.order[i].empty()) fail("order.complete", std::nullopt, at("order", i), "expected a non-empty node name");
    auto [it, inserted] = position.emplace(plan.order[i], i);
    if (!inserted) {
      fail("order.complete", plan.order[i], at("order", i),
           json_quoted(plan.order[i]) + " appears twice (also order[" + std::to_string(it->second) + "])");
    }
  }
  return position;
}

void check_bucket_fields(const PlanBucket& b, size_t index) {
  const std::string path = at("buckets", index);
  if (b.id != static_cast<int>(index)) {
    fail_schema(at(path, "id"),
                "expected " + std::to_string(index) + " (ids equal the position), got " + std::to_string(b.id));
  }
  try {
    (void)to_string(b.type);
  } catch (const IrError& e) {
    fail_schema(at(path, "type"), e.what());
  }
  if (b.block && *b.block < 0) {
    fail_schema(at(path, "block"), "expected null or a block id >= 0, got " + std::to_string(*b.block));
  }
  if (b.block_path && b.block_path->empty()) fail_schema(at(path, "block_path"), "expected null or a non-empty string");
  if (b.group.empty()) fail_schema(at(path, "group"), "expected a non-empty string");
  if (b.group_size < 1 || b.group_size > 65536) {
    fail_schema(at(path, "group_size"), "expected an integer in 1..65536, got " + std::to_string(b.group_size));
  }
  if (b.dtype) {
    try {
      dtype_itemsize(*b.dtype);
    } catch (const IrError& e) {
      fail_schema(at(path, "dtype"), e.what());
    }
  }
  const std::string members_path = at(path, "members");
  if (b.members.empty()) fail("bucket.members", bucket_node(index), members_path, "expected at least one member");
  for (size_t k = 0; k < b.members.size(); ++k) {
    const PlanMember& m = b.members[k];
    const std::string mpath = at(members_path, k);
    if (m.collective.empty()) fail_schema(at(mpath, "collective"), "expected a non-empty string");
    if (m.wait && m.wait->empty()) fail_schema(at(mpath, "wait"), "expected null or a non-empty string");
    if (m.bytes < 0 || m.bytes > kMaxBytes) {
      fail_schema(at(mpath, "bytes"), "expected an integer in 0..2^50, got " + std::to_string(m.bytes));
    }
  }
}

void check_bucket_backend(const PlanBucket& b, size_t index) {
  const std::string path = at("buckets", index);
  if (b.backend != "nccl" && b.backend != "ce" && b.backend != "hier") {
    fail("bucket.backend", bucket_node(index), at(path, "backend"),
         "expected \"nccl\", \"ce\" or \"hier\", got " + json_quoted(b.backend));
  }
  if (b.reason.rfind(b.backend + ": ", 0) != 0) {
    fail("bucket.reason", bucket_node(index), at(path, "reason"),
         "expected one line starting with \"" + b.backend + ": \", got " + json_quoted(b.reason));
  }
  if (b.reason.find_first_of("\r\n") != std::string::npos) {
    fail("bucket.reason", bucket_node(index), at(path, "reason"), "expected one line");
  }
  if (b.copy_rate_gbps) {
    if (!(std::isfinite(*b.copy_rate_gbps) && *b.copy_rate_gbps > 0)) {
      fail_schema(at(path, "copy_rate_gbps"), "expected a positive number of GB/s, got " +
                                                  std::to_string(*b.copy_rate_gbps));
    }
    if (b.backend != "ce") {
      fail("bucket.copy_rate", bucket_node(index), at(path, "copy_rate_gbps"),
           "only a CE bucket has a copy rate (this one runs on " + b.backend + ")");
    }
  }
}

void check_bucket_reduce_op(const PlanBucket& b, size_t index) {
  const std::string path = at(at("buckets", index), "reduce_op");
  const char* type_name = to_string(b.type);
  if (reduces(b.type)) {
    bool known = false;
    for (const char* op : kReduceOps) known = known || (b.reduce_op && *b.reduce_op == op);
    if (!known) {
      fail_schema(path, std::string("expected one of sum, avg, max, min, product for ") + type_name + ", got " +
                            (b.reduce_op ? json_quoted(*b.reduce_op) : std::string("null")));
    }
  } else if (b.reduce_op) {
    fail_schema(path, std::string("must be null for ") + type_name + ", got " + json_quoted(*b.reduce_op));
  }
}

void check_bucket_predicted(const PlanBucket& b, size_t index) {
  const std::string path = at(at("buckets", index), "predicted");
  const PlanPrediction& p = b.predicted;
  auto check_us = [&](double us, const char* key) {
    if (!std::isfinite(us) || us < 0) {
      fail("bucket.predicted", bucket_node(index), at(path, key), "expected a non-negative number of microseconds");
    }
  };
  check_us(p.nccl_us, "nccl_us");
  check_us(p.window_us, "window_us");
  check_us(p.nccl_cost_us, "nccl_cost_us");
  check_us(p.exposed_us, "exposed_us");
  if (p.ce_us) check_us(*p.ce_us, "ce_us");
  if (p.ce_cost_us) check_us(*p.ce_cost_us, "ce_cost_us");
  if (p.ce_us.has_value() != p.ce_cost_us.has_value()) {
    fail("bucket.predicted", bucket_node(index), at(path, "ce_cost_us"),
         "must be null exactly when ce_us is (CE cannot serve the group)");
  }
  if (b.backend == "ce" && !p.ce_us) {
    fail("bucket.predicted", bucket_node(index), at(path, "ce_us"), "a bucket on CE needs a CE prediction, got null");
  }
  if (p.hier_us) check_us(*p.hier_us, "hier_us");
  if (p.hier_cost_us) check_us(*p.hier_cost_us, "hier_cost_us");
  if (p.hier_us.has_value() != p.hier_cost_us.has_value()) {
    fail("bucket.predicted", bucket_node(index), at(path, "hier_cost_us"), "must be given exactly when hier_us is");
  }
  if (b.backend == "hier" && !p.hier_us) {
    fail("bucket.predicted", bucket_node(index), at(path, "hier_us"),
         "a hierarchical bucket needs a hierarchical prediction, got none");
  }
  if (b.backend == "hier" && b.type != CollectiveType::AllGather && b.type != CollectiveType::ReduceScatter) {
    fail("bucket.backend", bucket_node(index), at(path, "backend"),
         std::string("hierarchical buckets are all-gathers or reduce-scatters, this one is ") + to_string(b.type));
  }
  for (size_t k = 0; k < b.overlaps.size(); ++k) {
    const PlanOverlap& o = b.overlaps[k];
    const std::string opath = at(at(at("buckets", index), "overlaps"), k);
    for (const auto& [us, key] : {std::pair{o.overlap_us, "overlap_us"}, std::pair{o.collective_added_us,
                                  "collective_added_us"}, std::pair{o.bucket_added_us, "bucket_added_us"}}) {
      if (!std::isfinite(us) || us < 0) {
        fail("bucket.overlaps", bucket_node(index), at(opath, key), "expected a non-negative number of microseconds");
      }
    }
  }
}

void check_bucket_bytes(const PlanBucket& b, size_t index, const PlanConfig& config) {
  const std::string path = at(at("buckets", index), "bytes");
  int64_t sum = 0;
  for (const PlanMember& m : b.members) sum += m.bytes;
  if (b.bytes != sum) {
    fail("bucket.bytes", bucket_node(index), path,
         "expected the sum of the members' bytes, " + std::to_string(sum) + ", got " + std::to_string(b.bytes));
  }
  if (b.members.size() > 1 && b.bytes > config.bucket_cap_bytes) {
    fail("bucket.cap", bucket_node(index), path,
         std::to_string(b.bytes) + " exceeds config.bucket_cap_bytes = " + std::to_string(config.bucket_cap_bytes) +
             " (only a single collective may)");
  }
}

void check_bucket_order(const Plan& plan, size_t index, const Positions& position) {
  const PlanBucket& b = plan.buckets[index];
  const std::string path = at(at("buckets", index), "members");
  std::vector<size_t> collectives, waits;
  for (const PlanMember& m : b.members) {
    collectives.push_back(position.at(m.collective));
    if (m.wait) waits.push_back(position.at(*m.wait));
  }
  std::sort(collectives.begin(), collectives.end());
  std::sort(waits.begin(), waits.end());
  // A run of positions is contiguous when it spans exactly as many entries as it has.
  auto split_by = [&](const std::vector<size_t>& run) -> std::optional<std::string> {
    if (run.empty() || run.back() - run.front() + 1 == run.size()) return std::nullopt;
    std::vector<char> taken(run.back() - run.front() + 1, 0);
    for (size_t p : run) taken[p - run.front()] = 1;
    return gap_in(plan, run.front(), run.back(), taken);
  };
  if (auto gap = split_by(collectives)) {
    fail("order.bucket_collectives_contiguous", gap, path,
         "member collectives are not contiguous in order (they span order[" + std::to_string(collectives.front()) +
             "..." + std::to_string(collectives.back()) + "], split by " + json_quoted(*gap) + ")");
  }
  if (auto gap = split_by(waits)) {
    fail("order.bucket_waits_contiguous", gap, path,
         "member waits are not contiguous in order (they span order[" + std::to_string(waits.front()) + "..." +
             std::to_string(waits.back()) + "], split by " + json_quoted(*gap) + ")");
  }
  if (!waits.empty() && waits.front() < collectives.back()) {
    fail("order.bucket_waits_after_collectives", plan.order[waits.front()], path,
         "a member wait (order[" + std::to_string(waits.front()) + "]) comes before the last member collective (order[" +
             std::to_string(collectives.back()) + "])");
  }
}

void check_summary(const Plan& plan) {
  int64_t members = 0, ce_buckets = 0;
  for (const PlanBucket& b : plan.buckets) {
    members += static_cast<int64_t>(b.members.size());
    ce_buckets += b.backend == "ce";
  }
  const PlanSummary& s = plan.summary;
  if (s.collectives != members) {
    fail("summary.counts", std::nullopt, "summary.collectives",
         "expected " + std::to_string(members) + " (the members of all buckets), got " + std::to_string(s.collectives));
  }
  if (s.buckets != static_cast<int64_t>(plan.buckets.size())) {
    fail("summary.counts", std::nullopt, "summary.buckets",
         "expected " + std::to_string(plan.buckets.size()) + ", got " + std::to_string(s.buckets));
  }
  if (s.ce_buckets != ce_buckets) {
    fail("summary.counts", std::nullopt, "summary.ce_buckets",
         "expected " + std::to_string(ce_buckets) + " (buckets on ce), got " + std::to_string(s.ce_buckets));
  }
  for (double us : {s.exposed_comm_us_before, s.exposed_comm_us_after, s.plan_ms, s.makespan_us_before.value_or(0.0),
                    s.makespan_us_after.value_or(0.0)}) {
    if (!std::isfinite(us) || us < 0) fail_schema("summary", "times must be finite and non-negative");
  }
  if (s.peak_memory_bytes_before < 0 || s.peak_memory_bytes_after < 0) {
    fail_schema("summary", "peak memory must be non-negative");
  }
  if (s.memory_budget_bytes != plan.config.memory_budget_bytes) {
    fail("summary.memory_budget", std::nullopt, "summary.memory_budget_bytes",
         "expected config.memory_budget_bytes = " + std::to_string(plan.config.memory_budget_bytes) + ", got " +
             std::to_string(s.memory_budget_bytes));
  }
  if (s.peak_memory_bytes_after - s.peak_memory_bytes_before > s.memory_budget_bytes) {
    fail("summary.memory_budget", std::nullopt, "summary.peak_memory_bytes_after",
         std::to_string(s.peak_memory_bytes_after) + " exceeds peak_memory_bytes_before + memory_budget_bytes = " +
             std::to_string(s.peak_memory_bytes_before) + " + " + std::to_string(s.memory_budget_bytes));
  }
}

}  // namespace plan_rules

void validate_plan(const Plan& plan) {
  using namespace plan_rules;
  check_header(plan);
  const Positions position = check_order_names(plan);
  std::unordered_map<std::string_view, std::string> owner;  // collective or wait name -> where it is listed
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    const PlanBucket& b = plan.buckets[i];
    check_bucket_fields(b, i);
    check_bucket_reduce_op(b, i);
    check_bucket_bytes(b, i, plan.config);
    check_bucket_backend(b, i);
    check_bucket_predicted(b, i);
    // Every name listed once, and in `order`.
    for (size_t k = 0; k < b.members.size(); ++k) {
      const PlanMember& m = b.members[k];
      const std::string mpath = at(at(at("buckets", i), "members"), k);
      for (const std::string* name : {&m.collective, m.wait ? &*m.wait : nullptr}) {
        if (!name) continue;
        const bool is_wait = name != &m.collective;
        const char* rule = is_wait ? "bucket.wait" : "bucket.coverage";
        const std::string field = at(mpath, is_wait ? "wait" : "collective");
        auto [it, inserted] = owner.emplace(*name, field);
        if (!inserted) fail(rule, m.collective, field, json_quoted(*name) + " is listed twice (also " + it->second + ")");
        if (!position.count(*name)) fail(rule, m.collective, field, json_quoted(*name) + " is not in order");
      }
    }
    check_bucket_order(plan, i, position);
  }
  check_summary(plan);
}

}  // namespace ce_overlap
