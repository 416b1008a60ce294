// A synthetic 32-layer Llama-sized graph (~20k nodes) through load, validate and every analysis:
// checks the results stay right at scale and prints the time taken (not asserted: machines vary).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "graph/analysis.h"
#include "graph/ir.h"
#include "graph_builder.h"

namespace ce_overlap {
namespace {

using testing::GraphBuilder;
using testing::make_doc;
using testing::tensor;

constexpr int kLayers = 32;
constexpr int kParamsPerLayer = 9;
constexpr int kComputeStepsPerLayer = 200;  // 32 x (22 + 3 x 200) + 2 = 19,906 nodes

// Per layer: a coalesced all-gather of 9 parameters (getitem + wait each), then a long chain of
// compute nodes with reshapes, each reading a gathered parameter, under a 3-deep module stack;
// a reduce-scatter of the layer's gradient-like output closes it.
Graph llama_like_graph() {
  GraphBuilder b("forward");
  int x = b.placeholder("tokens", tensor({8, 4096}, "bfloat16"));
  for (int layer = 0; layer < kLayers; ++layer) {
    const std::string l = "layers." + std::to_string(layer);
    const std::pair<std::string, std::string> blk{l, "TransformerBlock"};
    const int flat = b.placeholder("flat_param_" + std::to_string(layer), tensor({kParamsPerLayer * 1024}, "bfloat16"));
    const int ag = b.collective("ag_" + std::to_string(layer), {flat}, CollectiveType::AllGather,
                                tensor({kParamsPerLayer * 8192}, "bfloat16"));
    b.node(ag).module_stack = {blk};
    std::vector<int> params;
    for (int k = 0; k < kParamsPerLayer; ++k) {
      const std::string suffix = std::to_string(layer) + "_" + std::to_string(k);
      const int item = b.view("getitem_" + suffix, ag, tensor({8192}, "bfloat16"));
      params.push_back(b.wait("wait_" + suffix, item, tensor({8192}, "bfloat16")));
    }
    for (int step = 0; step < kComputeStepsPerLayer; ++step) {
      const std::string suffix = std::to_string(layer) + "_" + std::to_string(step);
      const bool attention = step < kComputeStepsPerLayer / 2;
      const std::string sub = l + (attention ? ".attention" : ".feed_forward");
      const std::string linear = sub + ".w" + std::to_string(step % 4);
      const std::vector<std::pair<std::string, std::string>> stack = {
          blk, {sub, attention ? "Attention" : "FeedForward"}, {linear, "Linear"}};
      const int mm = b.compute("mm_" + suffix, {x, params[step % kParamsPerLayer]}, tensor({8, 4096}, "bfloat16"),
                               int64_t{2} * 8 * 4096 * 4096);
      b.node(mm).module_stack = stack;
      const int v = b.view("view_" + suffix, mm, tensor({8, 64, 64}, "bfloat16"));
      b.node(v).module_stack = stack;
      x = b.compute("act_" + suffix, {v}, tensor({8, 4096}, "bfloat16"), 8 * 4096);
      b.node(x).module_stack = stack;
    }
    const int rs = b.collective("rs_" + std::to_string(layer), {x}, CollectiveType::ReduceScatter,
                                tensor({1, 4096}, "bfloat16"));
    b.node(rs).module_stack = {blk};
    const int rs_wait = b.wait("rs_wait_" + std::to_string(layer), rs, tensor({1, 4096}, "bfloat16"));
    b.node(rs_wait).module_stack = {blk};
  }
  b.output({x});
  return b.graph();
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

TEST(Scale, LlamaSizedGraphEndToEnd) {
  Document doc = make_doc({llama_like_graph()});
  const std::string text = save_ir(doc);
  const size_t num_nodes = doc.graphs[0].nodes.size();
  ASSERT_EQ(num_nodes, 19906u);

  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  Document loaded = load_ir(text);  // parse + structural checks + validate
  const double load_ms = ms_since(t0);
  auto t = clock::now();
  const std::vector<int> order = topological_order(loaded.graphs[0]);
  const double topo_ms = ms_since(t);
  t = clock::now();
  detect_blocks(loaded);
  const double blocks_ms = ms_since(t);
  t = clock::now();
  const MemoryEstimate memory = peak_memory(loaded.graphs[0], order);
  const double memory_ms = ms_since(t);
  t = clock::now();
  std::vector<double> durations_us(num_nodes, 0.0);
  for (const Node& n : loaded.graphs[0].nodes) {
    durations_us[n.id] = n.kind == NodeKind::Collective ? 50.0 : static_cast<double>(n.flops) / 1e9;
  }
  const Timeline timeline = simulate(loaded.graphs[0], order, durations_us);
  const double simulate_ms = ms_since(t);
  t = clock::now();
  const CriticalPath cp = critical_path(loaded.graphs[0], durations_us);
  const double critical_ms = ms_since(t);
  const double total_ms = ms_since(t0);
  t = clock::now();
  const std::string saved = save_ir(loaded);
  const double save_ms = ms_since(t);

  std::printf(
      "[scale] %zu nodes, %.1f MB of JSON: load+validate %.1f ms, topo %.2f ms, blocks %.2f ms, peak memory "
      "%.2f ms, simulate %.2f ms, critical path %.2f ms; total %.1f ms; save %.1f ms\n",
      num_nodes, text.size() / 1e6, load_ms, topo_ms, blocks_ms, memory_ms, simulate_ms, critical_ms, total_ms,
      save_ms);

  // Captured order is already topological, so the stable order is the identity.
  for (size_t i = 0; i < order.size(); ++i) ASSERT_EQ(order[i], static_cast<int>(i));
  ASSERT_EQ(loaded.blocks.size(), static_cast<size_t>(kLayers));
  EXPECT_EQ(loaded.blocks[9].path, "layers.9");
  EXPECT_EQ(loaded.blocks[10].path, "layers.10");
  EXPECT_EQ(loaded.graphs[0].nodes.back().block, -1);
  EXPECT_GT(memory.peak_bytes, 0);
  EXPECT_GT(timeline.makespan_us, 0);
  EXPECT_GE(cp.length, timeline.compute_busy_us - 1e-6);  // everything sits on one chain here
  // Blocks were filled in, so the saved text differs; it is still canonical.
  EXPECT_EQ(save_ir(load_ir(saved)), saved);
}

}  // namespace
}  // namespace ce_overlap
