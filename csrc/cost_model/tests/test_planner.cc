// The planner with the cost model: backends per bucket under config.ce, min_ce_bytes and CE blockers,
// windows in the new order, the summary, and a Plan that check_plan accepts and that round-trips.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "../../graph/tests/plan_builder.h"
#include "cost_model/analyze.h"
#include "cost_model/planner.h"
#include "graph/plan.h"
#include "test_util.h"

namespace ce_overlap {
namespace {

using testing::builtin_profile;
using testing::fsdp_doc;
using testing::FsdpOptions;

// The collective a planned bucket runs (what the planner priced).
CollectiveInfo collective_of(const PlanBucket& b) {
  CollectiveInfo c;
  c.type = b.type;
  c.group = b.group;
  c.group_size = b.group_size;
  c.reduce_op = b.reduce_op;
  c.bytes = b.bytes;
  return c;
}

Document big_fsdp(bool backward) {
  FsdpOptions o;
  o.blocks = 4;
  o.shard_rows = 8192;  // 4 MiB shards, 32 MiB gathered per parameter
  o.matmuls_per_param = 4;
  o.backward = backward;
  return fsdp_doc(o);
}

TEST(Planner, AutoPlanHidesTheAllGathers) {
  const Document doc = big_fsdp(false);
  const CostModel model(builtin_profile("h200-sxm"));
  const Plan plan = make_plan(doc, "forward", model, PlanConfig());
  check_plan(doc, plan);
  EXPECT_EQ(plan.graph, "forward");
  EXPECT_EQ(plan.profile, "h200-sxm");
  EXPECT_EQ(plan.summary.collectives, 4 * 3 + 2);
  EXPECT_EQ(plan.summary.buckets, 6);
  EXPECT_LT(plan.summary.exposed_comm_us_after, plan.summary.exposed_comm_us_before);
  // The makespans are the two timelines' ends: the analysis's step before, shorter after by more or less the
  // exposure removed.
  const double analyzed = analyze(doc, model)["graphs"][0]["makespan_us"].get<double>();
  ASSERT_TRUE(plan.summary.makespan_us_before && plan.summary.makespan_us_after);
  EXPECT_DOUBLE_EQ(*plan.summary.makespan_us_before, analyzed);
  EXPECT_LT(*plan.summary.makespan_us_after, *plan.summary.makespan_us_before);
  EXPECT_GE(*plan.summary.makespan_us_after + 1e-6,
            *plan.summary.makespan_us_before - (plan.summary.exposed_comm_us_before - plan.summary.exposed_comm_us_after));
  EXPECT_GT(plan.summary.plan_ms, 0);
  for (const PlanBucket& b : plan.buckets) {
    EXPECT_EQ(b.reason.rfind(b.backend + ": ", 0), 0u) << b.reason;
    EXPECT_TRUE(b.predicted.ce_us.has_value());
    if (b.block && *b.block >= 1) {
      EXPECT_GT(b.predicted.window_us, 0) << b.id;  // prefetched under the previous block
      EXPECT_EQ(b.block_path, std::optional<std::string>("layers." + std::to_string(*b.block)));
    }
  }
  // Canonical text round-trips.
  const std::string text = save_plan(plan);
  EXPECT_EQ(save_plan(load_plan(text)), text);
}

TEST(Planner, TensorParallelStaysOnNcclAndWhatSharingTheLinkCostsIsNamed) {
  // FSDP x TP (tp_doc): the TP collectives are buckets of their own on NCCL, even with ce "on"; the DP all-gathers go
  // to the copy engines. A DP all-gather large enough to outlast the GEMM it is issued beside runs into the block's
  // TP reduce-scatter: the bucket names it with what each side gained (the same: the link split between them).
  // 8 MiB shards (a ~0.1 ms CE all-gather at 0.6 of the link), GEMMs of ~55 us, TP reduce-scatters of 32 MiB at 0.6.
  const Document doc = testing::tp_doc(3, 16384, 32768, int64_t{40} * 1000 * 1000 * 1000);
  const CostModel model(builtin_profile("h200-sxm"));
  PlanConfig config;
  config.ce = CeMode::On;
  const Plan plan = make_plan(doc, "forward", model, config);
  check_plan(doc, plan);
  int tp = 0, overlapping = 0;
  for (const PlanBucket& b : plan.buckets) {
    if (b.group == "tp") {
      ++tp;
      EXPECT_EQ(b.role, CollectiveRole::TensorParallel);
      EXPECT_EQ(b.backend, "nccl");
      EXPECT_EQ(b.reason.rfind("nccl: tensor-parallel, on its block's critical path", 0), 0u) << b.reason;
      EXPECT_TRUE(b.overlaps.empty());
      continue;
    }
    EXPECT_EQ(b.role, CollectiveRole::DataParallel);
    EXPECT_EQ(b.backend, "ce");
    for (const PlanOverlap& o : b.overlaps) {
      ++overlapping;
      EXPECT_EQ(o.collective.rfind("tp_", 0), 0u) << o.collective;
      EXPECT_GT(o.overlap_us, 0);
      EXPECT_GT(o.collective_added_us, 0);
      EXPECT_LT(o.collective_added_us, o.overlap_us);
      EXPECT_DOUBLE_EQ(o.collective_added_us, o.bucket_added_us);
    }
  }
  EXPECT_EQ(tp, 6);
  EXPECT_GT(overlapping, 0);
  const std::string text = save_plan(plan);
  EXPECT_EQ(save_plan(load_plan(text)), text);
  // Without roles (an IR captured before them) nothing is tensor-parallel: no TP reason, no overlaps.
  Document unnamed = doc;
  for (Node& node : unnamed.graphs[0].nodes) {
    if (node.collective) node.collective->role = CollectiveRole::Unknown;
  }
  for (const PlanBucket& b : make_plan(unnamed, "forward", model, config).buckets) {
    EXPECT_EQ(b.reason.find("tensor-parallel"), std::string::npos) << b.reason;
    EXPECT_TRUE(b.overlaps.empty());
  }
}

TEST(Planner, ACeBucketBesideTensorParallelismIsPacedWhereItsWindowHoldsTheSlowerCopies) {
  // As above, with a 0.5 ms GEMM after each block's TP reduce-scatter: the DP all-gather that ran into the reduce-
  // scatter at full speed has room to copy at the link's rest instead. It is paced (its reason says for which TP
  // collective), and then shares nothing: no overlap priced, the TP collectives no slower than alone.
  const int64_t gemm = int64_t{40} * 1000 * 1000 * 1000;
  const Document doc = testing::tp_doc(3, 16384, 32768, gemm, 10 * gemm);
  const CostModel model(builtin_profile("h200-sxm"));
  PlanConfig config;
  config.ce = CeMode::On;
  const Plan plan = make_plan(doc, "forward", model, config);
  check_plan(doc, plan);
  int paced = 0;
  for (const PlanBucket& b : plan.buckets) {
    if (!b.copy_rate_gbps) continue;
    ++paced;
    EXPECT_EQ(b.backend, "ce");
    EXPECT_NE(b.reason.find("GB/s per peer copy to leave NVLink to tensor-parallel tp_rs_"), std::string::npos)
        << b.reason;
    EXPECT_TRUE(b.overlaps.empty()) << b.reason;
  }
  EXPECT_GT(paced, 0);
  for (const PlanBucket& b : plan.buckets) EXPECT_TRUE(b.overlaps.empty()) << b.id << " " << b.reason;
}

TEST(Planner, CeModesMinBytesAndBlockers) {
  const Document doc = big_fsdp(true);
  const CostModel model(builtin_profile("h200-sxm"));
  PlanConfig off;
  off.ce = CeMode::Off;
  for (const PlanBucket& b : make_plan(doc, "backward", model, off).buckets) {
    EXPECT_EQ(b.backend, "nccl");
    EXPECT_EQ(b.reason, "nccl: config.ce is off");
  }
  PlanConfig on;
  on.ce = CeMode::On;
  on.min_ce_bytes = 0;
  const Plan forced = make_plan(doc, "backward", model, on);
  EXPECT_EQ(forced.summary.ce_buckets, forced.summary.buckets);
  for (const PlanBucket& b : forced.buckets) EXPECT_EQ(b.backend, "ce") << b.reason;

  PlanConfig big_min;
  big_min.min_ce_bytes = int64_t{1} << 40;
  for (const PlanBucket& b : make_plan(doc, "backward", model, big_min).buckets) {
    EXPECT_EQ(b.backend, "nccl");
    EXPECT_NE(b.reason.find("is under min_ce_bytes (1 TiB)"), std::string::npos) << b.reason;
  }

  // A group of 1 moves no data: NCCL under auto; "on" forces the runtime's self copy (one GPU runs the CE path).
  Document single = doc;
  for (Node& n : single.graphs[0].nodes) {
    if (n.collective) n.collective->group_size = 1;
  }
  for (const PlanBucket& b : make_plan(single, "backward", model, PlanConfig{}).buckets) {
    EXPECT_EQ(b.backend, "nccl");
    EXPECT_EQ(b.reason, "nccl: a group of 1 moves no data");
  }
  const Plan single_on = make_plan(single, "backward", model, on);
  check_plan(single, single_on);
  for (const PlanBucket& b : single_on.buckets) {
    EXPECT_EQ(b.backend, "ce") << b.reason;
    EXPECT_EQ(b.reason, "ce: config.ce is on (the cost model prefers nccl: a group of 1 moves no data)");
  }

  // A group of 16 spans two 8-GPU nodes: never CE. With ce on, the hierarchical choice (copy engines inside each
  // node) where it serves: the all-gathers and reduce-scatters; a group of 12 (not as many ranks on each of 2 nodes)
  // stays on NCCL with the blocker.
  Document wide = doc;
  for (Node& n : wide.graphs[0].nodes) {
    if (n.collective) n.collective->group_size = 16;
  }
  const Plan p = make_plan(wide, "backward", model, on);
  check_plan(wide, p);
  for (const PlanBucket& b : p.buckets) {
    EXPECT_FALSE(b.predicted.ce_us.has_value());
    if (b.type == CollectiveType::AllGather || b.type == CollectiveType::ReduceScatter) {
      EXPECT_EQ(b.backend, "hier") << b.reason;
      EXPECT_TRUE(b.predicted.hier_us.has_value());
      EXPECT_TRUE(b.reason.rfind("hier: ", 0) == 0) << b.reason;
    } else {
      EXPECT_EQ(b.backend, "nccl");
    }
  }
  for (Node& n : wide.graphs[0].nodes) {
    if (n.collective) n.collective->group_size = 12;
  }
  const Plan uneven = make_plan(wide, "backward", model, on);
  for (const PlanBucket& b : uneven.buckets) {
    EXPECT_EQ(b.backend, "nccl");
    EXPECT_EQ(b.reason, "nccl: group spans 2 nodes; CE needs one NVLink domain");
    EXPECT_FALSE(b.predicted.ce_us.has_value() || b.predicted.hier_us.has_value());
  }
}

TEST(Planner, DecisionUsesTheBucketAndItsWindow) {
  const Document doc = big_fsdp(false);
  const CostModel model(builtin_profile("h200-sxm"));
  const Plan plan = make_plan(doc, "forward", model, PlanConfig());
  const Graph& g = doc.graphs[0];
  std::map<std::string, int> id;
  for (const Node& n : g.nodes) id[n.name] = n.id;
  std::map<std::string, size_t> pos;
  for (size_t i = 0; i < plan.order.size(); ++i) pos[plan.order[i]] = i;
  const std::vector<double> durations = model.durations_us(g);  // fusion and the gap between kernels included
  for (const PlanBucket& b : plan.buckets) {
    // The window: compute strictly between the last member collective and the first member wait.
    size_t last_c = 0, first_w = plan.order.size();
    for (const PlanMember& m : b.members) {
      last_c = std::max(last_c, pos[m.collective]);
      first_w = std::min(first_w, pos[*m.wait]);
    }
    OverlapWindow w;
    for (size_t i = last_c + 1; i < first_w; ++i) {
      const Node& n = g.nodes[id[plan.order[i]]];
      if (n.kind != NodeKind::Compute) continue;
      (model.compute_bound(n) ? w.compute_bound_us : w.memory_bound_us) += durations[static_cast<size_t>(n.id)];
    }
    EXPECT_NEAR(w.compute_bound_us + w.memory_bound_us, b.predicted.window_us, 1e-9 * (1 + b.predicted.window_us));
    const Decision d = model.decide(collective_of(b), w);
    EXPECT_NEAR(d.nccl.cost_us, b.predicted.nccl_cost_us, 1e-6 * (1 + d.nccl.cost_us)) << b.id;
    EXPECT_NEAR(d.ce->cost_us, *b.predicted.ce_cost_us, 1e-6 * (1 + d.ce->cost_us)) << b.id;
    EXPECT_EQ(to_string(d.choice), b.backend);
    EXPECT_EQ(d.reason, b.reason);
  }
}

TEST(Planner, RejectsUnknownGraphAndBadConfig) {
  const Document doc = big_fsdp(false);
  const CostModel model(builtin_profile("h200-sxm"));
  try {
    make_plan(doc, "backward", model, PlanConfig());
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "graph: no graph named \"backward\" in the IR (it has: forward)");
  }
  try {
    plan_config_from_json(nlohmann::json{{"prefetch_blocks", -1}});
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "config.prefetch_blocks: expected an integer in 0..1024, got -1");
  }
  const PlanConfig c = plan_config_from_json(nlohmann::json::object());
  EXPECT_EQ(plan_config_to_json(c),
            (nlohmann::json{{"bucket_cap_bytes", 536870912}, {"memory_budget_bytes", 4294967296},
                            {"ce", "auto"}, {"min_ce_bytes", 1048576}, {"prefetch_blocks", 1},
                            {"bucket_patterns", nlohmann::json::array()}, {"ce_reduction", "consumer"},
                            {"ce_collectives", {"all_gather", "reduce_scatter"}}, {"copy_pace_fill", 0.0},
                            {"keep_order", false}}));
  EXPECT_EQ(plan_config_from_json(nlohmann::json{{"ce_reduction", "kernel"}}).ce_reduction, CeReduction::Kernel);
  try {
    plan_config_from_json(nlohmann::json{{"ce_reduction", "sm"}});
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "config.ce_reduction: expected \"consumer\" or \"kernel\", got \"sm\"");
  }
}

TEST(Planner, CeReduceScatterPricedTheWayThePassRunsIt) {
  // The backward's reduce-scatters on CE: with the sum in the consumer no bucket's CE estimate holds SMs, and its
  // cost carries the consumer's extra read; with the kernel, the reduction phases hold the kernel's SMs.
  const Document doc = big_fsdp(true);
  const CostModel model(builtin_profile("h200-sxm"));
  PlanConfig on;
  on.ce = CeMode::On;
  for (CeReduction where : {CeReduction::Consumer, CeReduction::Kernel}) {
    on.ce_reduction = where;
    const Plan plan = make_plan(doc, "backward", model, on);
    EXPECT_EQ(plan_config_to_json(plan.config)["ce_reduction"], to_string(where));
    CostModel priced = model;
    priced.set_ce_reduction(where);
    int reduce_scatters = 0;
    for (const PlanBucket& b : plan.buckets) {
      if (b.type != CollectiveType::ReduceScatter || b.backend != "ce") continue;
      ++reduce_scatters;
      const CollectiveEstimate e = priced.estimate(collective_of(b), Backend::Ce);
      EXPECT_GE(*b.predicted.ce_us, e.us - 1e-6) << b.id;  // the time alone, stretched beside its window
      EXPECT_GE(*b.predicted.ce_cost_us, e.consumer_us - 1e-6) << b.id;
      int sms = 0;
      for (const CollectivePhase& ph : e.phases) sms = std::max(sms, ph.sms);
      if (where == CeReduction::Consumer) {
        EXPECT_EQ(sms, 0) << b.id;
        EXPECT_GT(e.consumer_us, 0) << b.id;
      } else {
        EXPECT_GT(sms, 0) << b.id;
        EXPECT_EQ(e.consumer_us, 0) << b.id;
      }
    }
    EXPECT_GT(reduce_scatters, 0);
  }
}

TEST(Planner, CeCollectivesKeepExcludedTypesOnNcclAndPriceThemSo) {
  // config.ce_collectives reaches the planner: with only all-gathers allowed, every reduce-scatter bucket is planned on
  // NCCL (so the summary is what the pass will apply), and the plan says why.
  const Document doc = big_fsdp(true);
  const CostModel model(builtin_profile("h200-sxm"));
  PlanConfig on;
  on.ce = CeMode::On;
  on.ce_collectives = {CollectiveType::AllGather};
  const Plan plan = make_plan(doc, "backward", model, on);
  int all_gathers_on_ce = 0, reduce_scatters = 0, ce_buckets = 0;
  for (const PlanBucket& b : plan.buckets) {
    ce_buckets += b.backend == "ce";
    if (b.type == CollectiveType::AllGather && b.backend == "ce") ++all_gathers_on_ce;
    if (b.type != CollectiveType::ReduceScatter) continue;
    ++reduce_scatters;
    EXPECT_EQ(b.backend, "nccl") << b.id;
    EXPECT_EQ(b.reason, "nccl: config.ce_collectives excludes reduce_scatter") << b.id;
  }
  EXPECT_GT(reduce_scatters, 0);
  EXPECT_GT(all_gathers_on_ce, 0);
  EXPECT_EQ(plan.summary.ce_buckets, ce_buckets);
  // Written where not the default, and read back the same (ce_reduction too: it was dropped on save before).
  on.ce_reduction = CeReduction::Kernel;
  const std::string text = save_plan(make_plan(doc, "backward", model, on));
  const Plan back = load_plan(text);
  EXPECT_EQ(back.config.ce_collectives, std::vector<CollectiveType>{CollectiveType::AllGather});
  EXPECT_EQ(back.config.ce_reduction, CeReduction::Kernel);
  EXPECT_EQ(save_plan(back), text);
  EXPECT_NE(text.find("\"ce_collectives\": [\"all_gather\"]"), std::string::npos);
  // The default is not written (plans from before the key read back byte for byte).
  EXPECT_EQ(save_plan(make_plan(doc, "backward", model, PlanConfig())).find("ce_collectives"), std::string::npos);
  for (const auto& [config, message] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"ce_collectives", {"all_reduce"}}},
            "config.ce_collectives[0]: expected \"all_gather\" or \"reduce_scatter\" (the types CE serves), got "
            "\"all_reduce\""},
           {{{"ce_collectives", {"all_gather", "all_gather"}}}, "config.ce_collectives[1]: \"all_gather\" is listed twice"},
           {{{"ce_collectives", "all_gather"}}, "config.ce_collectives: expected an array of collective types, got \"all_gather\""}}) {
    try {
      plan_config_from_json(config);
      FAIL() << config;
    } catch (const IrError& e) {
      EXPECT_EQ(e.what(), message);
    }
  }
}

TEST(Planner, PacedBucketsFillTheirWindowAndOnlyCeBucketsArePaced) {
  // config.copy_pace_fill: a CE bucket whose copies take less than that share of its slot gets the rate that
  // stretches them to it (per peer copy: an all-gather's whole input, a reduce-scatter's 1/n), never under 10 GB/s;
  // a bucket without a window, or on NCCL, is not paced. 0 paces nothing.
  const CostModel model(builtin_profile("h200-sxm"));
  PlanConfig on;
  on.ce = CeMode::On;
  for (bool backward : {false, true}) {
    const Document doc = big_fsdp(backward);
    const std::string graph = backward ? "backward" : "forward";
    for (const PlanBucket& b : make_plan(doc, graph, model, on).buckets) EXPECT_FALSE(b.copy_rate_gbps) << b.id;
    on.copy_pace_fill = 0.5;
    const Plan plan = make_plan(doc, graph, model, on);
    check_plan(doc, plan);
    int paced = 0;
    for (const PlanBucket& b : plan.buckets) {
      if (!b.copy_rate_gbps) continue;
      ++paced;
      EXPECT_EQ(b.backend, "ce");
      EXPECT_GE(*b.copy_rate_gbps, 10.0);
      const double copy = b.type == CollectiveType::ReduceScatter ? double(b.bytes) / b.group_size : double(b.bytes);
      const double stretched_us = copy / *b.copy_rate_gbps / 1e3;
      EXPECT_GT(stretched_us, *b.predicted.ce_us * 0.5) << b.id;                   // slower than unpaced
      EXPECT_LE(stretched_us, 0.5 * b.predicted.window_us + 1e-6) << b.id;        // within the fill
      EXPECT_NE(b.reason.find("% of its slot"), std::string::npos) << b.reason;
    }
    EXPECT_GT(paced, 0) << graph;
    const std::string text = save_plan(plan);
    EXPECT_NE(text.find("\"copy_pace_fill\": 0.5"), std::string::npos);
    EXPECT_EQ(save_plan(load_plan(text)), text);
    on.copy_pace_fill = 0;
  }
  // A rate on an NCCL bucket breaks a rule; a bad fill or rate is a schema error naming the field.
  const Document doc = big_fsdp(false);
  Plan plan = make_plan(doc, "forward", model, PlanConfig());
  PlanBucket* nccl = nullptr;
  for (PlanBucket& b : plan.buckets) {
    if (b.backend == "nccl") nccl = &b;
  }
  if (nccl) {
    nccl->copy_rate_gbps = 100;
    try {
      validate_plan(plan);
      FAIL();
    } catch (const PlanRuleError& e) {
      EXPECT_EQ(e.rule(), "bucket.copy_rate");
    }
  }
  for (const auto& [config, message] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"copy_pace_fill", 1.5}}, "config.copy_pace_fill: expected a number in 0..1 (0: no pacing), got 1.5"},
           {{{"copy_pace_fill", "half"}}, "config.copy_pace_fill: expected a number in 0..1 (0: no pacing), got \"half\""}}) {
    try {
      plan_config_from_json(config);
      FAIL() << config;
    } catch (const IrError& e) {
      EXPECT_EQ(e.what(), message);
    }
  }
}

TEST(Planner, KeepOrderPricesTheCapturedOrderCollectiveByCollective) {
  // config.keep_order (how step_model prices an order another scheduler made): every collective a bucket of its own,
  // the order the captured one, each window what the capture put between the collective and its wait; the sum of
  // the buckets' NCCL time is what the collectives cost alone or beside that compute, so never less exposure than a
  // plan that moves them. The key round-trips, and only `true` or `false` is read.
  const CostModel model(builtin_profile("h200-sxm"));
  for (bool backward : {false, true}) {
    const Document doc = big_fsdp(backward);
    const std::string graph = backward ? "backward" : "forward";
    const Graph& g = find_graph(doc, graph);
    PlanConfig keep;
    keep.ce = CeMode::Off;
    keep.keep_order = true;
    const Plan kept = make_plan(doc, graph, model, keep);
    check_plan(doc, kept);
    int64_t collectives = 0;
    for (const Node& n : g.nodes) collectives += n.kind == NodeKind::Collective;
    ASSERT_EQ(static_cast<int64_t>(kept.buckets.size()), collectives);
    ASSERT_EQ(kept.order.size(), g.nodes.size());
    for (size_t i = 0; i < g.nodes.size(); ++i) EXPECT_EQ(kept.order[i], g.nodes[i].name);
    for (const PlanBucket& b : kept.buckets) {
      EXPECT_EQ(b.members.size(), 1u);
      EXPECT_EQ(b.backend, "nccl");
      EXPECT_NE(b.reason.find("captured order kept (config.keep_order)"), std::string::npos) << b.reason;
    }
    EXPECT_EQ(kept.summary.peak_memory_bytes_after, kept.summary.peak_memory_bytes_before);
    PlanConfig moved;
    moved.ce = CeMode::Off;
    EXPECT_GE(kept.summary.exposed_comm_us_after, make_plan(doc, graph, model, moved).summary.exposed_comm_us_after);
    const std::string text = save_plan(kept);
    EXPECT_NE(text.find("\"keep_order\": true"), std::string::npos);
    EXPECT_EQ(save_plan(load_plan(text)), text);
  }
  try {
    plan_config_from_json(nlohmann::json{{"keep_order", 1}});
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "config.keep_order: expected true or false, got 1");
  }
}

}  // namespace
}  // namespace ce_overlap
