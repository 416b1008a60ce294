// The cost model: hand-computed formulas on the round profile, monotonicity and limits on every
// built-in profile, the CE feasibility rules, calibrated curves, decisions and their reasons, and the
// h200-sxm fit to MEASURED.md (printed as a table).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "cost_model/ce_algorithms.h"
#include "cost_model/cost_model.h"
#include "test_util.h"

namespace ce_overlap {
namespace {

using testing::builtin_profile;
using testing::coll;
using testing::round_profile;

constexpr int64_t kKiB = int64_t{1} << 10;
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

const char* kBuiltins[] = {"h100-sxm", "h200-sxm", "a100-sxm", "b200", "h100-pcie"};

Node compute_node(const std::string& dtype, int64_t flops, int64_t bytes_accessed) {
  Node n;
  n.name = "mm";
  n.kind = NodeKind::Compute;
  n.op = "aten.mm.default";
  n.outputs.push_back({{1024, 1024}, dtype, 1024 * 1024 * dtype_itemsize(dtype)});
  n.flops = flops;
  n.bytes_accessed = bytes_accessed;
  return n;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

const std::vector<CollectiveType> kAllTypes = {
    CollectiveType::AllGather, CollectiveType::ReduceScatter, CollectiveType::AllReduce, CollectiveType::AllToAll,
    CollectiveType::Broadcast, CollectiveType::Send,          CollectiveType::Recv};

// The largest group CE can serve on a profile (GPUs 0..n-1 all P2P, one node).
int largest_ce_group(const CostModel& m) {
  int n = 1;
  while (n < m.profile().topology.gpus_per_node && !m.ce_blocker(n + 1)) ++n;
  return n;
}

// ------------------------------------------------------------------------------------------------
// Compute

TEST(CostModel, GemmRooflineExact) {
  CostModel m(round_profile());
  // 2 * 4096^3 FLOPs at 100 TFLOP/s (efficiency 1, no ramp) = 1374.389534 us; memory side is far smaller.
  const int64_t flops = int64_t{2} * 4096 * 4096 * 4096;
  Node mm = compute_node("bfloat16", flops, 3 * 4096 * 4096 * 2);
  EXPECT_DOUBLE_EQ(m.compute_us(mm), static_cast<double>(flops) / 100e6);
  EXPECT_DOUBLE_EQ(m.node_us(mm), m.compute_us(mm));
  EXPECT_TRUE(m.compute_bound(mm));
  // fp32 output: charged the 10 TFLOP/s fp32 peak, 10x slower.
  EXPECT_DOUBLE_EQ(m.compute_us(compute_node("float32", flops, 0)), static_cast<double>(flops) / 10e6);
  // float16 uses the tensor-core peak like bfloat16; other dtypes the fp32 peak.
  EXPECT_DOUBLE_EQ(m.compute_us(compute_node("float16", flops, 0)), static_cast<double>(flops) / 100e6);
  EXPECT_DOUBLE_EQ(m.compute_us(compute_node("int32", flops, 0)), static_cast<double>(flops) / 10e6);

  // The built-in profile: 989 TFLOP/s x gemm with the ramp: (F + ramp) / (989e6 x gemm) us.
  Profile p = builtin_profile("h200-sxm");
  p.shapes.reset();  // the scalar model (the shape tables: test_shapes.cc)
  CostModel h(p);
  const double f8192 = 2.0 * 8192 * 8192 * 8192;
  const double expected = (f8192 + p.efficiency.gemm_ramp_flops) / (989.0 * 1e6 * p.efficiency.gemm);
  EXPECT_DOUBLE_EQ(h.compute_us(compute_node("bfloat16", static_cast<int64_t>(f8192), 0)), expected);
  // The efficiency is what GEMMs reach inside a compiled training step on one H200 (bench/results/compute-2026-11-24):
  // this GEMM alone took 1387 us in a burst and 1621 us sustained; the step's mix sits between (model 1445 us).
  EXPECT_NEAR(expected, 1445.0, 30.0);
  EXPECT_GT(expected, 1387.0);
  EXPECT_LT(expected, 1621.0);
}

TEST(CostModel, AttentionUsesItsOwnEfficiency) {
  Profile p = round_profile();
  p.efficiency.gemm_ramp_flops = 1e9;  // GEMMs ramp; attention does not
  Node fwd = compute_node("bfloat16", int64_t{1} << 40, 0);
  fwd.op = "aten._scaled_dot_product_cudnn_attention.default";
  Node bwd = fwd;
  bwd.op = "aten._scaled_dot_product_flash_attention_backward.default";
  const double f = static_cast<double>(int64_t{1} << 40);
  // Without attention efficiencies: gemm (1.0), no ramp.
  EXPECT_DOUBLE_EQ(CostModel(p).compute_us(fwd), f / 100e6);
  EXPECT_DOUBLE_EQ(CostModel(p).compute_us(bwd), f / 100e6);
  p.efficiency.attention = 0.5;
  p.efficiency.attention_backward = 0.25;
  CostModel m(p);
  EXPECT_DOUBLE_EQ(m.compute_us(fwd), f / (100e6 * 0.5));
  EXPECT_DOUBLE_EQ(m.compute_us(bwd), f / (100e6 * 0.25));
  EXPECT_TRUE(m.compute_bound(fwd));
  // A GEMM keeps gemm and its ramp.
  EXPECT_DOUBLE_EQ(m.compute_us(compute_node("bfloat16", int64_t{1} << 40, 0)), (f + 1e9) / 100e6);
  // Every backend's attention op is recognized; other ops are not.
  for (const char* op : {"aten._scaled_dot_product_flash_attention_for_cpu.default",
                         "aten._scaled_dot_product_efficient_attention_backward.default",
                         "aten._flash_attention_forward.default", "aten._efficient_attention_backward.default"}) {
    EXPECT_TRUE(is_attention_op(op)) << op;
  }
  for (const char* op : {"aten.mm.default", "aten.bmm.default", "aten._softmax.default"}) {
    EXPECT_FALSE(is_attention_op(op)) << op;
  }
}

TEST(CostModel, FlexAttentionHasItsOwnEfficiencyElseAttentions) {
  Profile p = round_profile();
  p.efficiency.gemm_ramp_flops = 1e9;
  Node fwd = compute_node("bfloat16", int64_t{1} << 40, 0);
  fwd.op = "higher_order.flex_attention";
  Node bwd = fwd;
  bwd.op = "higher_order.flex_attention_backward";
  EXPECT_TRUE(is_attention_op(fwd.op) && is_flex_attention_op(fwd.op) && is_flex_attention_op(bwd.op));
  EXPECT_FALSE(is_flex_attention_op("aten._scaled_dot_product_cudnn_attention.default"));
  const double f = static_cast<double>(int64_t{1} << 40);
  // Neither flex nor attention efficiencies: gemm without its ramp, as any attention op.
  EXPECT_DOUBLE_EQ(CostModel(p).compute_us(fwd), f / 100e6);
  p.efficiency.attention = 0.5;
  p.efficiency.attention_backward = 0.25;
  EXPECT_DOUBLE_EQ(CostModel(p).compute_us(fwd), f / (100e6 * 0.5));   // attention's
  EXPECT_DOUBLE_EQ(CostModel(p).compute_us(bwd), f / (100e6 * 0.25));
  p.efficiency.flex_attention = 0.3;
  p.efficiency.flex_attention_backward = 0.2;
  CostModel m(p);
  EXPECT_DOUBLE_EQ(m.compute_us(fwd), f / (100e6 * 0.3));
  EXPECT_DOUBLE_EQ(m.compute_us(bwd), f / (100e6 * 0.2));
  Node sdpa = fwd;
  sdpa.op = "aten._scaled_dot_product_cudnn_attention.default";
  EXPECT_DOUBLE_EQ(m.compute_us(sdpa), f / (100e6 * 0.5));  // SDPA keeps attention's
}

TEST(CostModel, GemmEfficiencyRamp) {
  Profile p = builtin_profile("h200-sxm");
  p.shapes.reset();  // the scalar model (the shape tables: test_shapes.cc)
  CostModel m(p);
  const double peak_per_us = p.gpu.peak_bf16_tflops * 1e6;
  auto efficiency = [&](double flops) {
    return flops / (peak_per_us * m.compute_us(compute_node("bfloat16", static_cast<int64_t>(flops), 0)));
  };
  // At gemm_ramp_flops a GEMM reaches half the large-GEMM efficiency, by definition of the curve.
  EXPECT_NEAR(efficiency(p.efficiency.gemm_ramp_flops), p.efficiency.gemm / 2, 1e-12);
  // Measured by calibrate on 2x H200 (bench/results/step-prediction-2026-11-27-b, calibrated-C, -D): in short bursts
  // 2048^3 at 621 TFLOP/s, 8192^3 at 773 (of 989); inside a compiled training step GEMMs take 3.4% longer than the
  // bursts' line, and the profile carries that (steady clocks): the curve sits 3.4% under the bursts.
  EXPECT_NEAR(efficiency(2.0 * 2048 * 2048 * 2048), 621.0 / 989.0 / 1.034, 0.05);
  EXPECT_NEAR(efficiency(2.0 * 8192 * 8192 * 8192), 773.0 / 989.0 / 1.034, 0.01);
  // Time rises and efficiency rises with FLOPs (above the launch floor).
  double prev_us = 0, prev_eff = 0;
  for (double f = 1e9; f <= 1e13; f *= 1.5) {
    const double us = m.compute_us(compute_node("bfloat16", static_cast<int64_t>(f), 0));
    EXPECT_GT(us, prev_us) << f;
    EXPECT_GT(efficiency(f), prev_eff) << f;
    prev_us = us;
    prev_eff = efficiency(f);
  }
}

TEST(CostModel, MemoryBoundAndLaunchFloor) {
  CostModel m(round_profile());
  // 1 GiB at 1000 GB/s = 1073.741824 us, above its FLOP time.
  Node add = compute_node("bfloat16", 1 << 20, int64_t{1} << 30);
  EXPECT_DOUBLE_EQ(m.compute_us(add), 1073.741824);
  EXPECT_FALSE(m.compute_bound(add));
  // Tiny and empty kernels cost the launch floor; non-compute nodes cost nothing.
  EXPECT_DOUBLE_EQ(m.compute_us(compute_node("bfloat16", 10, 10)), 5.0);
  EXPECT_DOUBLE_EQ(m.compute_us(compute_node("bfloat16", 0, 0)), 5.0);
  EXPECT_FALSE(m.compute_bound(compute_node("bfloat16", 0, 0)));
  // Classified without the floor: a tiny relu is memory-bound, a tiny matmul compute-bound.
  EXPECT_FALSE(m.compute_bound(compute_node("bfloat16", 1 << 20, 4 << 20)));
  EXPECT_TRUE(m.compute_bound(compute_node("bfloat16", 1 << 24, 1 << 10)));
  Node view = compute_node("bfloat16", 0, 0);
  for (NodeKind k : {NodeKind::View, NodeKind::Wait, NodeKind::Other}) {
    view.kind = k;
    EXPECT_EQ(m.node_us(view), 0.0);
  }
}

// ------------------------------------------------------------------------------------------------
// NCCL

TEST(CostModel, NcclFormulaPerType) {
  CostModel m(round_profile());
  const double link_bytes_per_us = 100.0 * 1e3 * 0.5;  // 100 GB/s x bus efficiency 0.5
  const int64_t b = 64 * kMiB;
  const int n = 4;
  auto expect = [&](CollectiveType t, double bus_bytes, int steps) {
    EXPECT_NEAR(m.collective_us(coll(t, n, b)), 10.0 + 2.0 * steps + bus_bytes / link_bytes_per_us, 1e-9)
        << to_string(t);
  };
  expect(CollectiveType::AllGather, 3.0 * b, 3);
  expect(CollectiveType::ReduceScatter, 0.75 * b, 3);
  expect(CollectiveType::AllReduce, 1.5 * b, 6);
  expect(CollectiveType::AllToAll, 0.75 * b, 3);
  expect(CollectiveType::Broadcast, 1.0 * b, 3);  // pipelined along the ring
  expect(CollectiveType::Send, 1.0 * b, 1);
  expect(CollectiveType::Recv, 1.0 * b, 1);
  for (CollectiveType t : kAllTypes) EXPECT_EQ(m.collective_us(coll(t, 1, b)), 0.0) << to_string(t);

  Node c;
  c.kind = NodeKind::Collective;
  c.collective = coll(CollectiveType::AllGather, n, b);
  EXPECT_DOUBLE_EQ(m.node_us(c), m.collective_us(*c.collective));
  // One phase holding the NCCL channels' SMs; an all-gather reads what it sends, writes what it receives.
  CollectiveEstimate e = m.estimate(coll(CollectiveType::AllGather, n, b), Backend::Nccl);
  ASSERT_EQ(e.phases.size(), 1u);
  EXPECT_EQ(e.phases[0].sms, 20);
  EXPECT_DOUBLE_EQ(e.phases[0].hbm_bytes, 2.0 * 3.0 * b);
  EXPECT_EQ(e.algorithm, "ring/simple");
  EXPECT_DOUBLE_EQ(e.latency_us, 10.0 + 2.0 * 3);
}

TEST(CostModel, NcclPicksTheFastestProtocolLine) {
  Profile p = round_profile();
  p.nccl.protocols = {{"ll", 2.0, 0.5, 0.2}, {"simple", 10.0, 2.0, 0.5}};
  CostModel m(p);
  // 2 ranks: ll = 2.5 + B / 20000, simple = 12 + B / 50000; they cross at B = 316666.7 bytes.
  CollectiveEstimate small = m.estimate(coll(CollectiveType::AllGather, 2, 100000), Backend::Nccl);
  EXPECT_EQ(small.algorithm, "ring/ll");
  EXPECT_DOUBLE_EQ(small.us, 2.5 + 100000 / 20000.0);
  CollectiveEstimate large = m.estimate(coll(CollectiveType::AllGather, 2, 1000000), Backend::Nccl);
  EXPECT_EQ(large.algorithm, "ring/simple");
  EXPECT_DOUBLE_EQ(large.us, 12 + 1000000 / 50000.0);
  // Reductions run at reduction_bandwidth_factor of the copy bandwidth.
  p.nccl.reduction_bandwidth_factor = 0.5;
  CostModel r(p);
  EXPECT_DOUBLE_EQ(r.estimate(coll(CollectiveType::ReduceScatter, 2, 2000000), Backend::Nccl).us,
                   12 + 1000000 / 25000.0);
}

TEST(CostModel, NcclAcrossNodes) {
  Profile p = round_profile();
  p.nccl.inter_node_step_latency_us = 3.0;
  CostModel m(p);
  // 16 ranks on 2 nodes: 15 ring steps, one of them crosses nodes; the inter-node link (10 GB/s x 0.5)
  // is the bottleneck.
  const int64_t b = 64 * kMiB;
  EXPECT_NEAR(m.collective_us(coll(CollectiveType::AllGather, 16, b)), 10 + 15 * 2.0 + 1 * 3.0 + 15.0 * b / 5e3, 1e-6);
  // All-reduce of 512 ranks (64 nodes) and 1 KiB: the tree's 2 x (7 + 6) steps beat the ring's 1022.
  CollectiveEstimate tree = m.estimate(coll(CollectiveType::AllReduce, 512, kKiB), Backend::Nccl);
  EXPECT_EQ(tree.algorithm, "tree/simple");
  EXPECT_NEAR(tree.latency_us, 10 + 2.0 * 7 * 2.0 + 2.0 * 6 * (2.0 + 3.0), 1e-9);
  // On 2 nodes at 1 GiB the ring moves less per rank (2 (n-1)/n vs 2 bytes per byte) and wins.
  EXPECT_EQ(m.estimate(coll(CollectiveType::AllReduce, 16, kGiB), Backend::Nccl).algorithm, "ring/simple");
  // Without an inter-node link, a group larger than a node is an error naming the field.
  p.topology.inter_node.reset();
  CostModel single(p);
  try {
    single.collective_us(coll(CollectiveType::AllGather, 16, b));
    FAIL() << "accepted a 2-node group without topology.inter_node";
  } catch (const IrError& e) {
    EXPECT_TRUE(contains(e.what(), "topology.inter_node")) << e.what();
  }
}

TEST(CostModel, AcrossNodesTheRingDrivesTheNicsOfTheGroupsRanksOnANode) {
  Profile p = builtin_profile("h200-sxm");
  ASSERT_EQ(p.topology.rails, 8);
  const double nic = p.topology.inter_node->gbps_per_direction * p.nccl.inter_node_bus_efficiency;
  CostModel rails8(p);
  p.topology.rails = 1;
  CostModel rails1(p);
  const int64_t huge = int64_t{16} << 30;
  // 16 ranks on 2 nodes: all 8 NICs of a node (8 x 45 GB/s, above NVLink's ring: NVLink binds); with one NIC, it binds.
  const CollectiveInfo ag = coll(CollectiveType::AllGather, 16, huge);
  const double bus = 15.0 * static_cast<double>(huge);
  EXPECT_NEAR(rails1.estimate(ag, Backend::Nccl).us, bus / (nic * 1e3), 0.01 * bus / (nic * 1e3));
  EXPECT_LT(rails8.estimate(ag, Backend::Nccl).us, bus / (4 * nic * 1e3));
  // The rail group of a hierarchical collective has one rank per node: one NIC, whatever the rails.
  CollectiveInfo rail = coll(CollectiveType::AllGather, 2, huge);
  rail.nodes = 2;
  EXPECT_NEAR(rails8.estimate(rail, Backend::Nccl).us, rails1.estimate(rail, Backend::Nccl).us, 1e-6);
  EXPECT_NEAR(rails8.estimate(rail, Backend::Nccl).us, static_cast<double>(huge) / (nic * 1e3),
              0.01 * static_cast<double>(huge) / (nic * 1e3));
}

TEST(CostModel, HierarchicalIsItsRailAndNodeHalvesPlusTheReorderingCopy) {
  const Profile p = builtin_profile("h200-sxm");
  CostModel m(p);
  const double hbm = p.gpu.hbm_gbps * p.efficiency.memory * 1e3;  // bytes per us
  for (int nodes : {2, 8}) {
    const int n = 8 * nodes;
    CollectiveInfo ag = coll(CollectiveType::AllGather, n, 64 * kMiB);
    ag.nodes = nodes;
    CollectiveInfo rail = coll(CollectiveType::AllGather, nodes, 64 * kMiB), node = coll(CollectiveType::AllGather,
                                                                                         8, nodes * 64 * kMiB);
    rail.nodes = nodes;
    const CollectiveEstimate h = m.estimate(ag, Backend::Hier);
    const double rail_us = m.estimate(rail, Backend::Nccl).us, node_us = m.estimate(node, Backend::Ce).us;
    EXPECT_NEAR(h.us, rail_us + node_us, 1e-6) << h.algorithm;
    EXPECT_NEAR(h.consumer_us, p.efficiency.kernel_launch_us + 2.0 * n * 64 * kMiB / hbm, 1e-6);
    EXPECT_TRUE(starts_with(h.algorithm, "hier: ")) << h.algorithm;
    double nccl_us = 0;
    for (const CollectivePhase& ph : h.phases) nccl_us += ph.nccl ? ph.us : 0.0;
    EXPECT_NEAR(nccl_us, rail_us, 1e-6);
    // Reduce-scatter: the node half on the full input, then the rail half on the node's sum of M chunks.
    CollectiveInfo rs = coll(CollectiveType::ReduceScatter, n, n * kMiB);
    rs.reduce_op = "sum";
    rs.nodes = nodes;
    CollectiveInfo rs_node = coll(CollectiveType::ReduceScatter, 8, n * kMiB);
    CollectiveInfo rs_rail = coll(CollectiveType::ReduceScatter, nodes, nodes * kMiB);
    rs_node.reduce_op = rs_rail.reduce_op = "sum";
    rs_rail.nodes = nodes;
    EXPECT_NEAR(m.estimate(rs, Backend::Hier).us,
                m.estimate(rs_node, Backend::Ce).us + m.estimate(rs_rail, Backend::Nccl).us, 1e-6);
  }
  // What it cannot serve, by name.
  CollectiveInfo ar = coll(CollectiveType::AllReduce, 16, kMiB);
  EXPECT_EQ(*m.hier_blocker(ar), "hierarchical: only all-gathers and reduce-scatters, not all_reduce");
  EXPECT_EQ(*m.hier_blocker(coll(CollectiveType::AllGather, 8, kMiB)), "hierarchical: the group is on one node");
  CollectiveInfo one = coll(CollectiveType::AllGather, 4, kMiB);
  one.nodes = 4;
  EXPECT_EQ(*m.hier_blocker(one), "hierarchical: one rank per node (the rail is the group)");
  EXPECT_EQ(*m.hier_blocker(coll(CollectiveType::AllGather, 12, kMiB)),
            "hierarchical: 12 ranks over 2 nodes are not as many on each");
  EXPECT_THROW(m.estimate(ar, Backend::Hier), IrError);
}

TEST(CostModel, InterNodeSlowerThanIntraNode) {
  CostModel m(builtin_profile("h100-sxm"));
  for (CollectiveType t : kAllTypes) {
    // 8 ranks fit one node; 9 spill onto the inter-node link. Compare per-rank bus bandwidth.
    const double intra = m.collective_us(coll(t, 8, 256 * kMiB));
    const double inter = m.collective_us(coll(t, 9, 256 * kMiB));
    EXPECT_GT(inter, 5.0 * intra) << to_string(t);
  }
}

// ------------------------------------------------------------------------------------------------
// Copy engines

TEST(CostModel, LinkShareIsTheBusBytesOverTheUsableLink) {
  // Round profile: a 100 GB/s link, both directions busy at 0.5 of it: 50 GB/s usable (50e3 bytes per us).
  const CostModel model(round_profile());
  EXPECT_DOUBLE_EQ(model.link_share(coll(CollectiveType::AllGather, 8, 1000000), 1000), 7e6 / 50e6);
  EXPECT_DOUBLE_EQ(model.link_share(coll(CollectiveType::ReduceScatter, 8, 8000000), 1000), 7e6 / 50e6);
  EXPECT_DOUBLE_EQ(model.link_share(coll(CollectiveType::AllReduce, 8, 8000000), 1000), 14e6 / 50e6);
  EXPECT_DOUBLE_EQ(model.link_share(coll(CollectiveType::AllGather, 8, 1000000), 10), 1.0);  // at most the link
  EXPECT_EQ(model.link_share(coll(CollectiveType::AllGather, 1, 1000000), 1000), 0);  // nothing moves
  EXPECT_EQ(model.link_share(coll(CollectiveType::AllGather, 16, 1000000), 1000), 0);  // two nodes: the network's
  EXPECT_EQ(model.link_share(coll(CollectiveType::AllGather, 8, 1000000), 0), 0);
}

TEST(CostModel, CeFormulaPerType) {
  // Round profile: 10 us signalling + 2 us per peer copy (one peer after another); link 100 GB/s, 0.5 both ways
  // (50 GB/s), 0.8 one way (80 GB/s); engines of 100 GB/s; reduction on 10 SMs x 10 GB/s = 100 GB/s.
  CostModel m(round_profile());
  const double b = 64.0 * kMiB;
  auto us = [&](CollectiveType t, int n) { return m.estimate(coll(t, n, static_cast<int64_t>(b)), Backend::Ce).us; };
  EXPECT_NEAR(us(CollectiveType::AllGather, 4), 16 + 3 * b / 50e3, 1e-6);      // 3 pulls, one after another
  EXPECT_NEAR(us(CollectiveType::AllGather, 8), 24 + 7 * b / 50e3, 1e-6);      // 7 pulls
  EXPECT_NEAR(us(CollectiveType::AllToAll, 4), 16 + 0.75 * b / 50e3, 1e-6);    // 3 chunks of b/4
  EXPECT_NEAR(us(CollectiveType::ReduceScatter, 4),                            // a2a, then reduce 5 chunks
              16 + 0.75 * b / 50e3 + 5 + 1.25 * b / 100e3, 1e-6);
  EXPECT_NEAR(us(CollectiveType::AllReduce, 4),                                // reduce-scatter + all-gather
              16 + 0.75 * b / 50e3 + 5 + 1.25 * b / 100e3 + 16 + 0.75 * b / 50e3, 1e-6);
  // 3 ranks: the root's port carries 2 copies at 80 GB/s one way, or (64 MiB = 4 units of the runtime's 16 MiB round
  // cost: broadcast_segments picks 2 segments) 2.5 half-tensors both ways, 3 rounds of 10 + 2 x 2.
  ASSERT_EQ(ce_overlap::broadcast_segments(3, static_cast<size_t>(b), 0), 2u);
  EXPECT_NEAR(us(CollectiveType::Broadcast, 3), 3 * (10 + 2 * 2) + 1.25 * b / 50e3, 1e-6);
  ASSERT_EQ(ce_overlap::broadcast_segments(2, static_cast<size_t>(b), 0), 0u);
  EXPECT_NEAR(us(CollectiveType::Broadcast, 2), 12 + b / 80e3, 1e-6);          // 2 ranks: the whole pull
  EXPECT_NEAR(us(CollectiveType::Send, 4), 12 + b / 80e3, 1e-6);
  EXPECT_NEAR(us(CollectiveType::Recv, 2), 12 + b / 80e3, 1e-6);

  CollectiveEstimate rs = m.estimate(coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(b)), Backend::Ce);
  ASSERT_EQ(rs.phases.size(), 2u);
  EXPECT_EQ(rs.phases[0].sms, 0);   // copies hold no SMs
  EXPECT_EQ(rs.phases[1].sms, 10);  // the reduction kernel does
  EXPECT_DOUBLE_EQ(rs.phases[1].hbm_bytes, 1.25 * b);
  EXPECT_DOUBLE_EQ(rs.latency_us, 16 + 5);
  EXPECT_EQ(rs.algorithm, "ce/a2a+reduce");
}

TEST(CostModel, CeReduceScatterPipelinesItsRounds) {
  // 4 ranks, 1 GiB in: 256 MiB chunks in 6 rounds of 128/3 MiB (the 64 MiB round capped by a staging slot, a
  // 128 MiB bank over 3 senders). Per round: the handshake (signal 10) and copies c = 10 + 3 x 2 + 3 x r at 50 GB/s,
  // reduction d = 5 + 5 x r at 10 SMs x 10 GB/s. The runtime reduces round k beside the copies of k+1.
  Profile p = round_profile();
  const double b = 1024.0 * kMiB, r = 128.0 / 3 * kMiB;
  const double c = 10 + 3 * 2 + 3 * r / 50e3, d = 5 + 5 * r / 100e3;
  ASSERT_GT(c, d);  // copy-bound
  CollectiveEstimate rs = CostModel(p).estimate(coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(b)),
                                                Backend::Ce);
  EXPECT_NEAR(rs.us, 6 * c + d, 1e-6);  // not 6c + 6d: only the last reduction is exposed
  ASSERT_EQ(rs.phases.size(), 3u);
  EXPECT_NEAR(rs.phases[0].us, 6 * c - 5 * d, 1e-6);  // copies alone
  EXPECT_EQ(rs.phases[0].sms, 0);
  EXPECT_FALSE(rs.phases[0].reduction);
  EXPECT_NEAR(rs.phases[1].us, 5 * d, 1e-6);  // copies beside the reduction
  EXPECT_TRUE(rs.phases[1].reduction);
  EXPECT_EQ(rs.phases[1].sms, 10);
  EXPECT_NEAR(rs.phases[1].reduction_hbm_bytes, 5 * 5 * r, 1e-3);
  EXPECT_NEAR(rs.phases[1].hbm_bytes - rs.phases[1].reduction_hbm_bytes, 5 * d / c * 2 * 3 * r, 1e-3);
  EXPECT_NEAR(rs.phases[2].us, d, 1e-6);  // the last reduction alone
  EXPECT_NEAR(rs.phases[2].hbm_bytes, 5 * r, 1e-3);

  // A slow reduction (10 SMs x 2 GB/s) bounds it instead: the first copies, then one reduction after another.
  p.ce.reduce_gbps_per_sm = 2;
  const double slow_d = 5 + 5 * r / 20e3;
  CollectiveEstimate slow = CostModel(p).estimate(coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(b)),
                                                  Backend::Ce);
  EXPECT_NEAR(slow.us, c + 6 * slow_d, 1e-6);
  EXPECT_NEAR(slow.phases[1].us, 5 * c, 1e-6);
  EXPECT_NEAR(slow.phases[2].us, 6 * slow_d - 5 * c, 1e-6);
}

TEST(CostModel, CeReduceScatterWithTheSumInTheConsumerTakesNoSms) {
  // The same 6 rounds as above; instead of the reduction, a copy engine copies each round's 3 received chunks out
  // of the staging slots (3 copies of 2 us latency, r each at the 100 GB/s engine, under half the HBM) beside the
  // next round's pushes. The consumer reads the 3 peer chunks of 256 MiB at the 1000 GB/s HBM roofline.
  const Profile p = round_profile();
  const double b = 1024.0 * kMiB, r = 128.0 / 3 * kMiB;
  const double c = 10 + 3 * 2 + 3 * r / 50e3, d = 3 * 2 + 3 * r / 100e3;
  ASSERT_GT(c, d);
  CostModel m(p);
  EXPECT_EQ(m.ce_reduction(), CeReduction::Kernel);  // the default: the runtime's reducing op
  m.set_ce_reduction(CeReduction::Consumer);
  const CollectiveEstimate rs = m.estimate(coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(b)), Backend::Ce);
  EXPECT_EQ(rs.algorithm, "ce/a2a, sum in the consumer");
  EXPECT_NEAR(rs.us, 6 * c + d, 1e-6);
  ASSERT_EQ(rs.phases.size(), 3u);
  for (const CollectivePhase& ph : rs.phases) {
    EXPECT_EQ(ph.sms, 0);
    EXPECT_FALSE(ph.reduction);
  }
  EXPECT_NEAR(rs.phases[1].us, 5 * d, 1e-6);  // pushes beside the copy-out
  EXPECT_NEAR(rs.phases[2].hbm_bytes, 2 * 3 * r, 1e-3);  // the last copy-out: read the slots, write the rows
  EXPECT_NEAR(rs.consumer_us, 3 * 256.0 * kMiB / 1000e3, 1e-6);
  // What the step pays: the consumer's extra read comes on top of the exposed time and the slowdown.
  const BackendCost cost = m.cost(coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(b)), Backend::Ce, {});
  EXPECT_NEAR(cost.cost_us, cost.exposed_us + cost.slowdown_us + rs.consumer_us, 1e-6);
  EXPECT_NEAR(cost.exposed_us, cost.comm_us, 1e-6);  // no window: all of it exposed
  // NCCL is unaffected; a group of one moves nothing, so nothing is left to sum.
  EXPECT_EQ(m.estimate(coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(b)), Backend::Nccl).consumer_us, 0);
  EXPECT_EQ(m.estimate(coll(CollectiveType::ReduceScatter, 1, static_cast<int64_t>(b)), Backend::Ce).consumer_us, 0);
}

TEST(CostModel, MeasuredReductionKernelContentionReplacesTheSmFormula) {
  Profile p = round_profile();
  const CollectiveInfo rs = coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(1024.0 * kMiB));
  const CollectiveEstimate e = CostModel(p).estimate(rs, Backend::Ce);
  const CollectivePhase& both = e.phases.at(1);
  const CollectivePhase& alone = e.phases.at(2);
  auto hbm_term = [](double bytes, double us) {
    const double rate = bytes / us / 1e3;
    return rate / (1000 - rate);
  };
  // Without a measurement: the kernel's 10 CTAs count as 10 of 100 SMs taken, plus all of the phase's traffic.
  const Slowdown formula = CostModel(p).slowdown_beside(alone);
  EXPECT_NEAR(formula.compute_bound, 10.0 / 90 + 0.1 * hbm_term(alone.hbm_bytes, alone.us), 1e-9);
  // Measured: the kernel costs what was measured; the copies' traffic beside it still goes through the formula.
  p.contention.ce_reduction = KernelClassSlowdown{0.08, 0.5};
  CostModel m(p);
  const Slowdown s_alone = m.slowdown_beside(alone);
  EXPECT_NEAR(s_alone.compute_bound, 0.08, 1e-9);
  EXPECT_NEAR(s_alone.memory_bound, 0.5, 1e-9);
  const Slowdown s_both = m.slowdown_beside(both);
  const double copies = hbm_term(both.hbm_bytes - both.reduction_hbm_bytes, both.us);
  EXPECT_NEAR(s_both.compute_bound, 0.08 + 0.1 * copies, 1e-9);
  EXPECT_NEAR(s_both.memory_bound, 0.5 + 1.0 * copies, 1e-9);
  // Phases without the kernel are unchanged.
  EXPECT_DOUBLE_EQ(m.slowdown_beside(e.phases.at(0)).compute_bound,
                   CostModel(round_profile()).slowdown_beside(e.phases.at(0)).compute_bound);
}

TEST(CostModel, CopyEngineTermAddsToEveryCePhaseThatCopies) {
  Profile p = round_profile();
  const CollectiveInfo ag = coll(CollectiveType::AllGather, 2, static_cast<int64_t>(256.0 * kMiB));
  const CollectiveInfo rs = coll(CollectiveType::ReduceScatter, 4, static_cast<int64_t>(1024.0 * kMiB));
  const OverlapWindow gemms{5000.0, 0.0};
  const BackendCost ag_before = CostModel(p).cost(ag, Backend::Ce, gemms);
  const BackendCost nccl_before = CostModel(p).cost(ag, Backend::Nccl, gemms);
  const BackendCost rs_before = CostModel(p).cost(rs, Backend::Ce, gemms);
  p.contention.ce_copies = KernelClassSlowdown{0.1, 0.0};
  CostModel m(p);
  // The all-gather is copies from end to end: a GEMM beside it is 10 points slower throughout.
  const BackendCost ag_after = m.cost(ag, Backend::Ce, gemms);
  EXPECT_NEAR(ag_after.slowdown.compute_bound, ag_before.slowdown.compute_bound + 0.1, 1e-9);
  EXPECT_GT(ag_after.slowdown_us, ag_before.slowdown_us);
  // NCCL is not the copy engines: unchanged.
  EXPECT_DOUBLE_EQ(m.cost(ag, Backend::Nccl, gemms).slowdown_us, nccl_before.slowdown_us);
  // The reducing reduce-scatter's last phase is the kernel alone (no copies): the term covers only the copy phases.
  const CollectiveEstimate e = m.estimate(rs, Backend::Ce);
  double copy_us = 0;
  for (const CollectivePhase& ph : e.phases) copy_us += ph.reduction && ph.hbm_bytes <= ph.reduction_hbm_bytes ? 0 : ph.us;
  ASSERT_LT(copy_us, e.us);
  const BackendCost rs_after = m.cost(rs, Backend::Ce, gemms);
  EXPECT_NEAR(rs_after.slowdown.compute_bound * rs_after.comm_us,
              rs_before.slowdown.compute_bound * rs_before.comm_us + 0.1 * copy_us * rs_after.comm_us / e.us, 1e-6);
}

TEST(CeAlgorithms, BroadcastSegmentsFollowTheirTimeModel) {
  constexpr size_t MiB = size_t{1} << 20;
  // 2 ranks pull the whole tensor (one peer: nothing to scatter); so do empty tensors.
  EXPECT_EQ(broadcast_segments(2, 1024 * MiB, 0), 0u);
  EXPECT_EQ(broadcast_segments(8, 0, 0), 0u);
  // A tensor of a round's cost or less: the extra round of the scatter costs more than the root's extra bytes.
  EXPECT_EQ(broadcast_segments(4, 1 * MiB, 0), 0u);
  // Bigger tensors scatter, over more segments as they grow (never more than kMaxBcastSegments).
  size_t previous = 0;
  for (size_t mib : {16, 64, 256, 1024, 16384, 1 << 20}) {
    const size_t k = broadcast_segments(4, mib * MiB, 0);
    EXPECT_GE(k, std::max<size_t>(previous, 1)) << mib << " MiB";
    EXPECT_LE(k, static_cast<size_t>(kMaxBcastSegments)) << mib << " MiB";
    previous = k;
  }
  // The choice is the least of its own time model: the whole pull takes (n-1) N + 1 round costs, K segments
  // (K + (n-2)/(n-1)) N / K + K + 1 (N in round costs).
  for (int n : {3, 4, 8}) {
    for (size_t mib : {2, 8, 64, 256}) {
      SCOPED_TRACE(std::to_string(n) + " ranks, " + std::to_string(mib) + " MiB");
      const double N = static_cast<double>(mib * MiB) / kBroadcastRoundBytes;
      auto t = [&](double K) { return (K + (n - 2.0) / (n - 1.0)) * N / K + K + 1; };
      const size_t k = broadcast_segments(n, mib * MiB, 0);
      const double chosen = k == 0 ? (n - 1) * N + 1 : t(static_cast<double>(k));
      EXPECT_LE(chosen, (n - 1) * N + 1);
      for (int other = 1; other <= kMaxBcastSegments; ++other) EXPECT_LE(chosen, t(other) + 1e-9);
    }
  }
  EXPECT_EQ(broadcast_segments(3, 8 * MiB, 0), 0u);  // half a round cost: 2 ranks' worth of bytes is cheaper
  EXPECT_GT(broadcast_segments(8, 8 * MiB, 0), 0u);  // ... but not the root's 7 copies
  // A tuned count is taken as it is, from 3 ranks on.
  EXPECT_EQ(broadcast_segments(3, 4096, 7), 7u);
  EXPECT_EQ(broadcast_segments(2, 4096, 7), 0u);
}

TEST(CeAlgorithms, PushBroadcastRelaysOnEvenWorldSizes) {
  constexpr size_t MiB = size_t{1} << 20;
  constexpr size_t big = 256 * MiB;
  EXPECT_FALSE(broadcast_relays(2, big));
  EXPECT_FALSE(broadcast_relays(3, big));
  EXPECT_TRUE(broadcast_relays(4, big));
  EXPECT_FALSE(broadcast_relays(5, big));
  EXPECT_TRUE(broadcast_relays(8, big));
  EXPECT_TRUE(broadcast_relays(4, kRelayMinBytes));
  EXPECT_FALSE(broadcast_relays(4, kRelayMinBytes - 1));  // small tensors: the lane order
  // Segments: tuned as given; one without a relay; with one, more as the tensor grows, balancing the fill
  // (m-1)/(m K) N against one copy's fixed cost per slot (K = sqrt(N (m-1) / (g m^2))).
  EXPECT_EQ(broadcast_push_segments(2, 64 * MiB, 0), 0u);
  EXPECT_EQ(broadcast_push_segments(4, 0, 0), 0u);
  EXPECT_EQ(broadcast_push_segments(3, big, 0), 1u);
  EXPECT_EQ(broadcast_push_segments(4, big, 5), 5u);
  EXPECT_EQ(broadcast_push_segments(4, 16 * MiB, 0), 1u);
  size_t previous = 1;
  for (size_t mib : {32, 64, 256, 1024}) {
    const size_t k = broadcast_push_segments(4, mib * MiB, 0);
    EXPECT_GE(k, previous) << mib << " MiB";
    const double m = 3, want = std::sqrt(static_cast<double>(mib * MiB) * (m - 1) / (kRelayCopyBytes * m * m));
    EXPECT_NEAR(static_cast<double>(k), want, 0.5) << mib << " MiB";
    previous = k;
  }
  EXPECT_EQ(broadcast_push_segments(8, size_t{1} << 40, 0), static_cast<size_t>(kMaxBcastSegments));
  // Orders are empty where there is no relay.
  EXPECT_TRUE(broadcast_relay_order(3, 0, 4).empty());
  EXPECT_TRUE(broadcast_relay_order(4, 3, 4).empty());  // 3 non-roots: indices 0..2
  for (int n : {4, 6, 8}) {
    const int m = n - 1;
    for (int K : {1, 2, 3, 8, 17}) {
      // Every non-root pulls each segment once, in order, and pushes each segment to every other non-root once, after
      // its pull (the stream order is all that keeps a push behind its pull).
      std::vector<std::vector<RelayCopy>> orders;
      for (int me = 0; me < m; ++me) {
        SCOPED_TRACE(std::to_string(n) + " ranks, " + std::to_string(K) + " segments, non-root " + std::to_string(me));
        const std::vector<RelayCopy> order = broadcast_relay_order(n, me, static_cast<size_t>(K));
        ASSERT_EQ(order.size(), static_cast<size_t>(K * m));
        int next_pull = 0;
        std::set<std::pair<int, int>> pushed;
        for (const RelayCopy& c : order) {
          if (c.pull) {
            EXPECT_EQ(c.segment, next_pull++);
            continue;
          }
          EXPECT_LT(c.segment, next_pull);
          EXPECT_NE(c.to, me);
          EXPECT_TRUE(c.to >= 0 && c.to < m);
          EXPECT_TRUE(pushed.insert({c.segment, c.to}).second);
        }
        EXPECT_EQ(next_pull, K);
        EXPECT_EQ(pushed.size(), static_cast<size_t>(K * (m - 1)));
        orders.push_back(order);
      }
      // The steady state: after everyone's fill pull, copy i + 1 of every non-root runs in slot i; in slot i < m (K - 1)
      // exactly one non-root pulls and the others push in pairs (x to y while y to x), so every port carries one copy
      // each way.
      for (int slot = 0; slot < m * (K - 1); ++slot) {
        SCOPED_TRACE(std::to_string(n) + " ranks, " + std::to_string(K) + " segments, slot " + std::to_string(slot));
        int pullers = 0;
        for (int x = 0; x < m; ++x) {
          const RelayCopy& c = orders[static_cast<size_t>(x)][static_cast<size_t>(slot + 1)];
          if (c.pull) {
            ++pullers;
            continue;
          }
          const RelayCopy& back = orders[static_cast<size_t>(c.to)][static_cast<size_t>(slot + 1)];
          EXPECT_FALSE(back.pull);
          EXPECT_EQ(back.to, x);
        }
        EXPECT_EQ(pullers, 1);
      }
    }
  }
}

TEST(CostModel, CeLimitedByEnginesAndSlowPairs) {
  Profile p = round_profile();
  p.gpu.copy_engines = 1;
  p.ce.engine_gbps = 20;  // one engine at 20 GB/s caps the pulls below the link's 50
  CostModel one(p);
  const double b = 16.0 * kMiB;
  EXPECT_NEAR(one.estimate(coll(CollectiveType::AllGather, 4, static_cast<int64_t>(b)), Backend::Ce).us,
              10 + 3 * 2 + 3 * b / 20e3, 1e-6);
  p = round_profile();
  p.topology.pairs.push_back({1, 2, {"nvlink4", 10.0, true}});  // one slow pair: its pull takes longest
  CostModel slow(p);
  EXPECT_NEAR(slow.estimate(coll(CollectiveType::AllGather, 4, static_cast<int64_t>(b)), Backend::Ce).us,
              16 + b / 5e3, 1e-6);
}

// ------------------------------------------------------------------------------------------------
// Every backend on every built-in profile: monotone, and correct limits.

TEST(CostModel, MonotonicInBytesAndGroupSize) {
  for (const char* name : kBuiltins) {
    // The formulas grow with the group size; the measured NCCL factors need not (NCCL's own 3-rank all-to-all runs at
    // half its 2- and 4-rank speed: nccl.bus_efficiency_scale), so the group-size loop runs without them.
    Profile formulas = builtin_profile(name);
    formulas.nccl.bus_efficiency_scale.clear();
    CostModel m(builtin_profile(name)), f(formulas);
    const int ce_max = largest_ce_group(m);
    for (Backend backend : {Backend::Nccl, Backend::Ce}) {
      const int max_group = backend == Backend::Nccl ? 1024 : ce_max;
      for (CollectiveType t : kAllTypes) {
        SCOPED_TRACE(std::string(name) + " " + to_string(backend) + " " + to_string(t));
        for (int n : {2, max_group}) {
          if (n > max_group) continue;
          double prev = 0;
          for (int64_t bytes = 0; bytes <= (int64_t{1} << 34); bytes = bytes ? bytes * 2 : 1) {
            const double us = m.estimate(coll(t, n, bytes), backend).us;
            EXPECT_GE(us, prev) << n << " ranks, " << bytes << " bytes";
            prev = us;
          }
        }
        for (int64_t bytes : {int64_t{4096}, 64 * kMiB}) {
          double prev = 0;
          for (int n = 1; n <= max_group; ++n) {
            // Past one node, a partly filled last node drives fewer NICs than a full one: full nodes only.
            const int g = m.profile().topology.gpus_per_node;
            if (n > g && n % g != 0) continue;
            const double us = f.estimate(coll(t, n, bytes), backend).us;
            EXPECT_GE(us, prev) << n << " ranks, " << bytes << " bytes";
            prev = us;
          }
        }
      }
    }
  }
}

// Bus bytes per byte of CollectiveInfo::bytes for the ring, as nccl-tests defines busbw.
double bus_factor(CollectiveType t, int n) {
  switch (t) {
    case CollectiveType::AllGather:
      return n - 1.0;
    case CollectiveType::AllReduce:
      return 2.0 * (n - 1) / n;
    case CollectiveType::ReduceScatter:
    case CollectiveType::AllToAll:
      return (n - 1.0) / n;
    default:
      return 1.0;
  }
}

// Slowest link on the ring 0 -> 1 -> ... -> n-1 (-> 0 inside one node) among the intra-node pairs.
double ring_min_gbps(const Profile& p, int n) {
  const int g = p.topology.gpus_per_node;
  const int in_node = std::min(n, g);
  double gbps = 1e300;
  for (int i = 0; i + 1 < in_node; ++i) gbps = std::min(gbps, p.topology.link(i, i + 1).gbps_per_direction);
  if (n <= g) gbps = std::min(gbps, p.topology.link(n - 1, 0).gbps_per_direction);
  return gbps;
}

TEST(CostModel, LatencyAndBandwidthBound) {
  for (const char* name : kBuiltins) {
    Profile p = builtin_profile(name);
    CostModel m(p);
    const int64_t huge = int64_t{64} << 30;
    for (CollectiveType t : kAllTypes) {
      SCOPED_TRACE(std::string(name) + " " + to_string(t));
      // NCCL inside a node (4 ranks) and across two (16): 16 bytes cost the fastest line's latency,
      // 64 GiB cost the bus bytes over the bottleneck at the best line's efficiency, within 1%.
      for (int n : {4, 16}) {
        const bool spans = n > p.topology.gpus_per_node;
        CollectiveEstimate tiny = m.estimate(coll(t, n, 16), Backend::Nccl);
        EXPECT_LT(tiny.us - tiny.latency_us, 0.01 * tiny.us) << n;
        double best_eff = 0, min_latency = 1e30;
        const int steps = t == CollectiveType::AllReduce                                  ? 2 * (n - 1)
                          : t == CollectiveType::Send || t == CollectiveType::Recv        ? 1
                                                                                          : n - 1;
        const int inter_steps = !spans ? 0 : t == CollectiveType::AllReduce ? 2 : 1;
        const double scale = p.nccl.scale(t, std::min(n, p.topology.gpus_per_node));
        for (const NcclProtocol& q : p.nccl.protocols) {
          best_eff = std::max(best_eff, std::min(1.0, q.bus_efficiency * scale));
          min_latency = std::min(min_latency, q.base_latency_us + steps * q.per_step_latency_us +
                                                  inter_steps * p.nccl.inter_node_step_latency_us);
        }
        if (t != CollectiveType::AllReduce || !spans) {
          EXPECT_NEAR(tiny.latency_us, min_latency, 1e-9) << n;
        }
        double gbps = ring_min_gbps(p, n) * best_eff;
        // Across nodes, the NICs of the group's ranks on a node (8 here: rail-optimized, one per GPU; a send one).
        const bool p2p = t == CollectiveType::Send || t == CollectiveType::Recv;
        const int nics = p2p ? 1 : std::min(n / 2, p.topology.rails);
        if (spans) {
          gbps = std::min(gbps, nics * p.topology.inter_node->gbps_per_direction * p.nccl.inter_node_bus_efficiency);
        }
        if (t == CollectiveType::ReduceScatter || t == CollectiveType::AllReduce) {
          gbps *= p.nccl.reduction_bandwidth_factor;
        }
        const double bandwidth_us = bus_factor(t, n) * static_cast<double>(huge) / (gbps * 1e3);
        const double us = m.estimate(coll(t, n, huge), Backend::Nccl).us;
        EXPECT_LT(std::abs(us - bandwidth_us) / bandwidth_us, 0.01) << n;
      }
      // CE on 2 ranks: the same limits with the copy engines' own numbers.
      CollectiveEstimate tiny = m.estimate(coll(t, 2, 16), Backend::Ce);
      EXPECT_LT(tiny.us - tiny.latency_us, 0.01 * tiny.us);
      const double link = p.topology.intra_node->gbps_per_direction;
      const double both = std::min(link * p.ce.bidirectional_efficiency, p.ce.engine_gbps);
      const double one = std::min(link * p.ce.one_way_efficiency, p.ce.engine_gbps);
      const double reduce = std::min(p.gpu.hbm_gbps * p.efficiency.memory, p.ce.reduce_sms * p.ce.reduce_gbps_per_sm);
      const double h = static_cast<double>(huge);
      double bandwidth_us = 0;
      switch (t) {
        case CollectiveType::AllGather: bandwidth_us = h / (both * 1e3); break;
        case CollectiveType::AllToAll: bandwidth_us = h / 2 / (both * 1e3); break;
        case CollectiveType::ReduceScatter: {
          // Rounds of 64 MiB per chunk, the reduction of one beside the copies of the next: the slower stage
          // (with its per-round handshake and copy latency, or reduction launch) bounds it, not their sum.
          const double rounds = std::ceil(h / 2 / (64.0 * 1024 * 1024));
          bandwidth_us = std::max(h / 2 / (both * 1e3) + rounds * (p.ce.signal_latency_us + p.ce.copy_latency_us),
                                  1.5 * h / (reduce * 1e3) + rounds * p.efficiency.kernel_launch_us);
          break;
        }
        case CollectiveType::AllReduce: bandwidth_us = h / (both * 1e3) + 1.5 * h / (reduce * 1e3); break;
        default: bandwidth_us = h / (one * 1e3); break;
      }
      const double us = m.estimate(coll(t, 2, huge), Backend::Ce).us;
      EXPECT_LT(std::abs(us - bandwidth_us) / bandwidth_us, 0.01);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// When CE is not an option

const std::vector<OverlapWindow> kWindows = {{0, 0}, {1900, 0}, {0, 1900}, {50000, 50000}};
const std::vector<int64_t> kSizes = {4 * kKiB, 64 * kKiB, 4 * kMiB, 64 * kMiB, kGiB};

TEST(Decide, MultiNodeGroupNeverChoosesCeAndHierarchicalOnlyWhereItServesAndCostsLess) {
  for (const char* name : kBuiltins) {
    CostModel m(builtin_profile(name));
    for (CollectiveType t : kAllTypes) {
      for (int n : {9, 16, 64, 1024}) {
        for (int64_t bytes : kSizes) {
          for (const OverlapWindow& w : kWindows) {
            const CollectiveInfo c = coll(t, n, bytes);
            Decision d = m.decide(c, w);
            EXPECT_NE(d.choice, Backend::Ce) << name << " " << to_string(t) << " " << n;
            EXPECT_FALSE(d.ce.has_value());
            // 9 ranks on 8-GPU nodes are not as many on each; only all-gathers and reduce-scatters are hierarchical.
            // And the node half needs copy engines among a node's 8 GPUs (not h100-pcie's, across NUMA nodes).
            const bool hier = n % 8 == 0 && (t == CollectiveType::AllGather || t == CollectiveType::ReduceScatter) &&
                              !m.ce_blocker(8, 1);
            EXPECT_EQ(m.hier_blocker(c).has_value(), !hier) << name << " " << to_string(t) << " " << n;
            EXPECT_EQ(d.hier.has_value(), hier);
            if (!hier) {
              EXPECT_EQ(d.choice, Backend::Nccl);
              EXPECT_TRUE(starts_with(d.reason, "nccl: group spans ")) << d.reason;
              continue;
            }
            EXPECT_EQ(d.choice == Backend::Hier, d.hier->cost_us < d.nccl.cost_us) << d.reason;
            EXPECT_TRUE(starts_with(d.reason, d.choice == Backend::Hier ? "hier: saves " : "nccl: group spans "))
                << d.reason;
          }
        }
        EXPECT_THROW(m.estimate(coll(t, n, kMiB), Backend::Ce), IrError);
      }
    }
  }
  CostModel h(builtin_profile("h200-sxm"));
  // 16 ranks on 2 nodes, 64 MiB each: flat NCCL (8 NICs per node) against the hierarchical choice, said.
  const std::string why = h.decide(coll(CollectiveType::AllGather, 16, 64 * kMiB), {1900, 0}).reason;
  EXPECT_TRUE(starts_with(why, "nccl: group spans 2 nodes; CE needs one NVLink domain; flat NCCL saves ")) << why;
  EXPECT_TRUE(contains(why, " hierarchical (") && contains(why, " flat NCCL (")) << why;
  try {
    h.estimate(coll(CollectiveType::AllGather, 16, kMiB), Backend::Ce);
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "ce: group spans 2 nodes; CE needs one NVLink domain");
  }
}

TEST(Decide, GroupWithoutP2pNeverChoosesCe) {
  Profile p = builtin_profile("h200-sxm");
  p.topology.pairs.push_back({0, 3, {"pcie5", 50.0, false}});  // one pair that cannot map the other
  CostModel m(p);
  for (CollectiveType t : kAllTypes) {
    for (int n = 4; n <= 8; ++n) {
      for (int64_t bytes : kSizes) {
        for (const OverlapWindow& w : kWindows) {
          Decision d = m.decide(coll(t, n, bytes), w);
          EXPECT_EQ(d.choice, Backend::Nccl);
          EXPECT_EQ(d.reason, "nccl: no P2P between ranks 0 and 3 (pcie5 link)");
        }
      }
    }
  }
  // Ranks 0..2 still map each other: with GEMMs beside it, CE serves them.
  Decision d3 = m.decide(coll(CollectiveType::AllGather, 3, 64 * kMiB), {1900, 0});
  EXPECT_EQ(d3.choice, Backend::Ce) << d3.reason;
  // The PCIe profile: no P2P across CPU sockets.
  CostModel pcie(builtin_profile("h100-pcie"));
  EXPECT_EQ(pcie.decide(coll(CollectiveType::AllGather, 8, 64 * kMiB), {1900, 0}).reason,
            "nccl: no P2P between ranks 0 and 4 (sys link, NUMA nodes 0 and 1)");
}

TEST(Decide, PcieProfileNeverPicksCeForNvlinkReasons) {
  CostModel pcie(builtin_profile("h100-pcie"));
  CostModel sxm(builtin_profile("h100-sxm"));
  for (CollectiveType t : kAllTypes) {
    for (int n = 2; n <= 16; ++n) {
      for (int64_t bytes : kSizes) {
        for (const OverlapWindow& w : kWindows) {
          Decision d = pcie.decide(coll(t, n, bytes), w);
          EXPECT_FALSE(contains(d.reason, "NVLink")) << d.reason;
          if (n > 4) {
            EXPECT_EQ(d.choice, Backend::Nccl) << n;  // across sockets or nodes
          }
          if (d.choice != Backend::Ce) continue;
          // Any CE pick is priced at PCIe speed: never faster than the raw 63 GB/s port allows.
          const double port_us = bytes * bus_factor(t, n) / 63e3;
          EXPECT_GE(d.ce->comm_us, port_us) << to_string(t) << " " << n << " " << bytes;
        }
      }
    }
  }
  EXPECT_EQ(pcie.decide(coll(CollectiveType::AllGather, 16, kMiB), {}).reason,
            "nccl: group spans 2 nodes; CE needs one P2P domain");
  // The same all-gather takes far longer over PCIe than over NVLink, on either backend.
  for (Backend b : {Backend::Nccl, Backend::Ce}) {
    const CollectiveInfo c = coll(CollectiveType::AllGather, 2, 256 * kMiB);
    EXPECT_GT(pcie.estimate(c, b).us, 5 * sxm.estimate(c, b).us) << to_string(b);
  }
}

// ------------------------------------------------------------------------------------------------
// The h200-sxm profile against MEASURED.md (2 x H200). busbw as nccl-tests defines it: for 2 ranks,
// shard / time for all-gather and reduce-scatter (whose input is 2 shards).

struct FitRow {
  const char* what;
  double mib;
  double measured_gbps;
  double model_gbps;
};

TEST(Fit, H200ReproducesMeasuredCollectives) {
  CostModel m(builtin_profile("h200-sxm"));
  const double mib[] = {4, 16, 64, 256};
  const double nccl_ag[] = {115, 183, 232, 257};
  const double ce_ag[] = {95.5, 209.7, 307.6, 359.3};  // device-timed, cost_model_validation-2026-11-24
  const double nccl_rs[] = {128, 176, 217, 245};
  std::vector<FitRow> rows;
  for (int i = 0; i < 4; ++i) {
    const int64_t shard = static_cast<int64_t>(mib[i]) * kMiB;
    auto busbw = [&](CollectiveType t, Backend b) {
      const int64_t bytes = t == CollectiveType::ReduceScatter ? 2 * shard : shard;
      return static_cast<double>(shard) / m.estimate(coll(t, 2, bytes), b).us / 1e3;
    };
    rows.push_back({"NCCL all-gather", mib[i], nccl_ag[i], busbw(CollectiveType::AllGather, Backend::Nccl)});
    rows.push_back({"CE all-gather (in-place pull)", mib[i], ce_ag[i], busbw(CollectiveType::AllGather, Backend::Ce)});
    rows.push_back({"NCCL reduce-scatter", mib[i], nccl_rs[i], busbw(CollectiveType::ReduceScatter, Backend::Nccl)});
  }
  std::printf("h200-sxm vs measured (MEASURED.md; CE: 2026-11-24), 2 ranks\n  %-30s %8s %10s %10s %7s\n", "collective", "MiB/rank", "measured",
              "model", "error");
  for (const FitRow& r : rows) {
    const double err = (r.model_gbps - r.measured_gbps) / r.measured_gbps;
    std::printf("  %-30s %8.0f %10.0f %10.1f %+6.1f%%\n", r.what, r.mib, r.measured_gbps, r.model_gbps, 100 * err);
    EXPECT_LT(std::abs(err), 0.15) << r.what << " at " << r.mib << " MiB";
    EXPECT_LT(std::abs(err), 0.10) << r.what << " at " << r.mib << " MiB (the fit documented in the profile)";
  }
}

TEST(Fit, H200ReproducesMeasuredContention) {
  CostModel m(builtin_profile("h200-sxm"));
  // Slowdowns beside a 256 MiB-per-rank collective on 2 ranks, in percentage points.
  auto beside = [&](CollectiveType t, int64_t bytes, Backend b) {
    return m.slowdown_beside(m.estimate(coll(t, 2, bytes), b).phases.at(0));
  };
  const Slowdown nccl_ag = beside(CollectiveType::AllGather, 256 * kMiB, Backend::Nccl);
  const Slowdown ce_ag = beside(CollectiveType::AllGather, 256 * kMiB, Backend::Ce);
  const Slowdown nccl_rs = beside(CollectiveType::ReduceScatter, 512 * kMiB, Backend::Nccl);
  struct Row {
    const char* what;
    double measured_lo, measured_hi, model;
  } rows[] = {
      {"GEMM beside NCCL all-gather", 19, 27, 100 * nccl_ag.compute_bound},
      {"GEMM beside CE all-gather", 1, 5, 100 * ce_ag.compute_bound},
      {"GEMM beside NCCL reduce-scatter", 18, 18, 100 * nccl_rs.compute_bound},
      {"memory-bound beside NCCL all-gather", 19, 19, 100 * nccl_ag.memory_bound},
      {"memory-bound beside CE all-gather", 23, 23, 100 * ce_ag.memory_bound},
  };
  std::printf("h200-sxm slowdowns vs MEASURED.md (percent)\n");
  for (const Row& r : rows) {
    std::printf("  %-38s measured %2.0f..%-2.0f model %5.1f\n", r.what, r.measured_lo, r.measured_hi, r.model);
    // Within 5 points of the middle of the measured range, and inside the range widened by 5 points.
    EXPECT_LE(std::abs(r.model - (r.measured_lo + r.measured_hi) / 2), 5.0) << r.what;
    EXPECT_GE(r.model, r.measured_lo - 5.0) << r.what;
    EXPECT_LE(r.model, r.measured_hi + 5.0) << r.what;
  }
  // SM and HBM contention stay apart: CE holds no SMs, so GEMMs barely notice it, while memory-bound
  // kernels suffer more beside the faster CE traffic than beside NCCL.
  EXPECT_LT(ce_ag.compute_bound, 0.05 * 1.0);
  EXPECT_GT(ce_ag.memory_bound, nccl_ag.memory_bound);
  EXPECT_GT(nccl_ag.compute_bound, 4 * ce_ag.compute_bound);
}

TEST(Fit, H200AllGatherCrossoverWithinTwiceTheMeasured) {
  // Measured on 2x H200, device time (bench/results/cost_model_validation-2026-11-24): NCCL and the in-place CE
  // all-gather break even at 7.0 MiB per rank. Issue target: the model's crossover within a factor 2 of it.
  CostModel m(builtin_profile("h200-sxm"));
  auto choice = [&](double bytes) {
    return m.decide(coll(CollectiveType::AllGather, 2, static_cast<int64_t>(bytes)), {}).choice;
  };
  const double measured = 7.0 * kMiB;
  EXPECT_EQ(choice(measured / 2), Backend::Nccl);
  EXPECT_EQ(choice(measured * 2), Backend::Ce);
  double lo = measured / 2, hi = measured * 2;  // bisect the break-even size
  for (int i = 0; i < 40; ++i) {
    const double mid = std::sqrt(lo * hi);
    (choice(mid) == Backend::Ce ? hi : lo) = mid;
  }
  std::printf("h200-sxm NCCL/CE all-gather break-even, 2 ranks, no compute beside: %.2f MiB per rank "
              "(measured: 7.0)\n", hi / kMiB);
  EXPECT_GT(hi, measured / 2);
  EXPECT_LT(hi, measured * 2);
  // Above the break-even CE stays ahead.
  for (int64_t bytes = 16 * kMiB; bytes <= 4 * kGiB; bytes *= 2) {
    EXPECT_EQ(choice(static_cast<double>(bytes)), Backend::Ce) << bytes;
  }
}

// ------------------------------------------------------------------------------------------------
// Calibrated curves

TEST(Curves, UsedInPreferenceAndInterpolatedLogLog) {
  Profile p = builtin_profile("h200-sxm");
  Curve c;
  c.collective = CollectiveType::AllGather;
  c.backend = Backend::Nccl;
  c.group_size = 2;
  c.points = {{1.0 * kMiB, 20.0}, {4.0 * kMiB, 40.0}, {16.0 * kMiB, 100.0}};
  p.curves.push_back(c);
  CostModel m(p);
  CostModel analytic(builtin_profile("h200-sxm"));
  auto us = [&](int64_t bytes, int n = 2) {
    return m.estimate(coll(CollectiveType::AllGather, n, bytes), Backend::Nccl);
  };
  EXPECT_DOUBLE_EQ(us(4 * kMiB).us, 40.0);
  EXPECT_TRUE(starts_with(us(4 * kMiB).algorithm, "curve")) << us(4 * kMiB).algorithm;
  EXPECT_NEAR(us(2 * kMiB).us, std::sqrt(20.0 * 40.0), 1e-9);  // halfway in log(bytes): geometric mean
  EXPECT_DOUBLE_EQ(us(kKiB).us, 20.0);                          // below the table: its first time
  EXPECT_NEAR(us(32 * kMiB).us, 100.0 + 16.0 * kMiB * 60.0 / (12.0 * kMiB), 1e-9);  // last segment's rate
  EXPECT_DOUBLE_EQ(m.collective_us(coll(CollectiveType::AllGather, 2, 4 * kMiB)), 40.0);  // the analyzer too
  // Another group size, backend or collective: the analytic model.
  const CollectiveInfo four = coll(CollectiveType::AllGather, 4, 4 * kMiB);
  EXPECT_DOUBLE_EQ(us(4 * kMiB, 4).us, analytic.estimate(four, Backend::Nccl).us);
  const CollectiveInfo ce = coll(CollectiveType::AllGather, 2, 4 * kMiB);
  EXPECT_DOUBLE_EQ(m.estimate(ce, Backend::Ce).us, analytic.estimate(ce, Backend::Ce).us);
  // Phases keep the model's resources, scaled to the measured time.
  CollectiveEstimate e = us(64 * kMiB);
  ASSERT_EQ(e.phases.size(), 1u);
  EXPECT_DOUBLE_EQ(e.phases[0].us, e.us);
  EXPECT_EQ(e.phases[0].sms, p.nccl.channels);
  // Monotone across the table and beyond.
  double prev = 0;
  for (int64_t bytes = 1; bytes <= kGiB; bytes *= 2) {
    EXPECT_GE(us(bytes).us, prev) << bytes;
    prev = us(bytes).us;
  }
}

// ------------------------------------------------------------------------------------------------
// Costs and decisions

TEST(Decide, CostOfAWindowByHand) {
  // Round profile, NCCL all-gather of 1e6 bytes on 2 ranks: 10 + 2 + 1e6 / 50000 = 32 us alone.
  CostModel m(round_profile());
  const CollectiveInfo c = coll(CollectiveType::AllGather, 2, 1000000);
  BackendCost alone = m.cost(c, Backend::Nccl, {});
  EXPECT_DOUBLE_EQ(alone.comm_us, 32.0);
  EXPECT_DOUBLE_EQ(alone.exposed_us, 32.0);
  EXPECT_DOUBLE_EQ(alone.slowdown_us, 0.0);
  EXPECT_DOUBLE_EQ(alone.cost_us, 32.0);

  // Beside 1000 us of GEMMs: NCCL itself runs 5% slower (33.6 us), and meanwhile its 20 of 100 SMs
  // (20/80 = 0.25) and its HBM traffic (2e6 bytes over 33.6 us = 59.52 GB/s of 1000: 0.1 x R/(H-R))
  // slow the GEMMs; the window absorbs the collective, so only that slowdown is paid.
  BackendCost b = m.cost(c, Backend::Nccl, {1000, 0});
  EXPECT_DOUBLE_EQ(b.comm_us, 33.6);
  const double rate = 2e6 / 33.6 / 1e3;
  const double s = 20.0 / 80 + 0.1 * rate / (1000 - rate);
  EXPECT_NEAR(b.slowdown.compute_bound, s, 1e-12);
  EXPECT_NEAR(b.slowdown_us, 33.6 - 33.6 / (1 + s), 1e-9);
  EXPECT_DOUBLE_EQ(b.exposed_us, 0.0);
  EXPECT_DOUBLE_EQ(b.cost_us, b.slowdown_us);

  // A 10 us window: all of it is slowed, the rest of the collective is exposed.
  BackendCost short_window = m.cost(c, Backend::Nccl, {10, 0});
  EXPECT_NEAR(short_window.comm_us, 32 + 10 * 0.05, 1e-12);
  EXPECT_GT(short_window.exposed_us, 0);
  EXPECT_NEAR(short_window.cost_us, short_window.exposed_us + short_window.slowdown_us, 1e-12);
  EXPECT_NEAR(short_window.exposed_us + 10 + short_window.slowdown_us, short_window.comm_us, 1e-9);
}

TEST(Decide, ReasonsReadAsOneLine) {
  CostModel m(builtin_profile("h200-sxm"));
  Decision tiny = m.decide(coll(CollectiveType::AllGather, 2, 64 * kKiB), {});
  EXPECT_EQ(tiny.choice, Backend::Nccl);
  EXPECT_EQ(tiny.reason, "nccl: 64 KiB is latency-bound; CE per-copy latency loses");

  Decision gemm = m.decide(coll(CollectiveType::AllGather, 8, 64 * kMiB), {1900, 0});
  EXPECT_EQ(gemm.choice, Backend::Ce);
  EXPECT_TRUE(starts_with(gemm.reason, "ce: saves ")) << gemm.reason;
  EXPECT_TRUE(contains(gemm.reason, "(NCCL slows 1.")) << gemm.reason;
  EXPECT_TRUE(contains(gemm.reason, " ms of GEMMs by 2")) << gemm.reason;

  Decision alone = m.decide(coll(CollectiveType::AllGather, 2, 64 * kMiB), {});
  EXPECT_EQ(alone.choice, Backend::Ce);
  EXPECT_TRUE(starts_with(alone.reason, "ce: saves ")) << alone.reason;
  EXPECT_TRUE(contains(alone.reason, "64 MiB in ")) << alone.reason;

  // h200-sxm's reduction kernel (84 GB/s per CTA, measured) keeps up with the link: CE wins a lone reduce-scatter.
  Decision rs_fast = m.decide(coll(CollectiveType::ReduceScatter, 2, 128 * kMiB), {});
  EXPECT_EQ(rs_fast.choice, Backend::Ce) << rs_fast.reason;
  // A kernel a quarter as fast sets the pace, and the reason names it.
  Profile slow_kernel = builtin_profile("h200-sxm");
  slow_kernel.ce.reduce_gbps_per_sm /= 4;
  Decision rs = CostModel(slow_kernel).decide(coll(CollectiveType::ReduceScatter, 2, 128 * kMiB), {});
  EXPECT_EQ(rs.choice, Backend::Nccl);
  EXPECT_TRUE(contains(rs.reason, "32-SM reduction kernel")) << rs.reason;

  for (const Decision& d : {tiny, gemm, alone, rs_fast, rs}) {
    EXPECT_EQ(d.reason.find('\n'), std::string::npos);
    ASSERT_TRUE(d.ce.has_value());
    EXPECT_EQ(d.choice == Backend::Ce, d.ce->cost_us < d.nccl.cost_us - 1e-9 * d.nccl.cost_us);
  }
  EXPECT_EQ(m.decide(coll(CollectiveType::AllGather, 1, kMiB), {}).reason, "nccl: a group of 1 moves no data");
}

TEST(Decide, MemoryBoundWindowFavoursNcclMoreThanAGemmWindow) {
  // CE's HBM traffic slows memory-bound kernels more than NCCL's does: a window of memory-bound kernels
  // narrows CE's advantage compared with a window of GEMMs.
  CostModel m(builtin_profile("h200-sxm"));
  const CollectiveInfo c = coll(CollectiveType::AllGather, 2, 256 * kMiB);
  Decision gemm = m.decide(c, {5000, 0});
  Decision memory = m.decide(c, {0, 5000});
  const double gemm_gain = gemm.nccl.cost_us - gemm.ce->cost_us;
  const double memory_gain = memory.nccl.cost_us - memory.ce->cost_us;
  EXPECT_GT(gemm_gain, memory_gain);
  EXPECT_GT(memory.ce->slowdown_us, memory.nccl.slowdown_us * 0.5);
}

TEST(CostModel, FormatBytes) {
  EXPECT_EQ(format_bytes(100), "100 B");
  EXPECT_EQ(format_bytes(64 * kKiB), "64 KiB");
  EXPECT_EQ(format_bytes(1.5 * kMiB), "1.5 MiB");
  EXPECT_EQ(format_bytes(256.0 * kMiB), "256 MiB");
  EXPECT_EQ(format_bytes(4.0 * kGiB), "4 GiB");
}

TEST(CostModel, DurationsPerNode) {
  CostModel m(round_profile());
  Graph g;
  g.nodes.push_back(compute_node("bfloat16", 0, 0));
  Node c;
  c.kind = NodeKind::Collective;
  c.collective = coll(CollectiveType::Send, 2, 50000);
  g.nodes.push_back(c);
  std::vector<double> d = m.durations_us(g);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_DOUBLE_EQ(d[0], 5.0);
  EXPECT_NEAR(d[1], 10.0 + 2.0 + 1.0, 1e-12);
}

// mm -> a -> b -> mm2 on 8 MiB tensors: two GEMMs around a chain of two pointwise nodes (ids 0..3).
Graph pointwise_chain() {
  constexpr int64_t kMiB = 1024 * 1024;
  Graph g;
  auto add = [&](const std::string& name, std::vector<int> inputs, int64_t flops) {
    Node n = compute_node("bfloat16", flops, flops > 0 ? 0 : 16 * kMiB);
    n.id = static_cast<int>(g.nodes.size());
    n.name = name;
    n.inputs = std::move(inputs);
    n.outputs = {{{4096, 1024}, "bfloat16", 8 * kMiB}};
    g.nodes.push_back(n);
  };
  add("mm", {}, 100000000);
  add("a", {0}, 0);
  add("b", {1}, 0);
  add("mm2", {2}, 100000000);
  return g;
}

TEST(CostModel, FusedPointwiseChainIsChargedItsBytesInAndOutOnly) {
  // 1 TB/s HBM x 1.0 (round_profile): unfused, a and b each read and write 8 MiB (16 MiB each); fused, the chain
  // reads mm's 8 MiB once and writes b's once: 16 MiB in all, split 1:1.
  CostModel m(round_profile());
  constexpr int64_t kMiB = 1024 * 1024;
  const Graph g = pointwise_chain();
  const int mm = 0, a = 1, b = 2, mm2 = 3;
  const std::vector<double> d = m.durations_us(g);
  const double us_per_mib = static_cast<double>(kMiB) / 1e6;  // at 1 TB/s
  EXPECT_NEAR(m.node_us(g.nodes[a]), 16 * us_per_mib, 1e-9);
  EXPECT_NEAR(d[a], 8 * us_per_mib, 1e-9);
  EXPECT_NEAR(d[b], 8 * us_per_mib, 1e-9);
  EXPECT_DOUBLE_EQ(d[mm], m.node_us(g.nodes[mm]));  // GEMMs keep their roofline
  EXPECT_DOUBLE_EQ(d[mm2], m.node_us(g.nodes[mm2]));
}

TEST(CostModel, FusedKernelsAreChargedAtTheFusedMemoryRate) {
  // efficiency.fused_memory 0.5 of 1 TB/s: the fused pair (a, b) takes twice its time at memory 1.0; the GEMMs and
  // a memory-bound node outside any group keep `memory`. Absent, fused kernels run at `memory`; the field round-trips.
  const Graph g = pointwise_chain();
  const int mm = 0, a = 1, b = 2, mm2 = 3;
  Profile p = round_profile();
  const std::vector<double> at_memory = CostModel(p).durations_us(g);
  p.efficiency.fused_memory = 0.5;
  const CostModel m(p);
  const std::vector<double> d = m.durations_us(g);
  EXPECT_DOUBLE_EQ(d[a], 2 * at_memory[a]);
  EXPECT_DOUBLE_EQ(d[b], 2 * at_memory[b]);
  EXPECT_DOUBLE_EQ(d[mm], at_memory[mm]);
  EXPECT_DOUBLE_EQ(d[mm2], at_memory[mm2]);
  EXPECT_DOUBLE_EQ(m.node_us(g.nodes[a]), CostModel(round_profile()).node_us(g.nodes[a]));  // unfused: `memory`
  EXPECT_DOUBLE_EQ(profile_from_json(profile_to_json(p)).efficiency.fused_memory, 0.5);
  EXPECT_DOUBLE_EQ(profile_from_json(profile_to_json(round_profile())).efficiency.fused_memory, 0.0);
  EXPECT_DOUBLE_EQ(round_profile().efficiency.fused_memory_or_memory(), round_profile().efficiency.memory);
}

TEST(CostModel, KernelGapIsChargedOncePerKernel) {
  // mm, the fused pair (a, b), mm2 = 3 kernels. A gap of 2 us adds 2 us to each kernel's first node: mm, a (not b)
  // and mm2; a collective is no kernel.
  Graph g = pointwise_chain();
  const int mm = 0, a = 1, b = 2, mm2 = 3;
  Node c;
  c.id = static_cast<int>(g.nodes.size());
  c.kind = NodeKind::Collective;
  c.inputs = {mm2};
  c.collective = coll(CollectiveType::Send, 2, 50000);
  g.nodes.push_back(c);

  Profile p = round_profile();
  const std::vector<double> without = CostModel(p).durations_us(g);
  p.efficiency.kernel_gap_us = 2.0;
  const CostModel m(p);
  std::vector<char> starts;
  const std::vector<double> with = m.durations_us(g, &starts);
  EXPECT_EQ(starts, (std::vector<char>{1, 1, 0, 1, 0}));  // mm, a, mm2: 3 kernels
  EXPECT_DOUBLE_EQ(with[mm] - without[mm], 2.0);
  EXPECT_DOUBLE_EQ(with[a] - without[a], 2.0);
  EXPECT_DOUBLE_EQ(with[b], without[b]);
  EXPECT_DOUBLE_EQ(with[mm2] - without[mm2], 2.0);
  EXPECT_DOUBLE_EQ(with[c.id], without[c.id]);
  // The field round-trips through the profile JSON, and is optional (absent: 0).
  const Profile back = profile_from_json(profile_to_json(p));
  EXPECT_DOUBLE_EQ(back.efficiency.kernel_gap_us, 2.0);
  EXPECT_DOUBLE_EQ(profile_from_json(profile_to_json(round_profile())).efficiency.kernel_gap_us, 0.0);
}

TEST(CostModel, ANcclChoiceThatTheConsumersSumDecidedSaysSo) {
  // With the sum left to the consumer (the pass's CE reduce-scatter), a CE reduce-scatter can be faster than NCCL's
  // and still lose: its reads land on the compute stream. The reason names them, never "X in <CE's longer time> vs
  // <NCCL's shorter one>" the other way round. Swept over windows of GEMMs; at least one such case exists.
  CostModel m(builtin_profile("h200-sxm"));
  m.set_ce_reduction(CeReduction::Consumer);
  const CollectiveInfo c = coll(CollectiveType::ReduceScatter, 4, int64_t{1002} << 20);
  int found = 0;
  for (double w = 0; w <= 20000; w += 250) {
    const Decision d = m.decide(c, {w, 0});
    ASSERT_TRUE(d.ce.has_value());
    if (d.choice != Backend::Nccl || d.ce->comm_us >= d.nccl.comm_us) continue;
    if (d.ce->cost_us - d.ce->estimate.consumer_us > d.nccl.cost_us) continue;
    ++found;
    EXPECT_NE(d.reason.find("reduce-scatter's sum in the consumer adds"), std::string::npos) << d.reason;
    EXPECT_NE(d.reason.find("on the compute stream, its 1002 MiB in"), std::string::npos) << d.reason;
  }
  EXPECT_GT(found, 0);
}

}  // namespace
}  // namespace ce_overlap
