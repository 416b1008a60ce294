// The planner's graph side: bucketing keys and the cap, bucket patterns, the scheduler's order on
// FSDP-like and random graphs (every rule of docs/plan.md checked with check_plan), the memory
// budget, and Plan JSON loading, saving and validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "graph/analysis.h"
#include "graph/bucketing.h"
#include "graph/plan.h"
#include "graph/schedule.h"
#include "graph_builder.h"
#include "plan_builder.h"

namespace ce_overlap {
namespace {

using testing::fsdp_doc;
using testing::FsdpOptions;
using testing::functional_collective;
using testing::GraphBuilder;
using testing::make_doc;
using testing::plan_of;
using testing::random_doc;
using testing::set_block;
using testing::tensor;
using testing::tp_doc;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const IrError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> member_names(const Graph& g, const Bucket& b) {
  std::vector<std::string> out;
  for (int m : b.members) out.push_back(g.nodes[m].name);
  return out;
}

int id_of(const Graph& g, const std::string& name) {
  for (const Node& n : g.nodes) {
    if (n.name == name) return n.id;
  }
  ADD_FAILURE() << "no node " << name;
  return -1;
}

// Schedules, builds the plan and checks every rule; returns the schedule.
Schedule plan_and_check(const Document& doc, const PlanConfig& config = PlanConfig()) {
  const Graph& g = doc.graphs[0];
  Schedule s = schedule_graph(g, bucket_collectives(g, doc.blocks, config), config);
  check_plan(doc, plan_of(doc, g, s, config));
  return s;
}

// ---- bucketing ----

TEST(Bucketing, OneBucketPerBlockAndType) {
  FsdpOptions o;
  o.backward = true;
  const Document doc = fsdp_doc(o);
  const Graph& g = doc.graphs[0];
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, PlanConfig());
  // emb, then per block an all-gather and a reduce-scatter bucket, then the output projection.
  ASSERT_EQ(bs.size(), 2u + 2u * 3u);
  EXPECT_EQ(member_names(g, bs[0]), std::vector<std::string>{"ag_emb"});
  EXPECT_EQ(bs[0].scope, BucketScope::Outside);
  EXPECT_EQ(bs[0].block, -1);
  for (int l = 0; l < 3; ++l) {
    const Bucket& ag = bs[1 + 2 * l];
    const Bucket& rs = bs[2 + 2 * l];
    const std::string p = std::to_string(l) + "_";
    EXPECT_EQ(member_names(g, ag), (std::vector<std::string>{"ag_" + p + "0", "ag_" + p + "1", "ag_" + p + "2"}));
    EXPECT_EQ(member_names(g, rs), (std::vector<std::string>{"rs_" + p + "0", "rs_" + p + "1", "rs_" + p + "2"}));
    EXPECT_EQ(ag.type, CollectiveType::AllGather);
    EXPECT_EQ(rs.type, CollectiveType::ReduceScatter);
    EXPECT_EQ(ag.scope, BucketScope::Block);
    EXPECT_EQ(ag.block, l);
    EXPECT_EQ(ag.key, "layers." + std::to_string(l));
    EXPECT_EQ(rs.reduce_op, std::optional<std::string>("sum"));
    EXPECT_EQ(ag.bytes, 3 * 64 * 256 * 2);
    EXPECT_EQ(rs.bytes, 3 * 512 * 256 * 2);
    for (size_t k = 0; k < ag.members.size(); ++k) EXPECT_EQ(g.nodes[ag.waits[k]].inputs[0], ag.members[k]);
  }
  EXPECT_EQ(member_names(g, bs.back()), std::vector<std::string>{"ag_out"});
}

TEST(Bucketing, CapSplitsABlockInGraphOrder) {
  const Document doc = fsdp_doc(FsdpOptions());
  const Graph& g = doc.graphs[0];
  PlanConfig config;
  config.bucket_cap_bytes = 2 * 64 * 256 * 2;  // two shards fit, three do not
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, config);
  ASSERT_EQ(bs.size(), 2u + 2u * 3u);
  EXPECT_EQ(member_names(g, bs[1]), (std::vector<std::string>{"ag_0_0", "ag_0_1"}));
  EXPECT_EQ(member_names(g, bs[2]), std::vector<std::string>{"ag_0_2"});
  for (const Bucket& b : bs) EXPECT_LE(b.bytes, config.bucket_cap_bytes);

  config.bucket_cap_bytes = 1;  // every collective larger than the cap: a bucket of its own
  EXPECT_EQ(bucket_collectives(g, doc.blocks, config).size(), 11u);
}

TEST(Bucketing, KeysSeparateGroupDtypeAndReduceOp) {
  GraphBuilder b;
  const int x = b.placeholder("x", tensor({64, 16}, "bfloat16"));
  const int y = b.placeholder("y", tensor({64, 16}, "float32"));
  std::vector<int> outs;
  auto add = [&](const std::string& name, int input, CollectiveType type, const std::string& group) {
    const int c = functional_collective(b, name, input, type, 8, group);
    b.node(c).block = 0;
    outs.push_back(b.wait("w_" + name, c, b.graph().nodes[c].outputs[0]));
    b.node(outs.back()).block = 0;
  };
  add("a", x, CollectiveType::AllGather, "0");
  add("b", y, CollectiveType::AllGather, "0");      // other dtype
  add("c", x, CollectiveType::AllGather, "1");      // other group
  add("d", x, CollectiveType::AllGather, "0");      // joins a
  add("e", x, CollectiveType::ReduceScatter, "0");  // other type
  add("f", x, CollectiveType::ReduceScatter, "0");
  b.node(b.graph().nodes.size() - 2).collective->reduce_op = "max";  // f: other reduce op
  b.output(outs);
  Document doc = make_doc({b.graph()});
  doc.blocks = {{0, "layers.0", "Block"}};
  const Graph& g = doc.graphs[0];
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, PlanConfig());
  std::vector<std::vector<std::string>> got;
  for (const Bucket& bucket : bs) got.push_back(member_names(g, bucket));
  EXPECT_EQ(got, (std::vector<std::vector<std::string>>{{"a", "d"}, {"b"}, {"c"}, {"e"}, {"f"}}));
  plan_and_check(doc);
}

TEST(Bucketing, OutsideBlocksBucketWithNeighboursOnly) {
  // Outside-block all-gathers: two before the blocks bucket together; the one after does not join them.
  FsdpOptions o;
  o.blocks = 2;
  const Document doc = fsdp_doc(o);
  Document d2 = doc;
  Graph& g = d2.graphs[0];
  // Make ag_0_0 an outside collective too: it is adjacent to ag_emb (no block collective between).
  set_block(g.nodes[id_of(g, "ag_0_0")], -1);
  g.nodes[id_of(g, "ag_0_0")].module_stack.clear();
  const std::vector<Bucket> bs = bucket_collectives(g, d2.blocks, PlanConfig());
  EXPECT_EQ(member_names(g, bs[0]), (std::vector<std::string>{"ag_emb", "ag_0_0"}));
  EXPECT_EQ(member_names(g, bs.back()), std::vector<std::string>{"ag_out"});
  plan_and_check(d2);
}

TEST(Bucketing, PatternsReplaceTheBlockKey) {
  FsdpOptions o;
  o.blocks = 4;
  const Document doc = fsdp_doc(o);
  const Graph& g = doc.graphs[0];
  PlanConfig config;
  // Blocks 0-1 and 2-3 pair up through the capture group; everything else keeps its block.
  config.bucket_patterns = {R"((layers\.[01])\.)", R"(^(layers)\.[23]\b)"};
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, config);
  std::vector<std::string> keys;
  for (const Bucket& b : bs) keys.push_back(b.key + "/" + std::to_string(b.members.size()));
  // Pattern 0 matches "layers.0." inside "layers.0.w0_0" (the Linear path): key "layers.0".
  EXPECT_EQ(keys, (std::vector<std::string>{"/1", "layers.0/3", "layers.1/3", "layers/6", "/1"}));
  EXPECT_EQ(bs[3].scope, BucketScope::Pattern);
  EXPECT_EQ(bs[3].block, -1);  // spans blocks 2 and 3
  EXPECT_EQ(bs[1].block, 0);
  plan_and_check(doc, config);

  config.bucket_patterns = {"("};
  EXPECT_NE(error_of([&] { bucket_collectives(g, doc.blocks, config); }).find("config.bucket_patterns[0]"),
            std::string::npos);
}

TEST(Bucketing, ADependentCollectiveStartsANewBucket) {
  GraphBuilder b;
  const int x = b.placeholder("x", tensor({64, 16}, "bfloat16"));
  const int c1 = functional_collective(b, "c1", x, CollectiveType::AllReduce);
  const int w1 = b.wait("w1", c1, b.graph().nodes[c1].outputs[0]);
  const int m = b.compute("m", {w1}, tensor({64, 16}, "bfloat16"));
  const int c2 = functional_collective(b, "c2", m, CollectiveType::AllReduce);
  const int w2 = b.wait("w2", c2, b.graph().nodes[c2].outputs[0]);
  const int c3 = functional_collective(b, "c3", x, CollectiveType::AllReduce);
  const int w3 = b.wait("w3", c3, b.graph().nodes[c3].outputs[0]);
  b.output({w2, w3});
  const Document doc = make_doc({b.graph()});
  const Graph& g = doc.graphs[0];
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, PlanConfig());
  ASSERT_EQ(bs.size(), 2u);
  EXPECT_EQ(member_names(g, bs[0]), std::vector<std::string>{"c1"});
  EXPECT_EQ(member_names(g, bs[1]), (std::vector<std::string>{"c2", "c3"}));
  plan_and_check(doc);
}

TEST(Bucketing, UnmergeableCollectivesStayAlone) {
  GraphBuilder b;
  const int x = b.placeholder("x", tensor({64, 16}, "bfloat16"));
  // Coalesced: one collective, two getitems, a wait each.
  const int co = functional_collective(b, "co", x, CollectiveType::AllGather);
  const int g0 = b.view("g0", co, b.graph().nodes[co].outputs[0]);
  const int g1 = b.view("g1", co, b.graph().nodes[co].outputs[0]);
  const int w0 = b.wait("w0", g0, b.graph().nodes[co].outputs[0]);
  const int w1 = b.wait("w1", g1, b.graph().nodes[co].outputs[0]);
  // No wait: read directly.
  const int nw = functional_collective(b, "nw", x, CollectiveType::AllGather);
  const int r = b.compute("r", {nw}, tensor({4}, "bfloat16"));
  // Not a mergeable op (all_to_all), and an all-gather of a 0-d tensor.
  const int s = b.placeholder("s", tensor({}, "bfloat16"));
  const int a2a = functional_collective(b, "a2a", x, CollectiveType::AllGather);
  b.node(a2a).op = "_c10d_functional.all_gather_into_tensor_coalesced.default";
  const int wa = b.wait("wa", a2a, b.graph().nodes[a2a].outputs[0]);
  const int sc = b.collective("sc", {s}, CollectiveType::AllGather, tensor({8}, "bfloat16"));
  b.node(sc).op = testing::kAllGatherOp;
  const int ws = b.wait("ws", sc, tensor({8}, "bfloat16"));
  const int fine1 = functional_collective(b, "fine1", x, CollectiveType::AllGather);
  const int wf1 = b.wait("wf1", fine1, b.graph().nodes[fine1].outputs[0]);
  const int fine2 = functional_collective(b, "fine2", x, CollectiveType::AllGather);
  const int wf2 = b.wait("wf2", fine2, b.graph().nodes[fine2].outputs[0]);
  b.output({w0, w1, r, wa, ws, wf1, wf2});
  Document doc = make_doc({b.graph()});
  // Placeholders first: move "s" up by rebuilding is overkill; the planner only needs ids topological.
  const Graph& g = doc.graphs[0];
  const std::vector<CollectiveUse> uses = collective_uses(g);
  EXPECT_EQ(uses[co].num_waits, 2);
  EXPECT_EQ(uses[co].wait, w0);
  EXPECT_FALSE(uses[co].bucketable);
  EXPECT_EQ(uses[nw].num_waits, 0);
  EXPECT_FALSE(uses[nw].bucketable);
  EXPECT_TRUE(uses[a2a].bucketable);
  EXPECT_FALSE(uses[a2a].mergeable);
  EXPECT_FALSE(uses[sc].mergeable);
  EXPECT_TRUE(uses[fine1].mergeable);
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, PlanConfig());
  std::vector<std::vector<std::string>> got;
  for (const Bucket& bucket : bs) got.push_back(member_names(g, bucket));
  EXPECT_EQ(got, (std::vector<std::vector<std::string>>{{"co"}, {"nw"}, {"a2a"}, {"sc"}, {"fine1", "fine2"}}));
  EXPECT_FALSE(bs[0].planned);
  EXPECT_EQ(bs[0].kept_reason, "read by 2 waits (coalesced)");
  EXPECT_EQ(bs[1].kept_reason, "no wait reads it");
  EXPECT_TRUE(bs[2].planned);
  // The placeholder "s" sits mid-graph, so only the order rules that hold for any graph are checked.
  const Schedule sched = schedule_graph(g, bs, PlanConfig());
  check_order(g, sched.order);
}

// ---- scheduling ----

TEST(Schedule, PrefetchesAllGathersOneBlockAndSinksWaits) {
  const Document doc = fsdp_doc(FsdpOptions());
  const Graph& g = doc.graphs[0];
  const Schedule s = plan_and_check(doc);
  std::vector<int> pos(g.nodes.size());
  for (size_t i = 0; i < s.order.size(); ++i) pos[s.order[i]] = static_cast<int>(i);
  // Block 1's gathers are issued before block 0's first matmul, block 2's before block 1's.
  EXPECT_LT(pos[id_of(g, "ag_1_2")], pos[id_of(g, "mm_0_0_0")]);
  EXPECT_LT(pos[id_of(g, "ag_2_2")], pos[id_of(g, "mm_1_0_0")]);
  EXPECT_GT(pos[id_of(g, "ag_2_0")], pos[id_of(g, "mm_0_2_1")]);  // but not two blocks early
  // Their dtype casts moved along.
  EXPECT_LT(pos[id_of(g, "cast_1_2")], pos[id_of(g, "ag_1_0")]);
  // Waits as late as possible: right before the first use (the transpose view, then the matmul).
  EXPECT_EQ(pos[id_of(g, "t_1_0")], pos[id_of(g, "wait_ag_1_2")] + 1);
  EXPECT_GT(pos[id_of(g, "wait_ag_1_0")], pos[id_of(g, "mm_0_2_1")]);
  // The output projection (outside blocks, after the last block) goes at the last block's start.
  EXPECT_LT(pos[id_of(g, "ag_out")], pos[id_of(g, "mm_2_0_0")]);
  EXPECT_GT(pos[id_of(g, "ag_out")], pos[id_of(g, "mm_1_2_1")]);
  EXPECT_EQ(s.prefetch[1], 1);

  PlanConfig none;
  none.prefetch_blocks = 0;
  const Schedule s0 = plan_and_check(doc, none);
  for (size_t i = 0; i < s0.order.size(); ++i) pos[s0.order[i]] = static_cast<int>(i);
  EXPECT_GT(pos[id_of(g, "ag_1_0")], pos[id_of(g, "mm_0_2_1")]);
}

TEST(Schedule, ReduceScatterRightAfterItsInputsWaitAtItsFirstUse) {
  FsdpOptions o;
  o.backward = true;
  o.outside = false;
  const Document doc = fsdp_doc(o);
  const Graph& g = doc.graphs[0];
  const Schedule s = plan_and_check(doc);
  std::vector<int> pos(g.nodes.size());
  for (size_t i = 0; i < s.order.size(); ++i) pos[s.order[i]] = static_cast<int>(i);
  // Block 0's bucket is issued right after its last gradient; the waits and the fp32 casts they
  // feed (read only by the output) sink to the end.
  EXPECT_EQ(pos[id_of(g, "rs_0_0")], pos[id_of(g, "grad_0_2")] + 1);
  EXPECT_GT(pos[id_of(g, "wait_rs_0_0")], pos[id_of(g, "mm_2_2_1")]);
  EXPECT_EQ(s.order.back(), id_of(g, "output"));
}

TEST(Schedule, GraphsWithoutCollectivesOrBlocksKeepTheirOrder) {
  GraphBuilder b;
  const int x = b.placeholder("x");
  const int y = b.compute("y", {x});
  const int z = b.compute("z", {y, x});
  b.output({z});
  const Document doc = make_doc({b.graph()});
  const Schedule s = plan_and_check(doc);
  EXPECT_EQ(s.order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(s.buckets.empty());
  EXPECT_EQ(s.peak_bytes_after, s.peak_bytes_before);

  // No blocks: all-gathers are not prefetched; a wait used right away stays right there.
  GraphBuilder c;
  const int p = c.placeholder("p", tensor({64, 16}, "bfloat16"));
  const int a = c.compute("a", {p}, tensor({64, 16}, "bfloat16"), 1 << 20);
  const int ag = functional_collective(c, "ag", a, CollectiveType::AllGather);
  const int w = c.wait("w", ag, c.graph().nodes[ag].outputs[0]);
  const int u = c.compute("u", {w}, tensor({64, 16}, "bfloat16"), 1 << 20);
  c.output({u});
  const Document doc2 = make_doc({c.graph()});
  EXPECT_EQ(plan_and_check(doc2).order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(Schedule, MergingThatWouldMakeACycleIsSplit) {
  // a1, b1, a2 (reads b1's wait), b2 (reads a1's wait): buckets {a1, a2} and {b1, b2} would need each
  // other's waits before their own collectives.
  GraphBuilder b;
  const int x = b.placeholder("x", tensor({64, 16}, "bfloat16"));
  const int a1 = functional_collective(b, "a1", x, CollectiveType::AllReduce);
  const int wa1 = b.wait("wa1", a1, b.graph().nodes[a1].outputs[0]);
  const int b1 = functional_collective(b, "b1", x, CollectiveType::AllReduce, 8, "1");
  const int wb1 = b.wait("wb1", b1, b.graph().nodes[b1].outputs[0]);
  const int a2 = functional_collective(b, "a2", wb1, CollectiveType::AllReduce);
  const int wa2 = b.wait("wa2", a2, b.graph().nodes[a2].outputs[0]);
  const int b2 = functional_collective(b, "b2", wa1, CollectiveType::AllReduce, 8, "1");
  const int wb2 = b.wait("wb2", b2, b.graph().nodes[b2].outputs[0]);
  b.output({wa2, wb2});
  const Document doc = make_doc({b.graph()});
  const Graph& g = doc.graphs[0];
  const std::vector<Bucket> bs = bucket_collectives(g, doc.blocks, PlanConfig());
  ASSERT_EQ(bs.size(), 2u);  // bucketing alone cannot see it
  const Schedule s = plan_and_check(doc);
  EXPECT_EQ(s.buckets.size(), 3u);  // one of the two was split
}

TEST(Schedule, RandomGraphsFollowEveryRule) {
  int merged = 0, moved = 0, kept = 0, cut = 0;
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Document doc = random_doc(seed);
    validate(doc);
    const Graph& g = doc.graphs[0];
    PlanConfig config;
    config.bucket_cap_bytes = int64_t{1} << (10 + seed % 8);
    config.prefetch_blocks = static_cast<int>(seed % 3);
    config.memory_budget_bytes = seed % 4 == 0 ? 0 : int64_t{1} << (8 + seed % 10);
    const Schedule s = plan_and_check(doc, config);
    EXPECT_LE(s.peak_bytes_after - s.peak_bytes_before, config.memory_budget_bytes);
    std::vector<int> captured(g.nodes.size());
    std::iota(captured.begin(), captured.end(), 0);
    EXPECT_EQ(s.peak_bytes_before, peak_memory(g, captured).peak_bytes);
    EXPECT_EQ(s.peak_bytes_after, bucketed_peak_memory(g, s.buckets, s.order).peak_bytes);
    for (const Bucket& b : s.buckets) merged += b.members.size() > 1;
    moved += s.order != captured;
    kept += s.kept_captured_order;
    for (const std::string& note : s.notes) cut += note.rfind("prefetch cut", 0) == 0;
  }
  // The generator reaches every branch.
  EXPECT_GT(merged, 100);
  EXPECT_GT(moved, 30);
  EXPECT_GT(kept, 0);
  EXPECT_GT(cut, 0);
}

TEST(Schedule, MemoryBudgetCutsPrefetchAndSaysSo) {
  FsdpOptions o;
  o.blocks = 6;
  o.shard_rows = 4096;  // 16 MiB gathered per parameter: prefetch dominates the peak
  o.outside = false;
  const Document doc = fsdp_doc(o);
  const Graph& g = doc.graphs[0];
  PlanConfig generous;
  generous.prefetch_blocks = 2;
  const Schedule wide = plan_and_check(doc, generous);
  const int64_t rise = wide.peak_bytes_after - wide.peak_bytes_before;
  ASSERT_GT(rise, 0);

  PlanConfig tight = generous;
  tight.memory_budget_bytes = rise / 2;
  const Schedule s = plan_and_check(doc, tight);
  EXPECT_LE(s.peak_bytes_after - s.peak_bytes_before, tight.memory_budget_bytes);
  int cut = 0;
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    if (s.prefetch[b] < 2) {
      ++cut;
      EXPECT_NE(s.notes[b].find("prefetch cut from 2 blocks to"), std::string::npos) << s.notes[b];
      EXPECT_NE(s.notes[b].find("memory budget"), std::string::npos);
    }
  }
  EXPECT_GT(cut, 0);
  EXPECT_FALSE(s.kept_captured_order);

  PlanConfig zero = generous;
  zero.memory_budget_bytes = 0;
  const Schedule z = plan_and_check(doc, zero);
  EXPECT_LE(z.peak_bytes_after, z.peak_bytes_before);
  (void)g;
}

TEST(Schedule, MemoryBudgetBoundsReduceScatterWaits) {
  // A reduce-scatter reads its input until its wait. Sunk to the end, every block's gradients stay alive; over a
  // budget, each wait moves to right after the next reduce-scatter's issue (at most two in flight), and says so.
  FsdpOptions o;
  o.blocks = 6;
  o.backward = true;
  o.outside = false;
  o.shard_rows = 1024;
  const Document doc = fsdp_doc(o);
  const Graph& g = doc.graphs[0];
  const Schedule sunk = plan_and_check(doc);
  const int64_t rise = sunk.peak_bytes_after - sunk.peak_bytes_before;
  ASSERT_GT(rise, 0) << "the sunk waits must cost memory for this test to mean anything";

  PlanConfig tight;
  tight.memory_budget_bytes = rise / 2;
  const Schedule s = plan_and_check(doc, tight);
  EXPECT_LE(s.peak_bytes_after - s.peak_bytes_before, tight.memory_budget_bytes);
  EXPECT_FALSE(s.kept_captured_order);
  std::vector<int> rs;
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    if (s.buckets[b].planned && s.buckets[b].type == CollectiveType::ReduceScatter) rs.push_back(static_cast<int>(b));
  }
  ASSERT_EQ(rs.size(), 6u);  // one per block
  int bounded = 0;
  for (size_t k = 0; k + 1 < rs.size(); ++k) {
    const int b = rs[k], next = rs[k + 1];
    if (s.notes[b].find("wait bounded") == std::string::npos) continue;
    ++bounded;
    EXPECT_NE(s.notes[b].find("memory budget"), std::string::npos) << s.notes[b];
    EXPECT_GT(s.wait_position[b], s.issue_position[next]) << "bucket " << b;  // the next one is queued first
    EXPECT_LT(s.wait_position[b], static_cast<int>(g.nodes.size()) - 1);     // not sunk to the end
  }
  EXPECT_GT(bounded, 0);
  EXPECT_EQ(s.notes[rs.back()].find("wait bounded"), std::string::npos);  // the last has no next one
}

TEST(Schedule, BucketedPeakCountsTheBucketBuffers) {
  // Two 1 KiB all-gathers in one bucket: the copy-in (2 x 128 B) and one output buffer (2 x 1 KiB)
  // that lives until its last member's use.
  GraphBuilder b;
  const int p = b.placeholder("p", tensor({64}, "bfloat16"));
  const int c1 = b.compute("c1", {p}, tensor({64}, "bfloat16"));
  const int c2 = b.compute("c2", {p}, tensor({64}, "bfloat16"));
  const int a1 = functional_collective(b, "a1", c1, CollectiveType::AllGather);
  const int w1 = b.wait("w1", a1, b.graph().nodes[a1].outputs[0]);
  const int a2 = functional_collective(b, "a2", c2, CollectiveType::AllGather);
  const int w2 = b.wait("w2", a2, b.graph().nodes[a2].outputs[0]);
  const int u1 = b.compute("u1", {w1}, tensor({4}, "bfloat16"));
  const int u2 = b.compute("u2", {w2}, tensor({4}, "bfloat16"));
  b.output({u1, u2});
  const Graph g = b.graph();
  const std::vector<Bucket> bs = bucket_collectives(g, {}, PlanConfig());
  ASSERT_EQ(bs.size(), 1u);
  const std::vector<int> order = {p, c1, c2, a1, a2, w1, w2, u1, u2, 9};
  // c1, c2 (256) live; the copy-in (+256) reads them and they die; the output (+2048) at a1: 2304.
  const MemoryEstimate m = bucketed_peak_memory(g, bs, order);
  EXPECT_EQ(m.peak_bytes, 256 + 2048);
  EXPECT_EQ(m.peak_node, a1);
  // Singletons: the same as peak_memory.
  std::vector<Bucket> singles = bs;
  singles[0].members = {a1};
  singles[0].waits = {w1};
  singles.push_back(singles[0]);
  singles[1].members = {a2};
  singles[1].waits = {w2};
  EXPECT_EQ(bucketed_peak_memory(g, singles, order).peak_bytes, peak_memory(g, order).peak_bytes);
}

TEST(Schedule, TensorParallelCollectivesStayInPlaceAndDataParallelOnesWaitForThem) {
  // Each TP collective is a bucket of its own, issued as soon as its input is ready (never prefetched); the DP
  // all-gather of block l + 1, prefetched to block l's start, would run beside block l's TP all-gather (only the
  // norm, no GEMM, before it): it is issued after that all-gather's wait instead, before the GEMM.
  const Document doc = tp_doc();
  const Graph& g = doc.graphs[0];
  const Schedule s = plan_and_check(doc);
  std::vector<int> pos(g.nodes.size());
  for (size_t i = 0; i < s.order.size(); ++i) pos[s.order[i]] = static_cast<int>(i);
  int tp_buckets = 0;
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    const Bucket& bucket = s.buckets[b];
    if (bucket.role == CollectiveRole::TensorParallel) {
      ++tp_buckets;
      EXPECT_EQ(bucket.members.size(), 1u);
      EXPECT_EQ(bucket.group, "tp");
      EXPECT_EQ(s.prefetch[b], 0);
      const int input = g.nodes[bucket.members[0]].inputs[0];
      EXPECT_EQ(pos[bucket.members[0]], pos[input] + 1) << g.nodes[bucket.members[0]].name;
    }
  }
  EXPECT_EQ(tp_buckets, 6);
  for (int l = 1; l < 3; ++l) {
    const std::string prev = std::to_string(l - 1);
    const int dp = id_of(g, "dp_ag_" + std::to_string(l));
    EXPECT_GT(pos[dp], pos[id_of(g, "tp_ag_" + prev + "_wait")]) << l;
    EXPECT_LT(pos[dp], pos[id_of(g, "mm_" + prev)]) << l;  // still under block l - 1's GEMM
    const auto it = std::find_if(s.buckets.begin(), s.buckets.end(), [&](const Bucket& b) {
      return b.members.front() == dp;
    });
    ASSERT_NE(it, s.buckets.end());
    EXPECT_EQ(s.notes[it - s.buckets.begin()],
              "issued after tensor-parallel tp_ag_" + prev + " completes (it would share its NVLink)");
  }
}

// ---- Plan JSON ----

Plan sample_plan() {
  FsdpOptions o;
  o.backward = true;
  const Document doc = fsdp_doc(o);
  const Graph& g = doc.graphs[0];
  PlanConfig config;
  config.bucket_patterns = {"layers\\.(\\d+)"};
  const Schedule s = schedule_graph(g, bucket_collectives(g, doc.blocks, config), config);
  Plan plan = plan_of(doc, g, s, config);
  plan.buckets[1].backend = "ce";
  plan.buckets[1].reason = "ce: saves 0.1 ms (\"quoted\", \u00e9)";
  plan.buckets[1].predicted = {12.5, 7.25, 100.0, 3.0, 0.5, 0.0, std::nullopt, std::nullopt};
  plan.summary.ce_buckets = 1;
  plan.summary.exposed_comm_us_before = 1234.5;
  plan.summary.exposed_comm_us_after = 0.1 + 0.2;
  plan.summary.makespan_us_before = 5000.25;
  plan.summary.makespan_us_after = 3766.0;
  plan.summary.plan_ms = 4.2;
  return plan;
}

TEST(PlanJson, SaveLoadSaveIsByteIdentical) {
  const Plan plan = sample_plan();
  const std::string text = save_plan(plan);
  EXPECT_EQ(text.rfind("{\n  \"schema\": \"ce_overlap.plan/1\",\n  \"graph\": \"backward\",", 0), 0u);
  const Plan loaded = load_plan(text);
  EXPECT_EQ(save_plan(loaded), text);
  EXPECT_EQ(loaded.summary.exposed_comm_us_after, 0.1 + 0.2);
  EXPECT_EQ(loaded.summary.makespan_us_before, std::optional<double>(5000.25));
  EXPECT_EQ(loaded.summary.makespan_us_after, std::optional<double>(3766.0));
  EXPECT_EQ(loaded.buckets[1].predicted.ce_us, std::optional<double>(7.25));
  EXPECT_FALSE(loaded.buckets[0].predicted.ce_us.has_value());
  EXPECT_EQ(loaded.config.bucket_patterns, plan.config.bucket_patterns);
  EXPECT_EQ(plan_to_json(loaded)["buckets"][1]["reason"], plan.buckets[1].reason);
}

TEST(PlanJson, RolesAndOverlapsRoundTripAndAreChecked) {
  const Document doc = tp_doc();
  const Graph& g = doc.graphs[0];
  const Schedule s = schedule_graph(g, bucket_collectives(g, doc.blocks, PlanConfig()), PlanConfig());
  Plan plan = plan_of(doc, g, s, PlanConfig());
  size_t dp = plan.buckets.size();
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    plan.buckets[b].role = plan.buckets[b].group == "tp" ? CollectiveRole::TensorParallel
                                                         : CollectiveRole::DataParallel;
    if (plan.buckets[b].group == "dp" && dp == plan.buckets.size()) dp = b;
  }
  ASSERT_LT(dp, plan.buckets.size());
  plan.buckets[dp].overlaps = {{"tp_rs_0", 12.5, 3.0, 2.5}};
  const std::string text = save_plan(plan);
  EXPECT_NE(text.find("\"role\": \"tp\""), std::string::npos);
  EXPECT_NE(text.find("\"overlaps\": [{\"collective\": \"tp_rs_0\", \"overlap_us\": 12.5"), std::string::npos)
      << text;
  const Plan loaded = load_plan(text);
  EXPECT_EQ(save_plan(loaded), text);
  check_plan(doc, loaded);
  auto broken = [&](const std::function<void(Plan&)>& edit) {
    Plan p = plan;
    edit(p);
    return error_of([&] { check_plan(doc, p); });
  };
  const std::string b = "buckets[" + std::to_string(dp) + "]";
  EXPECT_EQ(broken([&](Plan& p) { p.buckets[dp].overlaps[0].collective = "cast_0"; }),
            b + ".overlaps[0].collective: expected a collective of graph \"forward\", got \"cast_0\"");
  EXPECT_EQ(broken([&](Plan& p) { p.buckets[dp].overlaps[0].collective = "dp_ag_2"; }),
            b + ".overlaps[0].collective: node " + std::to_string(id_of(g, "dp_ag_2")) +
                " (\"dp_ag_2\") is of the bucket's own group \"dp\" (its collectives run one after another)");
  EXPECT_EQ(broken([&](Plan& p) { p.buckets[dp].overlaps[0].bucket_added_us = -1; }),
            b + ".overlaps[0].bucket_added_us: expected a non-negative number of microseconds");
  EXPECT_EQ(broken([&](Plan& p) { p.buckets[dp].role = CollectiveRole::TensorParallel; }),
            b + ".role: expected \"dp\" (as node " + std::to_string(id_of(g, "dp_ag_0")) +
                " (\"dp_ag_0\") has), got \"tp\"");
  nlohmann::json j = nlohmann::json::parse(text);
  j["buckets"][dp]["role"] = "pp";
  EXPECT_EQ(error_of([&] { load_plan(j.dump()); }), b + ".role: unknown collective role \"pp\" (accepted: dp, tp, replicate)");
}

TEST(PlanJson, HierarchicalBucketsRoundTripAndAreChecked) {
  const Document doc = tp_doc();
  const Graph& g = doc.graphs[0];
  const Schedule s = schedule_graph(g, bucket_collectives(g, doc.blocks, PlanConfig()), PlanConfig());
  Plan plan = plan_of(doc, g, s, PlanConfig());
  size_t ag = plan.buckets.size();
  for (size_t b = 0; b < plan.buckets.size() && ag == plan.buckets.size(); ++b) {
    if (plan.buckets[b].type == CollectiveType::AllGather) ag = b;
  }
  ASSERT_LT(ag, plan.buckets.size());
  plan.buckets[ag].backend = "hier";
  plan.buckets[ag].reason = "hier: saves 0.2 ms";
  plan.buckets[ag].predicted.hier_us = 40.5;
  plan.buckets[ag].predicted.hier_cost_us = 2.25;
  const std::string text = save_plan(plan);
  EXPECT_NE(text.find("\"hier_us\": 40.5, \"hier_cost_us\": 2.25"), std::string::npos) << text;
  const Plan loaded = load_plan(text);
  EXPECT_EQ(save_plan(loaded), text);
  check_plan(doc, loaded);
  const std::string b = "buckets[" + std::to_string(ag) + "]";
  Plan missing = plan;
  missing.buckets[ag].predicted.hier_us.reset();
  missing.buckets[ag].predicted.hier_cost_us.reset();
  EXPECT_EQ(error_of([&] { check_plan(doc, missing); }),
            b + ".predicted.hier_us: a hierarchical bucket needs a hierarchical prediction, got none");
  Plan half = plan;
  half.buckets[ag].predicted.hier_cost_us.reset();
  EXPECT_EQ(error_of([&] { check_plan(doc, half); }),
            b + ".predicted.hier_cost_us: must be given exactly when hier_us is");
}

TEST(PlanJson, MakespansAreOptionalOnLoad) {
  // Plans written before the summary had makespans still load, and save as they were.
  nlohmann::json j = nlohmann::json::parse(save_plan(sample_plan()));
  j["summary"].erase("makespan_us_before");
  j["summary"].erase("makespan_us_after");
  const Plan loaded = load_plan(j.dump());
  EXPECT_FALSE(loaded.summary.makespan_us_before.has_value());
  EXPECT_FALSE(loaded.summary.makespan_us_after.has_value());
  EXPECT_EQ(save_plan(loaded).find("makespan_us"), std::string::npos);
  j["summary"]["makespan_us_after"] = -1;
  EXPECT_EQ(error_of([&] { load_plan(j.dump()); }),
            "summary.makespan_us_after: expected a non-negative number of microseconds, got -1");
}

TEST(PlanJson, ErrorsNameTheField) {
  const std::string text = save_plan(sample_plan());
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(text);
    edit(j);
    return error_of([&] { load_plan(j.dump()); });
  };
  EXPECT_EQ(with([](nlohmann::json& j) { j["schema"] = "ce_overlap.plan/0"; }),
            "schema: expected \"ce_overlap.plan/1\", got \"ce_overlap.plan/0\"");
  EXPECT_EQ(with([](nlohmann::json& j) { j.erase("order"); }), "order: missing required field");
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][2]["bytes"] = -4; }),
            "buckets[2].bytes: expected an integer in 0..2^63-1, got -4");
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][2]["id"] = 7; }),
            "buckets[2].id: expected 2 (ids equal the position), got 7");
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][0]["colour"] = 1; }).rfind("buckets[0]: unknown key \"colour\"", 0), 0u);
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][1]["members"][0]["bytes"] = 1; }).rfind("buckets[1].bytes: expected the "
                                                                                     "sum of the members' bytes", 0),
            0u);
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][1]["reason"] = "nccl: no"; }),
            "buckets[1].reason: expected one line starting with \"ce: \", got \"nccl: no\"");
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][1]["backend"] = "nvshmem"; }),
            "buckets[1].backend: expected \"nccl\", \"ce\" or \"hier\", got \"nvshmem\"");
  EXPECT_EQ(with([](nlohmann::json& j) { j["config"]["bucket_cap_bytes"] = 100; }).rfind("buckets[1].bytes: ", 0), 0u);
  EXPECT_EQ(with([](nlohmann::json& j) { j["config"]["ce"] = "sometimes"; }),
            "config.ce: expected \"auto\", \"on\" or \"off\", got \"sometimes\"");
  EXPECT_EQ(with([](nlohmann::json& j) { j["config"].erase("prefetch_blocks"); }), "config.prefetch_blocks: missing required field");
  EXPECT_EQ(with([](nlohmann::json& j) { j["order"][3] = j["order"][1]; }).rfind("order[3]: ", 0), 0u);
  EXPECT_EQ(with([](nlohmann::json& j) { std::swap(j["order"][1], j["order"][3]); }), "");  // placeholders: fine without a graph
  EXPECT_NE(with([](nlohmann::json& j) {
              auto& o = j["order"];
              const std::string c = j["buckets"][1]["members"][1]["collective"];
              for (auto& e : o) {
                if (e == c) e = "moved";
              }
              o.push_back(c);
            }).find("member collectives are not contiguous"),
            std::string::npos);
  EXPECT_EQ(with([](nlohmann::json& j) { j["summary"]["peak_memory_bytes_after"] = j["summary"]["peak_memory_bytes_before"].get<int64_t>() + (int64_t{5} << 30); })
                .rfind("summary.peak_memory_bytes_after: ", 0),
            0u);
  EXPECT_EQ(with([](nlohmann::json& j) { j["summary"]["ce_buckets"] = 3; }),
            "summary.ce_buckets: expected 1 (buckets on ce), got 3");
  EXPECT_EQ(with([](nlohmann::json& j) { j["buckets"][1]["predicted"]["ce_cost_us"] = nullptr; }),
            "buckets[1].predicted.ce_cost_us: must be null exactly when ce_us is (CE cannot serve the group)");
  EXPECT_EQ(error_of([&] { load_plan("{\"schema\": \"ce_overlap.plan/1\", \"schema\": 1}"); }),
            "malformed plan: duplicate key \"schema\" in an object");
  EXPECT_EQ(error_of([&] { load_plan("{"); }).rfind("malformed JSON: ", 0), 0u);
}

// A backward FSDP graph and its valid Plan: what the CheckPlan tests break one rule at a time.
struct PlannedFsdp {
  Document doc;
  Plan plan;
};
PlannedFsdp planned_fsdp_backward() {
  FsdpOptions o;
  o.backward = true;
  PlannedFsdp out{fsdp_doc(o), {}};
  const Graph& g = out.doc.graphs[0];
  const PlanConfig config;
  out.plan = plan_of(out.doc, g, schedule_graph(g, bucket_collectives(g, out.doc.blocks, config), config), config);
  return out;
}

TEST(CheckPlan, CatchesEveryBrokenRule) {
  const PlannedFsdp base = planned_fsdp_backward();
  const Document& doc = base.doc;
  const Graph& g = doc.graphs[0];
  const Plan& good = base.plan;
  check_plan(doc, good);
  auto broken = [&](const std::function<void(Plan&)>& edit) {
    Plan p = good;
    edit(p);
    return error_of([&] { check_plan(doc, p); });
  };
  auto find = [&](const Plan& p, const std::string& name) {
    return static_cast<size_t>(std::find(p.order.begin(), p.order.end(), name) - p.order.begin());
  };
  // A member's input after the bucket's first collective.
  EXPECT_NE(broken([&](Plan& p) {
              p.order.erase(p.order.begin() + find(p, "cast_1_2"));
              p.order.insert(p.order.begin() + find(p, "ag_1_2") + 1, "cast_1_2");
            }).find("runs before its input"),
            std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { p.order.pop_back(); }).find("order: names"), std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { p.order[0] = "nope"; }).find("no node named \"nope\""), std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { std::swap(p.order[1], p.order[g.nodes.size() - 2]); }), "");
  // Wrong wait, wrong fields, collective in no bucket.
  EXPECT_NE(broken([&](Plan& p) { std::swap(p.buckets[1].members[0].wait, p.buckets[1].members[1].wait); })
                .find(".wait: expected"),
            std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { p.buckets[1].group = "7"; }).find("buckets[1].group: expected \"0\""),
            std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { p.buckets[1].dtype = "float32"; }).find("buckets[1].dtype"), std::string::npos);
  EXPECT_NE(broken([&](Plan& p) {
              p.summary.collectives -= 1;
              p.buckets[1].bytes -= p.buckets[1].members.back().bytes;
              p.buckets[1].members.pop_back();
            }).find("is in no bucket"),
            std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { p.graph = "forward"; }).find("graph: no graph named \"forward\""), std::string::npos);
  EXPECT_NE(broken([&](Plan& p) { p.buckets[1].block = 99; }).find("buckets[1].block"), std::string::npos);
}

// The rule and the node of a broken Plan, as the FX rewriter reports them (python/ce_overlap/inductor/plan_check.py).
struct Broken {
  std::string rule;
  std::optional<std::string> node;
  std::string message;
};

Broken broken_rule(const std::function<void()>& f) {
  try {
    f();
  } catch (const PlanRuleError& e) {
    return {e.rule(), e.node(), e.what()};
  }
  return {"", std::nullopt, ""};
}

TEST(CheckPlan, NamesTheRuleAndTheNode) {
  const PlannedFsdp base = planned_fsdp_backward();
  const Document& doc = base.doc;
  const Graph& g = doc.graphs[0];
  const Plan& good = base.plan;
  auto broken = [&](const std::function<void(Plan&)>& edit) {
    Plan p = good;
    edit(p);
    return broken_rule([&] { check_plan(doc, p); });
  };
  auto expect = [](const Broken& b, const std::string& rule, const std::optional<std::string>& node) {
    EXPECT_EQ(b.rule, rule) << b.message;
    EXPECT_EQ(b.node, node) << b.message;
  };
  auto find = [&](const Plan& p, const std::string& name) {
    return static_cast<size_t>(std::find(p.order.begin(), p.order.end(), name) - p.order.begin());
  };
  const PlanBucket& multi = good.buckets[1];
  ASSERT_GT(multi.members.size(), 1u);
  const std::string first = multi.members[0].collective;

  expect(broken([&](Plan& p) { p.order.pop_back(); }), "order.complete", g.nodes.back().name);
  expect(broken([&](Plan& p) { p.order[4] = "nope"; }), "order.complete", "nope");
  expect(broken([&](Plan& p) { p.order.push_back(p.order[2]); }), "order.complete", good.order[2]);
  expect(broken([&](Plan& p) { std::rotate(p.order.begin(), p.order.begin() + 1, p.order.end() - 1); }),
         "order.placeholders_first", good.order[0]);
  expect(broken([&](Plan& p) { std::swap(p.order[p.order.size() - 1], p.order[p.order.size() - 2]); }),
         "order.output_last", good.order[good.order.size() - 2]);
  expect(broken([&](Plan& p) {
           p.order.erase(p.order.begin() + find(p, "cast_1_2"));
           p.order.insert(p.order.begin() + find(p, "ag_1_2") + 1, "cast_1_2");
         }),
         "order.topological", "ag_1_2");
  expect(broken([&](Plan& p) { p.buckets[1].backend = "gpu"; }), "bucket.backend", "bucket 1");
  expect(broken([&](Plan& p) { p.buckets[1].reason = "because"; }), "bucket.reason", "bucket 1");
  expect(broken([&](Plan& p) { p.buckets[1].group = "7"; }), "bucket.members_match", first);
  expect(broken([&](Plan& p) { p.buckets[1].type = CollectiveType::ReduceScatter; }), "bucket.members_match", first);
  expect(broken([&](Plan& p) { p.buckets[1].members[1].bytes += 2; }), "bucket.bytes", multi.members[1].collective);
  expect(broken([&](Plan& p) { p.buckets[1].bytes += 1; }), "bucket.bytes", "bucket 1");
  expect(broken([&](Plan& p) { p.config.bucket_cap_bytes = p.buckets[1].bytes - 1; }), "bucket.cap", "bucket 1");
  expect(broken([&](Plan& p) { std::swap(p.buckets[1].members[0].wait, p.buckets[1].members[1].wait); }),
         "bucket.wait", first);
  expect(broken([&](Plan& p) { p.buckets[2].members.push_back(p.buckets[1].members[0]); }), "bucket.coverage", first);
  expect(broken([&](Plan& p) {
           p.summary.collectives -= 1;
           p.buckets[1].bytes -= p.buckets[1].members.back().bytes;
           p.buckets[1].members.pop_back();
         }),
         "bucket.coverage", multi.members.back().collective);
  expect(broken([&](Plan& p) { p.buckets[1].block = 99; }), "bucket.block", "bucket 1");
  expect(broken([&](Plan& p) { p.buckets[1].predicted.ce_us = 1.0; }), "bucket.predicted", "bucket 1");
  expect(broken([&](Plan& p) { p.summary.buckets += 1; }), "summary.counts", std::nullopt);
  expect(broken([&](Plan& p) { p.summary.peak_memory_bytes_after += p.config.memory_budget_bytes + 1; }),
         "summary.memory_budget", std::nullopt);
  expect(broken([&](Plan& p) { p.graph = "forward"; }), "plan.graph", std::nullopt);
  // A member collective moved past the next node, which does not read it: that node splits the bucket.
  expect(broken([&](Plan& p) {
           const size_t last = find(p, p.buckets[1].members.back().collective);
           std::swap(p.order[last], p.order[last + 1]);
         }),
         "order.bucket_collectives_contiguous", good.order[find(good, multi.members.back().collective) + 1]);
  // A collective the rewriter cannot merge, in a bucket of several.
  Document coalesced = doc;
  Node& c = coalesced.graphs[0].nodes[id_of(g, first)];
  c.op = "_c10d_functional.all_gather_into_tensor_coalesced.default";
  expect(broken_rule([&] { check_plan(coalesced, good); }), "bucket.supported", first);
  // The same rules without a graph.
  expect(broken_rule([&] {
           Plan p = good;
           p.buckets[1].bytes += 1;
           validate_plan(p);
         }),
         "bucket.bytes", "bucket 1");
  nlohmann::json j = nlohmann::json::parse(save_plan(good));
  j["buckets"][2]["bytes"] = -4;
  const Broken schema = broken_rule([&] { load_plan(j.dump()); });
  expect(schema, "schema", "buckets[2]");
  EXPECT_EQ(schema.message, "buckets[2].bytes: expected an integer in 0..2^63-1, got -4");
  expect(broken_rule([&] { load_plan("{"); }), "schema", std::nullopt);
}

}  // namespace
}  // namespace ce_overlap
