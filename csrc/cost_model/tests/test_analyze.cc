// The analyzer on a hand-built two-block document (every number derived by hand from the round
// profile), the report layout, and its speed on a 20k-node graph.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "../../graph/tests/plan_builder.h"
#include "cost_model/analyze.h"
#include "cost_model/planner.h"
#include "graph/analysis.h"
#include "test_util.h"

namespace ce_overlap {
namespace {

using nlohmann::ordered_json;
using testing::coll;
using testing::round_profile;

constexpr int64_t kMiB = int64_t{1} << 20;

// Appends a node to g with the next id; shape is 2-D, bytes derived from it.
Node& add(Graph& g, const std::string& name, NodeKind kind, const std::string& op, std::vector<int> inputs,
          std::vector<std::vector<int64_t>> shapes, const std::string& dtype, int block, int64_t flops = 0,
          int64_t bytes_accessed = 0) {
  Node n;
  n.id = static_cast<int>(g.nodes.size());
  n.name = name;
  n.kind = kind;
  n.op = op;
  n.inputs = std::move(inputs);
  for (auto& s : shapes) {
    int64_t numel = 1;
    for (int64_t d : s) numel *= d;
    n.outputs.push_back({s, dtype, numel * dtype_itemsize(dtype)});
  }
  n.flops = flops;
  n.bytes_accessed = bytes_accessed;
  n.block = block;
  g.nodes.push_back(std::move(n));
  return g.nodes.back();
}

// Forward: all-gather a 1 MiB shard (block 0) while a relu (block 1) runs, wait, mm (block 0).
// Backward: mm (block 1), reduce-scatter its 2 MiB gradient, an all-reduce outside any block, two waits.
Document two_block_doc() {
  Document doc;
  doc.meta = {{"model", "tiny"}, {"world_size", 2}};
  doc.blocks = {{0, "layers.0", "TransformerBlock"}, {1, "layers.1", "TransformerBlock"}};
  const std::string bf16 = "bfloat16";

  Graph fwd;
  fwd.name = "forward";
  add(fwd, "primals_1", NodeKind::Other, "placeholder", {}, {{512, 1024}}, bf16, -1);
  add(fwd, "primals_2", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);
  add(fwd, "all_gather_into_tensor", NodeKind::Collective, "_c10d_functional.all_gather_into_tensor.default", {0},
      {{1024, 1024}}, bf16, 0)
      .collective = coll(CollectiveType::AllGather, 2, 1 * kMiB);
  add(fwd, "relu", NodeKind::Compute, "aten.relu.default", {1}, {{1024, 1024}}, bf16, 1, 1 * kMiB, 4 * kMiB);
  add(fwd, "wait_tensor", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {2}, {{1024, 1024}}, bf16, 0);
  add(fwd, "mm", NodeKind::Compute, "aten.mm.default", {3, 4}, {{1024, 1024}}, bf16, 0, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);
  add(fwd, "output", NodeKind::Other, "output", {5}, {}, bf16, -1);

  Graph bwd;
  bwd.name = "backward";
  add(bwd, "tangents_1", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);
  add(bwd, "primals_2", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);
  add(bwd, "scale", NodeKind::Other, "placeholder", {}, {{1024}}, "float32", -1);
  add(bwd, "mm_1", NodeKind::Compute, "aten.mm.default", {0, 1}, {{1024, 1024}}, bf16, 1, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);
  add(bwd, "reduce_scatter_tensor", NodeKind::Collective, "_c10d_functional.reduce_scatter_tensor.default", {3},
      {{512, 1024}}, bf16, 1)
      .collective = coll(CollectiveType::ReduceScatter, 2, 2 * kMiB);
  add(bwd, "all_reduce", NodeKind::Collective, "_c10d_functional.all_reduce.default", {2}, {{1024}}, "float32", -1)
      .collective = coll(CollectiveType::AllReduce, 2, 4096);
  add(bwd, "wait_tensor", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {4}, {{512, 1024}}, bf16, 1);
  add(bwd, "wait_tensor_1", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {5}, {{1024}}, "float32", -1);
  add(bwd, "output", NodeKind::Other, "output", {6, 7}, {}, bf16, -1);

  doc.graphs = {fwd, bwd};
  return doc;
}

constexpr double kEps = 1e-9;

// Hand-computed under round_profile(): 100 TFLOP/s, 1000 GB/s HBM, 5 us floor, NCCL 10 us + 2 us/step,
// 50 GB/s effective bus bandwidth (50000 bytes/us).
constexpr double kMmUs = 2147483648.0 / 100e6;             // 21.47483648: FLOP-bound (6 MiB -> 6.29 us)
constexpr double kReluUs = 5.0;                            // 4 MiB -> 4.19 us, below the launch floor
constexpr double kAgUs = 10 + 2 * 1 + 1048576.0 / 50000;   // 1 step, (2-1) x 1 MiB on the bus: 32.97152
constexpr double kRsUs = 10 + 2 * 1 + 1048576.0 / 50000;   // 1 step, 1/2 x 2 MiB: 32.97152
constexpr double kArUs = 10 + 2 * 2 + 4096.0 / 50000;      // 2 steps, 2 x 1/2 x 4096: 14.08192

void expect_row(const ordered_json& r, int block, const std::string& path, int64_t ag_count, int64_t ag_bytes,
                int64_t rs_count, int64_t rs_bytes, int64_t other_count, int64_t other_bytes, int64_t fwd_flops,
                int64_t bwd_flops, double compute_us, double comm_us, double exposed_us) {
  SCOPED_TRACE("row " + std::to_string(block));
  EXPECT_EQ(r["block"], block);
  EXPECT_EQ(r["path"], path);
  EXPECT_EQ(r["forward_all_gather_count"], ag_count);
  EXPECT_EQ(r["forward_all_gather_bytes"], ag_bytes);
  EXPECT_EQ(r["backward_all_gather_count"], 0);  // this document re-gathers nothing in the backward
  EXPECT_EQ(r["backward_all_gather_bytes"], 0);
  EXPECT_EQ(r["reduce_scatter_count"], rs_count);
  EXPECT_EQ(r["reduce_scatter_bytes"], rs_bytes);
  EXPECT_EQ(r["other_collective_count"], other_count);
  EXPECT_EQ(r["other_collective_bytes"], other_bytes);
  EXPECT_EQ(r["forward_flops"], fwd_flops);
  EXPECT_EQ(r["backward_flops"], bwd_flops);
  EXPECT_NEAR(r["compute_us"].get<double>(), compute_us, kEps);
  EXPECT_NEAR(r["comm_us"].get<double>(), comm_us, kEps);
  EXPECT_NEAR(r["exposed_comm_us"].get<double>(), exposed_us, kEps);
}

// An empty document of `model` at `world_size` ranks, and an empty graph named `name`.
Document doc_for(const std::string& model, int world_size) {
  Document doc;
  doc.meta = {{"model", model}, {"world_size", world_size}};
  return doc;
}

Graph graph_named(const std::string& name) {
  Graph g;
  g.name = name;
  return g;
}

std::vector<std::string> keys_of(const ordered_json& j) {
  std::vector<std::string> k;
  for (auto it = j.begin(); it != j.end(); ++it) k.push_back(it.key());
  return k;
}

TEST(Analyze, GraphKernelsOnePerFusionGroupAndPerOtherComputeNode) {
  // mm -> mul -> add -> mm2 on 2 MiB tensors: the two pointwise nodes are one fusion group, which reads mm's output
  // and writes add's (4 MiB at 1000 GB/s: 4.19 us, under the 5 us launch floor, so 5 us, half of their unfused 10).
  Document doc = doc_for("tiny", 1);
  const std::string bf16 = "bfloat16";
  Graph fwd = graph_named("forward");
  add(fwd, "x", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);
  add(fwd, "mm", NodeKind::Compute, "aten.mm.default", {0, 0}, {{1024, 1024}}, bf16, -1, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);
  add(fwd, "mul", NodeKind::Compute, "aten.mul.Tensor", {1}, {{1024, 1024}}, bf16, -1, 0, 4 * kMiB);
  add(fwd, "add", NodeKind::Compute, "aten.add.Tensor", {2}, {{1024, 1024}}, bf16, -1, 0, 4 * kMiB);
  add(fwd, "mm_1", NodeKind::Compute, "aten.mm.default", {3, 0}, {{1024, 1024}}, bf16, -1, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);
  add(fwd, "output", NodeKind::Other, "output", {4}, {}, bf16, -1);
  doc.graphs = {fwd};
  const CostModel m(round_profile());
  const ordered_json k = graph_kernels(doc, "forward", m);
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(k[0]["nodes"], ordered_json::array({1}));
  EXPECT_EQ(k[0]["fused"], false);
  EXPECT_EQ(k[0]["bytes"], 6 * kMiB);
  EXPECT_NEAR(k[0]["us"].get<double>(), kMmUs, kEps);
  EXPECT_EQ(k[1]["nodes"], ordered_json::array({2, 3}));
  EXPECT_EQ(k[1]["ops"], ordered_json::array({"aten.mul.Tensor", "aten.add.Tensor"}));
  EXPECT_EQ(k[1]["fused"], true);
  EXPECT_EQ(k[1]["bytes"], 4 * kMiB);
  EXPECT_NEAR(k[1]["us"].get<double>(), 5.0, kEps);
  EXPECT_EQ(k[2]["nodes"], ordered_json::array({4}));
  // The kernels' times are the graph's compute time in the analysis report.
  double sum = 0;
  for (const auto& kernel : k) sum += kernel["us"].get<double>();
  EXPECT_NEAR(sum, analyze(doc, m)["graphs"][0]["compute_us"].get<double>(), kEps);
  try {
    graph_kernels(doc, "backward", m);
    FAIL() << "an unknown graph name must throw";
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "graph: no graph named \"backward\" in the IR (it has: forward)");
  }
}

TEST(Analyze, TwoBlockDocument) {
  CostModel m(round_profile());
  ordered_json r = analyze(two_block_doc(), m);

  EXPECT_EQ(keys_of(r), (std::vector<std::string>{"schema", "profile", "meta", "graphs", "blocks", "outside_blocks",
                                                  "totals", "timeline"}));
  EXPECT_EQ(r["schema"], "ce_overlap.analysis/1");
  EXPECT_EQ(r["profile"], "test-round");
  EXPECT_EQ(r["meta"]["model"], "tiny");
  EXPECT_EQ(r["meta"]["world_size"], 2);

  ASSERT_EQ(r["graphs"].size(), 2u);
  const ordered_json& f = r["graphs"][0];
  EXPECT_EQ(keys_of(f), (std::vector<std::string>{"name", "nodes", "compute_us", "comm_us", "exposed_comm_us",
                                                  "tp_comm_us", "tp_exposed_comm_us", "makespan_us", "critical_path_us", "peak_memory_bytes",
                                                  "input_bytes", "collectives", "kernels", "kernel_gap_us",
                                                  "inputs", "compute_by_class_us"}));
  EXPECT_EQ(f["name"], "forward");
  EXPECT_EQ(f["nodes"], 7);
  EXPECT_EQ(f["kernels"], 2);  // the relu and the mm
  EXPECT_EQ(f["inputs"], 2);   // its placeholders (the step model's host term prices them)
  EXPECT_EQ(r["graphs"][1]["inputs"], 3);
  EXPECT_EQ(f["kernel_gap_us"].get<double>(), 0.0);  // the test profile has no gap between kernels
  EXPECT_NEAR(f["compute_us"].get<double>(), kReluUs + kMmUs, kEps);
  // The split of compute_us: the mm carries FLOPs, the relu none; no attention here.
  EXPECT_NEAR(f["compute_by_class_us"]["matmul"].get<double>(), kMmUs, kEps);
  EXPECT_NEAR(f["compute_by_class_us"]["memory_bound"].get<double>(), kReluUs, kEps);
  EXPECT_EQ(f["compute_by_class_us"]["attention"].get<double>(), 0.0);
  EXPECT_NEAR(f["comm_us"].get<double>(), kAgUs, kEps);
  // The relu hides 5 us of the all-gather; the wait blocks the rest.
  EXPECT_NEAR(f["exposed_comm_us"].get<double>(), kAgUs - kReluUs, kEps);
  EXPECT_NEAR(f["makespan_us"].get<double>(), kAgUs + kMmUs, kEps);
  EXPECT_NEAR(f["critical_path_us"].get<double>(), kAgUs + kMmUs, kEps);
  EXPECT_EQ(f["peak_memory_bytes"], 6 * kMiB);  // gathered weight + relu + mm outputs alive at the mm
  EXPECT_EQ(f["input_bytes"], 3 * kMiB);
  EXPECT_EQ(f["collectives"], 1);

  const ordered_json& b = r["graphs"][1];
  EXPECT_EQ(b["name"], "backward");
  EXPECT_EQ(b["nodes"], 9);
  EXPECT_NEAR(b["compute_us"].get<double>(), kMmUs, kEps);
  EXPECT_NEAR(b["comm_us"].get<double>(), kRsUs + kArUs, kEps);
  // Nothing overlaps: the reduce-scatter follows the mm, the all-reduce queues behind it on the comm stream.
  EXPECT_NEAR(b["exposed_comm_us"].get<double>(), kRsUs + kArUs, kEps);
  EXPECT_NEAR(b["makespan_us"].get<double>(), kMmUs + kRsUs + kArUs, kEps);
  EXPECT_NEAR(b["critical_path_us"].get<double>(), kMmUs + kRsUs, kEps);
  // Gradient + its reduce-scatter output + the all-reduce's output: the reduce-scatter reads the gradient until
  // its wait, so the gradient is still alive when the all-reduce allocates.
  EXPECT_EQ(b["peak_memory_bytes"], 3 * kMiB + 4096);
  EXPECT_EQ(b["input_bytes"], 4 * kMiB + 4096);
  EXPECT_EQ(b["collectives"], 2);

  const int64_t mm_flops = 2 * 1024 * 1024 * 1024LL;
  ASSERT_EQ(r["blocks"].size(), 2u);
  expect_row(r["blocks"][0], 0, "layers.0", 1, 2 * kMiB, 0, 0, 0, 0, mm_flops, 0, kMmUs, kAgUs, kAgUs - kReluUs);
  EXPECT_EQ(r["blocks"][0]["type"], "TransformerBlock");
  expect_row(r["blocks"][1], 1, "layers.1", 0, 0, 1, 2 * kMiB, 0, 0, kMiB, mm_flops, kReluUs + kMmUs, kRsUs, kRsUs);
  expect_row(r["outside_blocks"], -1, "", 0, 0, 0, 0, 1, 4096, 0, 0, 0.0, kArUs, kArUs);
  expect_row(r["totals"], -1, "", 1, 2 * kMiB, 1, 2 * kMiB, 1, 4096, mm_flops + kMiB, mm_flops,
             kReluUs + 2 * kMmUs, kAgUs + kRsUs + kArUs, kAgUs - kReluUs + kRsUs + kArUs);
  EXPECT_EQ(keys_of(r["totals"]),
            (std::vector<std::string>{"block", "path", "type", "forward_all_gather_count",
                                      "forward_all_gather_bytes", "backward_all_gather_count",
                                      "backward_all_gather_bytes",
                                      "reduce_scatter_count", "reduce_scatter_bytes", "other_collective_count",
                                      "other_collective_bytes", "tp_collective_count", "tp_collective_bytes",
                                      "forward_flops", "backward_flops", "compute_us", "comm_us", "exposed_comm_us",
                                      "tp_comm_us", "tp_exposed_comm_us", "ce_candidates"}));

  // Timeline: forward AG, relu, mm; backward (shifted by the forward makespan) mm, RS, AR.
  const ordered_json& t = r["timeline"];
  ASSERT_EQ(t.size(), 6u);
  EXPECT_EQ(keys_of(t[0]), (std::vector<std::string>{"graph", "node", "name", "op", "kind", "block", "stream",
                                                     "group", "start_us", "end_us"}));  // a collective's group
  struct Expected {
    std::string graph;
    int node;
    std::string stream;
    double start_us, end_us;
  };
  const double fwd_end = kAgUs + kMmUs;
  const std::vector<Expected> expected = {
      {"forward", 2, "comm", 0, kAgUs},
      {"forward", 3, "compute", 0, kReluUs},
      {"forward", 5, "compute", kAgUs, kAgUs + kMmUs},
      {"backward", 3, "compute", fwd_end, fwd_end + kMmUs},
      {"backward", 4, "comm", fwd_end + kMmUs, fwd_end + kMmUs + kRsUs},
      {"backward", 5, "comm", fwd_end + kMmUs + kRsUs, fwd_end + kMmUs + kRsUs + kArUs},
  };
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.graph + " node " + std::to_string(e.node));
    int found = 0;
    for (const ordered_json& ev : t) {
      if (ev["graph"] != e.graph || ev["node"] != e.node) continue;
      ++found;
      EXPECT_EQ(ev["stream"], e.stream);
      EXPECT_NEAR(ev["start_us"].get<double>(), e.start_us, kEps);
      EXPECT_NEAR(ev["end_us"].get<double>(), e.end_us, kEps);
    }
    EXPECT_EQ(found, 1);
  }
  EXPECT_EQ(t[0]["graph"], "forward");
  EXPECT_EQ(t[5]["graph"], "backward");
  for (const ordered_json& ev : t) {
    if (ev["graph"] == "backward" && ev["node"] == 4) {
      EXPECT_EQ(ev["name"], "reduce_scatter_tensor");
      EXPECT_EQ(ev["op"], "_c10d_functional.reduce_scatter_tensor.default");
      EXPECT_EQ(ev["kind"], "collective");
      EXPECT_EQ(ev["block"], 1);
    }
  }
}

TEST(Analyze, EmptyBlocksStillReported) {
  Document doc = two_block_doc();
  doc.blocks.push_back({2, "layers.2", "TransformerBlock"});  // no node uses it
  ordered_json r = analyze(doc, CostModel(round_profile()));
  ASSERT_EQ(r["blocks"].size(), 3u);
  expect_row(r["blocks"][2], 2, "layers.2", 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0);
}

TEST(Analyze, CeCandidatesCountWhatDecideGivesToCe) {
  // Block 0: an all-gather of 2 ranks beside a 1 ms GEMM: NCCL's SMs slow the GEMM, CE's copies do not.
  // Block 1: the same beside a GEMM, but 16 ranks span two nodes: NCCL only. Outside: a 4 KiB all-gather
  // with nothing beside it is latency-bound: NCCL.
  Document doc;
  doc.blocks = {{0, "layers.0", "TransformerBlock"}, {1, "layers.1", "TransformerBlock"}};
  Graph g;
  g.name = "forward";
  const std::string bf16 = "bfloat16";
  const int64_t gemm_flops = int64_t{100} * 1000 * 1000 * 1000;  // 1000 us at 100 TFLOP/s
  add(g, "w", NodeKind::Other, "placeholder", {}, {{512, 1024}}, bf16, -1);
  add(g, "x", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);
  for (int b = 0; b < 2; ++b) {
    const int ag = static_cast<int>(g.nodes.size());
    add(g, "ag" + std::to_string(b), NodeKind::Collective, "_c10d_functional.all_gather_into_tensor.default", {0},
        {{1024, 1024}}, bf16, b)
        .collective = coll(CollectiveType::AllGather, b == 0 ? 2 : 16, 1 * kMiB);
    add(g, "mm" + std::to_string(b), NodeKind::Compute, "aten.mm.default", {1}, {{1024, 1024}}, bf16, b, gemm_flops,
        6 * kMiB);
    add(g, "wait" + std::to_string(b), NodeKind::Wait, "_c10d_functional.wait_tensor.default", {ag}, {{1024, 1024}},
        bf16, b);
  }
  add(g, "ag_small", NodeKind::Collective, "_c10d_functional.all_gather_into_tensor.default", {0}, {{2048}}, bf16, -1)
      .collective = coll(CollectiveType::AllGather, 2, 4096);
  add(g, "wait_small", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {8}, {{2048}}, bf16, -1);
  add(g, "output", NodeKind::Other, "output", {4, 7, 9}, {}, bf16, -1);
  doc.graphs = {g};
  ordered_json r = analyze(doc, CostModel(round_profile()));
  EXPECT_EQ(r["blocks"][0]["ce_candidates"], 1);
  EXPECT_EQ(r["blocks"][1]["ce_candidates"], 0);
  EXPECT_EQ(r["outside_blocks"]["ce_candidates"], 0);
  EXPECT_EQ(r["totals"]["ce_candidates"], 1);
  // The hand-built document: its all-gather outlasts the relu beside it under either backend, so both
  // cost the same (a tie stays on NCCL); nothing else overlaps compute.
  EXPECT_EQ(analyze(two_block_doc(), CostModel(round_profile()))["totals"]["ce_candidates"], 0);
}

TEST(Analyze, TensorParallelCollectivesAreCountedApartFromFsdps) {
  // tp_doc: per block one DP all-gather and a TP all-gather and reduce-scatter. The FSDP columns hold the DP ones
  // only; the TP ones have their own count, bytes and time, and are no copy-engine candidates.
  const Document doc = testing::tp_doc(3, 16384, 32768, int64_t{40} * 1000 * 1000 * 1000);
  const ordered_json r = analyze(doc, CostModel(testing::builtin_profile("h200-sxm")));
  const ordered_json& t = r["totals"];
  EXPECT_EQ(t["forward_all_gather_count"], 3);
  EXPECT_EQ(t["reduce_scatter_count"], 0);
  EXPECT_EQ(t["tp_collective_count"], 6);
  EXPECT_EQ(t["tp_collective_bytes"].get<int64_t>(), 3 * (int64_t{32768} * 256 * 2 + int64_t{65536} * 256 * 2));
  EXPECT_LE(t["ce_candidates"].get<int64_t>(), 3);
  const ordered_json& g = r["graphs"][0];
  EXPECT_GT(g["tp_comm_us"].get<double>(), 0);
  EXPECT_LE(g["tp_exposed_comm_us"].get<double>(), g["tp_comm_us"].get<double>() + 1e-9);
  EXPECT_LE(g["tp_exposed_comm_us"].get<double>(), g["exposed_comm_us"].get<double>() + 1e-9);
  EXPECT_NEAR(t["tp_comm_us"].get<double>(), g["tp_comm_us"].get<double>(), 1e-6);
  int grouped = 0;
  for (const ordered_json& e : r["timeline"]) {
    if (e["stream"] == "comm") grouped += e.contains("group");
  }
  EXPECT_EQ(grouped, 9);
}

TEST(Analyze, RejectsInvalidDocument) {
  Document doc = two_block_doc();
  doc.graphs[0].nodes[5].inputs.push_back(99);  // no such node
  EXPECT_THROW(analyze(doc, CostModel(round_profile())), IrError);
}

TEST(Analyze, ByteCountersSaturate) {
  // A 2^50-byte shard gathered over 65536 ranks produces 2^66 bytes: reported as INT64_MAX, not wrapped.
  Document doc;
  doc.blocks = {{0, "layers.0", "TransformerBlock"}};
  Graph g;
  g.name = "forward";
  const int64_t half = int64_t{1} << 49;  // bf16 elements in 2^50 bytes
  add(g, "shard", NodeKind::Other, "placeholder", {}, {{half}}, "bfloat16", -1);
  for (int i = 0; i < 2; ++i) {
    add(g, "ag" + std::to_string(i), NodeKind::Collective, "_c10d_functional.all_gather_into_tensor.default", {0},
        {{half}}, "bfloat16", 0)
        .collective = coll(CollectiveType::AllGather, 65536, int64_t{1} << 50);
  }
  doc.graphs = {g};
  ordered_json r = analyze(doc, CostModel(round_profile()));
  EXPECT_EQ(r["blocks"][0]["forward_all_gather_count"], 2);
  EXPECT_EQ(r["blocks"][0]["forward_all_gather_bytes"], std::numeric_limits<int64_t>::max());
  EXPECT_EQ(r["totals"]["forward_all_gather_bytes"], std::numeric_limits<int64_t>::max());
}

// An FSDP-like forward of `layers` blocks: per block a shard placeholder, all-gather, a pointwise
// op hiding part of it, wait, and a chain of mms and pointwise ops; about 20k nodes for 1000 blocks.
Document synthetic_doc(int layers, int chain) {
  Document doc;
  Graph g;
  g.name = "forward";
  const std::string bf16 = "bfloat16";
  int x = add(g, "x", NodeKind::Other, "placeholder", {}, {{4096, 4096}}, bf16, -1).id;
  for (int l = 0; l < layers; ++l) {
    doc.blocks.push_back({l, "layers." + std::to_string(l), "TransformerBlock"});
    const std::string s = std::to_string(l);
    int w = add(g, "w" + s, NodeKind::Other, "placeholder", {}, {{512, 4096}}, bf16, -1).id;
    int ag = add(g, "ag" + s, NodeKind::Collective, "_c10d_functional.all_gather_into_tensor.default", {w},
                 {{4096, 4096}}, bf16, l)
                 .id;
    g.nodes.back().collective = coll(CollectiveType::AllGather, 8, 512 * 4096 * 2);
    int wait = add(g, "wait" + s, NodeKind::Wait, "_c10d_functional.wait_tensor.default", {ag}, {{4096, 4096}},
                   bf16, l)
                   .id;
    for (int c = 0; c < chain; ++c) {
      const std::string cs = s + "_" + std::to_string(c);
      int v = add(g, "view" + cs, NodeKind::View, "aten.view.default", {x}, {{4096, 4096}}, bf16, l).id;
      int mm = add(g, "mm" + cs, NodeKind::Compute, "aten.mm.default", {v, wait}, {{4096, 4096}}, bf16, l,
                   int64_t{2} * 4096 * 4096 * 4096, 3 * 4096 * 4096 * 2)
                   .id;
      x = add(g, "add" + cs, NodeKind::Compute, "aten.add.Tensor", {mm, x}, {{4096, 4096}}, bf16, l, 4096 * 4096,
              3 * 4096 * 4096 * 2)
              .id;
    }
  }
  add(g, "output", NodeKind::Other, "output", {x}, {}, bf16, -1);
  doc.graphs.push_back(std::move(g));
  return doc;
}

// Scale only: the speed is measured by bench/plan_speed.py (timed assertions do not belong in unit tests).
TEST(Analyze, TwentyThousandNodes) {
  Document doc = synthetic_doc(1000, 6);  // 1 + 1000 x (3 + 6 x 3) + 1 = 21002 nodes
  ASSERT_GE(doc.graphs[0].nodes.size(), 20000u);
  CostModel m(testing::builtin_profile("h200-sxm"));
  const auto t0 = std::chrono::steady_clock::now();
  const ordered_json r = analyze(doc, m);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r["graphs"][0]["collectives"], 1000);
  EXPECT_EQ(r["blocks"].size(), 1000u);
  std::printf("analyze(): %zu nodes, %zu blocks: %.2f ms\n", doc.graphs[0].nodes.size(), doc.blocks.size(), ms);
}

// A tied weight (GPT-2: the output projection reuses the embedding's weight). The forward all-gathers it once,
// waits twice (embedding, output projection) and hands the collective's output to the backward, which waits on
// that graph input again. Its bytes count once (the forward's all-gather); the backward's wait has no collective
// of its graph: no comm, no exposure, no bucket, and the plans keep the tied all-gather where it was captured.
TEST(Analyze, TiedWeightGatheredOnceAndWaitedOnInTheBackward) {
  Document doc = doc_for("tied", 2);
  const std::string bf16 = "bfloat16";
  Graph fwd = graph_named("forward");
  add(fwd, "primals_1", NodeKind::Other, "placeholder", {}, {{512, 1024}}, bf16, -1);   // 0: the shard
  add(fwd, "tokens", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);     // 1
  add(fwd, "all_gather_into_tensor", NodeKind::Collective, "_c10d_functional.all_gather_into_tensor.default", {0},
      {{1024, 1024}}, bf16, -1)
      .collective = coll(CollectiveType::AllGather, 2, 1 * kMiB);                          // 2
  add(fwd, "wait_tensor", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {2}, {{1024, 1024}}, bf16, -1);
  add(fwd, "embedding", NodeKind::Compute, "aten.embedding.default", {3, 1}, {{1024, 1024}}, bf16, -1, 0, 4 * kMiB);
  add(fwd, "wait_tensor_1", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {2}, {{1024, 1024}}, bf16, -1);
  add(fwd, "mm", NodeKind::Compute, "aten.mm.default", {4, 5}, {{1024, 1024}}, bf16, -1, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);                                                                            // 6
  add(fwd, "output", NodeKind::Other, "output", {6, 2}, {}, bf16, -1);
  Graph bwd;
  bwd.name = "backward";
  add(bwd, "all_gather_into_tensor", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);  // 0: saved
  add(bwd, "tangents_1", NodeKind::Other, "placeholder", {}, {{1024, 1024}}, bf16, -1);              // 1
  add(bwd, "mm_1", NodeKind::Compute, "aten.mm.default", {1, 1}, {{1024, 1024}}, bf16, -1, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);                                                                            // 2
  add(bwd, "wait_tensor_2", NodeKind::Wait, "_c10d_functional.wait_tensor.default", {0}, {{1024, 1024}}, bf16, -1);
  add(bwd, "mm_2", NodeKind::Compute, "aten.mm.default", {2, 3}, {{1024, 1024}}, bf16, -1, 2 * 1024 * 1024 * 1024LL,
      6 * kMiB);                                                                            // 4
  add(bwd, "output", NodeKind::Other, "output", {4}, {}, bf16, -1);
  doc.graphs = {fwd, bwd};
  validate(doc);

  const CostModel m(round_profile());
  const ordered_json r = analyze(doc, m);
  const ordered_json& t = r["totals"];
  EXPECT_EQ(t["forward_all_gather_count"], 1);
  EXPECT_EQ(t["forward_all_gather_bytes"], 2 * kMiB);  // gathered once
  EXPECT_EQ(t["backward_all_gather_count"], 0);
  EXPECT_EQ(t["backward_all_gather_bytes"], 0);
  EXPECT_EQ(r["graphs"][1]["collectives"], 0);
  EXPECT_EQ(r["graphs"][1]["comm_us"].get<double>(), 0.0);
  EXPECT_EQ(r["graphs"][1]["exposed_comm_us"].get<double>(), 0.0);
  EXPECT_NEAR(r["graphs"][1]["makespan_us"].get<double>(), 2 * kMmUs, kEps);
  EXPECT_NEAR(r["graphs"][0]["comm_us"].get<double>(), kAgUs, kEps);

  const Plan f = make_plan(doc, "forward", m, PlanConfig());
  ASSERT_EQ(f.buckets.size(), 1u);
  EXPECT_EQ(f.buckets[0].backend, "nccl");
  EXPECT_EQ(f.buckets[0].reason, "nccl: read by 2 waits (coalesced); kept where captured");
  const Plan b = make_plan(doc, "backward", m, PlanConfig());
  EXPECT_TRUE(b.buckets.empty());
  EXPECT_EQ(b.summary.collectives, 0);
  EXPECT_EQ(b.summary.exposed_comm_us_after, 0.0);
  // The wait keeps its captured place: after mm_1, right before its user.
  EXPECT_EQ(b.order, (std::vector<std::string>{"all_gather_into_tensor", "tangents_1", "mm_1", "wait_tensor_2", "mm_2",
                                               "output"}));
}

}  // namespace
}  // namespace ce_overlap
