// Graph algorithms: order, critical path, aliasing, block detection, peak memory and the timeline,
// each checked against numbers worked out by hand in the comments.
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "graph/analysis.h"
#include "graph/ir.h"
#include "graph_builder.h"

namespace ce_overlap {
namespace {

using testing::bytes_tensor;
using testing::GraphBuilder;
using testing::make_doc;
using testing::tensor;

std::vector<int> identity_order(const Graph& g) {
  std::vector<int> order(g.nodes.size());
  std::iota(order.begin(), order.end(), 0);
  return order;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const IrError& e) {
    return e.what();
  }
  return "";
}

// ---- topological order ----

TEST(TopologicalOrder, AlreadyOrderedGraphKeepsItsOrder) {
  GraphBuilder b;
  const int x = b.placeholder("x");
  const int y = b.placeholder("y");
  const int m = b.compute("m", {x, y});
  const int n = b.compute("n", {x});
  b.output({m, n});
  EXPECT_EQ(topological_order(b.graph()), (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(TopologicalOrder, TiesGoToTheSmallestId) {
  // 0 reads 2, 3 reads 1: ready {1, 2} -> 1, then {2, 3} -> 2, then {0, 3} -> 0, then 3.
  GraphBuilder b;
  b.compute("a", {});
  b.compute("b", {});
  b.compute("c", {});
  b.compute("d", {});
  b.node(0).inputs = {2};
  b.node(3).inputs = {1};
  EXPECT_EQ(topological_order(b.graph()), (std::vector<int>{1, 2, 0, 3}));
}

TEST(TopologicalOrder, CycleNamesTheNodesOnIt) {
  GraphBuilder b("fwd");
  b.placeholder("x");       // 0, not on the cycle
  b.compute("a", {0, 3});   // 1
  b.compute("b", {1});      // 2
  b.compute("c", {2});      // 3
  b.compute("tail", {3});   // 4, downstream of the cycle but not on it
  EXPECT_EQ(error_of([&] { topological_order(b.graph()); }),
            "graph \"fwd\": dependency cycle through nodes a -> b -> c -> a");
}

TEST(TopologicalOrder, RejectsOutOfRangeInput) {
  GraphBuilder b("fwd");
  b.compute("a", {7});
  EXPECT_EQ(error_of([&] { topological_order(b.graph()); }),
            "graph \"fwd\": node 0 (\"a\") has input 7 out of range [0, 1)");
}

TEST(CheckOrder, AcceptsValidAndNamesTheProblem) {
  GraphBuilder b("fwd");
  const int x = b.placeholder("x");
  const int y = b.placeholder("y");
  b.compute("m", {x, y});
  const Graph& g = b.graph();
  EXPECT_NO_THROW(check_order(g, {1, 0, 2}));
  EXPECT_EQ(error_of([&] { check_order(g, {0, 1}); }),
            "order: expected 3 node ids (every node of graph \"fwd\" once), got 2");
  EXPECT_EQ(error_of([&] { check_order(g, {0, 0, 2}); }),
            "order[1]: node 0 (\"x\") appears twice (also order[0])");
  EXPECT_EQ(error_of([&] { check_order(g, {0, 1, 3}); }), "order[2]: node id 3 out of range [0, 3)");
  EXPECT_EQ(error_of([&] { check_order(g, {0, 2, 1}); }),
            "order[1]: node 2 (\"m\") runs before its input node 1 (\"y\") at order[2]");
}

// ---- critical path ----

TEST(CriticalPath, Diamond) {
  // a(1) -> b(5) -> d(1), a -> c(2) -> d: the longest path is a, b, d = 7.
  GraphBuilder b;
  const int a = b.compute("a", {});
  const int bb = b.compute("b", {a});
  const int c = b.compute("c", {a});
  const int d = b.compute("d", {bb, c});
  CriticalPath cp = critical_path(b.graph(), {1, 5, 2, 1});
  EXPECT_DOUBLE_EQ(cp.length, 7.0);
  EXPECT_EQ(cp.nodes, (std::vector<int>{a, bb, d}));
  // Make the other side heavier.
  cp = critical_path(b.graph(), {1, 5, 9, 1});
  EXPECT_DOUBLE_EQ(cp.length, 11.0);
  EXPECT_EQ(cp.nodes, (std::vector<int>{a, c, d}));
}

TEST(CriticalPath, RejectsBadDurations) {
  GraphBuilder b("fwd");
  b.compute("a", {});
  EXPECT_EQ(error_of([&] { critical_path(b.graph(), {}); }),
            "durations: expected 1 entries (one per node of graph \"fwd\"), got 0");
  EXPECT_THROW(critical_path(b.graph(), {-1.0}), IrError);
  EXPECT_EQ(critical_path(Graph{}, {}).nodes.size(), 0u);
}

// ---- aliasing ----

TEST(Aliasing, StorageOwnerAndWaitedCollectiveFollowViewChains) {
  GraphBuilder b;
  const int x = b.placeholder("x");
  const int cc = b.collective("coalesced", {x});
  const int g0 = b.view("getitem", cc);
  const int g1 = b.view("getitem_1", g0);
  const int w = b.wait("wait", g1);
  const int v = b.view("v", w);
  const int m = b.compute("m", {v});
  const Graph& g = b.graph();
  EXPECT_EQ(storage_owner(g, g1), cc);
  EXPECT_EQ(storage_owner(g, w), cc);
  EXPECT_EQ(storage_owner(g, v), cc);
  EXPECT_EQ(storage_owner(g, m), m);
  EXPECT_EQ(storage_owner(g, x), x);
  EXPECT_EQ(waited_collective(g, w), cc);
  EXPECT_EQ(waited_collective(g, m), -1);
  EXPECT_EQ(waited_collective(g, cc), -1);
  EXPECT_THROW(storage_owner(g, 99), IrError);
}

// ---- blocks ----

// A node whose stack is `stack`, appended to `b` with no inputs (blocks only read the stacks).
void add_in(GraphBuilder& b, const std::string& name, std::vector<std::pair<std::string, std::string>> stack) {
  const int id = b.compute(name, {});
  b.node(id).module_stack = std::move(stack);
}

// Llama-like: embedding, TransformerBlock layers (each: attention with 4 Linears + sdpa, a norm,
// an MLP with 3 Linears, a residual add), final norm and output Linear.
void add_llama_layer(GraphBuilder& b, const std::string& layer, const std::string& prefix) {
  const std::pair<std::string, std::string> blk{layer, "TransformerBlock"};
  const std::pair<std::string, std::string> attn{layer + ".attention", "Attention"};
  const std::pair<std::string, std::string> mlp{layer + ".feed_forward", "FeedForward"};
  add_in(b, prefix + "norm_" + layer, {blk, {layer + ".attention_norm", "RMSNorm"}});
  for (const char* w : {"wq", "wk", "wv", "wo"}) {
    add_in(b, prefix + w + "_" + layer, {blk, attn, {layer + ".attention." + w, "Linear"}});
  }
  add_in(b, prefix + "sdpa_" + layer, {blk, attn});
  for (const char* w : {"w1", "w2", "w3"}) {
    add_in(b, prefix + w + "_" + layer, {blk, mlp, {layer + ".feed_forward." + w, "Linear"}});
  }
  add_in(b, prefix + "add_" + layer, {blk});
}

TEST(DetectBlocks, LlamaLikeStackPicksTransformerBlocksInNaturalOrder) {
  GraphBuilder fwd("forward");
  add_in(fwd, "emb", {{"tok_embeddings", "Embedding"}});
  for (const char* layer : {"layers.10", "layers.0", "layers.2"}) add_llama_layer(fwd, layer, "");
  add_in(fwd, "final_norm", {{"norm", "RMSNorm"}});
  add_in(fwd, "lm_head", {{"output", "Linear"}});
  add_in(fwd, "loss", {});
  GraphBuilder bwd("backward");
  add_llama_layer(bwd, "layers.2", "bw_");
  add_in(bwd, "bw_emb", {{"tok_embeddings", "Embedding"}});

  Document doc = make_doc({fwd.graph(), bwd.graph()});
  doc.blocks = {{0, "stale", "Old"}};  // replaced, not appended to
  doc.graphs[0].nodes[0].block = 0;
  detect_blocks(doc);

  ASSERT_EQ(doc.blocks.size(), 3u);
  EXPECT_EQ(doc.blocks[0].path, "layers.0");
  EXPECT_EQ(doc.blocks[1].path, "layers.2");  // natural sort: 2 before 10
  EXPECT_EQ(doc.blocks[2].path, "layers.10");
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(doc.blocks[i].id, i);
    EXPECT_EQ(doc.blocks[i].type, "TransformerBlock");
  }
  const auto& f = doc.graphs[0].nodes;
  ASSERT_EQ(f.size(), 1u + 3 * 10 + 3);
  EXPECT_EQ(f[0].block, -1);                 // emb
  for (int k = 1; k <= 10; ++k) EXPECT_EQ(f[k].block, 2) << f[k].name;   // layers.10 came first
  for (int k = 11; k <= 20; ++k) EXPECT_EQ(f[k].block, 0) << f[k].name;  // layers.0
  for (int k = 21; k <= 30; ++k) EXPECT_EQ(f[k].block, 1) << f[k].name;  // layers.2
  EXPECT_EQ(f[31].block, -1);                // final_norm
  EXPECT_EQ(f[32].block, -1);                // lm_head (a Linear, but not a block)
  EXPECT_EQ(f[33].block, -1);                // loss
  const auto& bw = doc.graphs[1].nodes;
  for (int k = 0; k < 10; ++k) EXPECT_EQ(bw[k].block, 1) << bw[k].name;
  EXPECT_EQ(bw[10].block, -1);
  EXPECT_NO_THROW(validate(doc));
}

TEST(DetectBlocks, NonLlamaNaming) {
  GraphBuilder b;
  add_in(b, "stem", {{"encoder", "Encoder"}});
  for (const char* stage : {"encoder.stage_b", "encoder.stage_a"}) {
    const std::string s = stage;
    for (int k = 0; k < 3; ++k) {
      add_in(b, s + "_conv" + std::to_string(k),
             {{"encoder", "Encoder"}, {s, "Stage"}, {s + ".conv" + std::to_string(k), "Conv"}});
    }
    add_in(b, s + "_pool", {{"encoder", "Encoder"}, {s, "Stage"}});
  }
  Document doc = make_doc({b.graph()});
  detect_blocks(doc);
  ASSERT_EQ(doc.blocks.size(), 2u);
  EXPECT_EQ(doc.blocks[0].path, "encoder.stage_a");
  EXPECT_EQ(doc.blocks[1].path, "encoder.stage_b");
  EXPECT_EQ(doc.blocks[0].type, "Stage");
  const auto& n = doc.graphs[0].nodes;
  EXPECT_EQ(n[0].block, -1);
  for (int k = 1; k <= 4; ++k) EXPECT_EQ(n[k].block, 1);
  for (int k = 5; k <= 8; ++k) EXPECT_EQ(n[k].block, 0);
}

TEST(DetectBlocks, EqualCoverageGoesToFewerCoarserInstances) {
  // Every node sits in an Inner, inside an Outer: both cover 4 nodes; Outer has 2 instances, Inner 4.
  GraphBuilder b;
  for (const char* outer : {"o.0", "o.1"}) {
    for (const char* inner : {"a", "b"}) {
      const std::string o = outer, i = o + "." + inner;
      add_in(b, i, {{o, "Outer"}, {i, "Inner"}});
    }
  }
  Document doc = make_doc({b.graph()});
  detect_blocks(doc);
  ASSERT_EQ(doc.blocks.size(), 2u);
  EXPECT_EQ(doc.blocks[0].type, "Outer");
  EXPECT_EQ(doc.blocks[1].path, "o.1");
}

TEST(DetectBlocks, NestedInstancesOfOneTypeAreNotCandidates) {
  // Seq covers all 4 nodes but "s" is an ancestor of "s.0": only Leaf (2 nodes) qualifies.
  GraphBuilder b;
  add_in(b, "n0", {{"s", "Seq"}, {"s.0", "Seq"}, {"s.0.l", "Leaf"}});
  add_in(b, "n1", {{"s", "Seq"}, {"s.1", "Seq"}, {"s.1.l", "Leaf"}});
  add_in(b, "n2", {{"s", "Seq"}, {"s.0", "Seq"}});
  add_in(b, "n3", {{"s", "Seq"}});
  Document doc = make_doc({b.graph()});
  detect_blocks(doc);
  ASSERT_EQ(doc.blocks.size(), 2u);
  EXPECT_EQ(doc.blocks[0].path, "s.0.l");
  EXPECT_EQ(doc.blocks[1].path, "s.1.l");
  const auto& n = doc.graphs[0].nodes;
  EXPECT_EQ(n[0].block, 0);
  EXPECT_EQ(n[1].block, 1);
  EXPECT_EQ(n[2].block, -1);
  EXPECT_EQ(n[3].block, -1);
}

TEST(DetectBlocks, NoRepeatedModuleMeansNoBlocks) {
  GraphBuilder b;
  add_in(b, "a", {{"encoder", "Encoder"}});
  add_in(b, "b", {{"decoder", "Decoder"}});
  add_in(b, "c", {});
  Document doc = make_doc({b.graph()});
  doc.blocks = {{0, "old", "Old"}};
  doc.graphs[0].nodes[1].block = 0;
  detect_blocks(doc);
  EXPECT_TRUE(doc.blocks.empty());
  for (const Node& n : doc.graphs[0].nodes) EXPECT_EQ(n.block, -1);
}

// ---- peak memory ----

TEST(PeakMemory, ChainWithViewsAndATransientNode) {
  // order p a v b d c out; a's life extends through its view v to c; d is never used.
  //   pos  node  alloc  while running  live after
  //   0    p     (100 input)     0          0
  //   1    a     40             40         40
  //   2    v     0 (alias of a) 40         40
  //   3    b     30             70         70
  //   4    d     25             95         70   (d freed at once)
  //   5    c     20             90         20   (a and b freed after c)
  //   6    out   0              20         20   (c is a graph output: lives to the end)
  GraphBuilder g;
  const int p = g.placeholder("p", bytes_tensor(100));
  const int a = g.compute("a", {p}, bytes_tensor(40));
  const int v = g.view("v", a, bytes_tensor(40));
  const int b = g.compute("b", {v}, bytes_tensor(30));
  const int d = g.compute("d", {p}, bytes_tensor(25));
  const int c = g.compute("c", {b, a}, bytes_tensor(20));
  g.output({c});
  validate(make_doc({g.graph()}));
  const MemoryEstimate m = peak_memory(g.graph(), identity_order(g.graph()));
  EXPECT_EQ(m.peak_bytes, 95);
  EXPECT_EQ(m.peak_node, d);
  EXPECT_EQ(m.input_bytes, 100);
  EXPECT_EQ(m.live_bytes_after, (std::vector<int64_t>{0, 40, 40, 70, 70, 20, 20}));

  // Running d first (right after p) moves the peak to c: 25 freed early, then 40 + 30 + 20 = 90.
  const MemoryEstimate m2 = peak_memory(g.graph(), {p, d, a, v, b, c, 6});
  EXPECT_EQ(m2.peak_bytes, 90);
  EXPECT_EQ(m2.peak_node, c);
  EXPECT_EQ(m2.live_bytes_after, (std::vector<int64_t>{0, 0, 40, 40, 70, 20, 20}));
  EXPECT_THROW(peak_memory(g.graph(), {a, p, v, b, d, c, 6}), IrError);
}

TEST(PeakMemory, CollectiveBufferLivesThroughItsWait) {
  //   pos  node  alloc          while running  live after
  //   0    p     (10 input)     0              0
  //   1    ag    80             80             80
  //   2    w     0 (alias ag)   80             80
  //   3    m     8              88             8    (ag freed after its last use through w)
  //   4    out   0              8              8
  GraphBuilder g;
  const int p = g.placeholder("p", bytes_tensor(10));
  const int ag = g.collective("ag", {p}, CollectiveType::AllGather, bytes_tensor(80));
  const int w = g.wait("w", ag, bytes_tensor(80));
  const int m = g.compute("m", {w}, bytes_tensor(8));
  g.output({m});
  const MemoryEstimate est = peak_memory(g.graph(), identity_order(g.graph()));
  EXPECT_EQ(est.peak_bytes, 88);
  EXPECT_EQ(est.peak_node, m);
  EXPECT_EQ(est.input_bytes, 10);
  EXPECT_EQ(est.live_bytes_after, (std::vector<int64_t>{0, 80, 80, 8, 8}));
}

TEST(PeakMemory, ViewReturnedAsOutputKeepsItsOwnerAlive) {
  GraphBuilder g;
  const int p = g.placeholder("p", bytes_tensor(4));
  const int a = g.compute("a", {p}, bytes_tensor(16));
  const int v = g.view("v", a, bytes_tensor(16));
  g.compute("b", {p}, bytes_tensor(2));
  g.output({v});
  const MemoryEstimate est = peak_memory(g.graph(), identity_order(g.graph()));
  EXPECT_EQ(est.peak_bytes, 18);
  EXPECT_EQ(est.live_bytes_after, (std::vector<int64_t>{0, 16, 16, 16, 16}));
}

// ---- timeline ----

TEST(FusionGroups, PointwiseChainBetweenGemmsIsOneKernel) {
  // p -> mm1 -> cast -> v (view) -> mul(cast-view, q) -> add -> mm2 -> out, and add is also an output.
  // {cast, v, mul, add} fuse: in = mm1's 100 + q's 10, out = add's 40 (read by mm2 and the output). cast's 80 and
  // mul's 60 never reach HBM.
  GraphBuilder g;
  const int p = g.placeholder("p", bytes_tensor(1000));
  const int q = g.placeholder("q", bytes_tensor(10));
  const int mm1 = g.compute("mm1", {p}, bytes_tensor(100), /*flops=*/1000);
  const int cast = g.compute("cast", {mm1}, bytes_tensor(80));
  const int v = g.view("v", cast, bytes_tensor(80));
  const int mul = g.compute("mul", {v, q}, bytes_tensor(60));
  const int add = g.compute("add", {mul, mm1}, bytes_tensor(40));
  const int mm2 = g.compute("mm2", {add}, bytes_tensor(30), /*flops=*/1000);
  g.output({mm2, add});
  validate(make_doc({g.graph()}));
  const std::vector<FusionGroup> groups = fusion_groups(g.graph());
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].compute_nodes, (std::vector<int>{cast, mul, add}));
  EXPECT_EQ(groups[0].bytes_in, 100 + 10);  // mm1 read once although cast and add both read it
  EXPECT_EQ(groups[0].bytes_out, 40);
  (void)v;
}

TEST(FusionGroups, AReductionOverLeadingDimensionsIsAKernelOfItsOwn) {
  // mul [64, 32] -> sum over rows (a bias gradient, [32]) and -> sum over columns (a norm's statistic, [64, 1]): the
  // column-wise sum joins no producer (it reads mul's output again), the row-wise one fuses with mul.
  GraphBuilder g;
  const int p = g.placeholder("p", tensor({64, 32}));
  const int mul = g.compute("mul", {p}, tensor({64, 32}));
  g.node(mul).op = "aten.mul.Tensor";
  const int bias_grad = g.compute("bias_grad", {mul}, tensor({32}));
  g.node(bias_grad).op = "aten.sum.dim_IntList";
  const int cast = g.compute("cast", {bias_grad}, tensor({32}));  // its consumer may join it
  const int row_sum = g.compute("row_sum", {mul}, tensor({64, 1}));
  g.node(row_sum).op = "aten.sum.dim_IntList";
  g.output({cast, row_sum});
  const std::vector<FusionGroup> groups = fusion_groups(g.graph());
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].compute_nodes, (std::vector<int>{mul, row_sum}));
  EXPECT_EQ(groups[1].compute_nodes, (std::vector<int>{bias_grad, cast}));
  EXPECT_EQ(groups[1].bytes_in, 64 * 32 * 4);  // mul's output read again
  EXPECT_EQ(groups[0].bytes_out, 64 * 32 * 4 + 64 * 4);  // mul's output leaves for the column sum
}

TEST(FusionGroups, ViewsReadOutsideMakeTheirProducerWriteAndUnusedOutputsCount) {
  // a -> v -> mm (outside): a's output leaves through its view. b has no user at all: written (an effect).
  // c reads a view of the GEMM: the view's 8 bytes enter, not the GEMM's 64.
  GraphBuilder g;
  const int p = g.placeholder("p", bytes_tensor(16));
  const int a = g.compute("a", {p}, bytes_tensor(16));
  const int v = g.view("v", a, bytes_tensor(16));
  const int mm = g.compute("mm", {v}, bytes_tensor(64), /*flops=*/10);
  const int b = g.compute("b", {a}, bytes_tensor(4));
  const int slice = g.view("slice", mm, bytes_tensor(8));
  const int c = g.compute("c", {slice}, bytes_tensor(2));
  g.output({c});
  validate(make_doc({g.graph()}));
  const std::vector<FusionGroup> groups = fusion_groups(g.graph());
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].compute_nodes, (std::vector<int>{a, b}));
  EXPECT_EQ(groups[0].bytes_in, 16);
  EXPECT_EQ(groups[0].bytes_out, 16 + 4);
  EXPECT_EQ(groups[1].compute_nodes, (std::vector<int>{c}));
  EXPECT_EQ(groups[1].bytes_in, 8);
  EXPECT_EQ(groups[1].bytes_out, 2);
}

TEST(FusionGroups, GemmsCollectivesAndWaitsSeparateGroups) {
  // Two pointwise ops on either side of a collective and its wait do not fuse; no group without compute.
  GraphBuilder g;
  const int p = g.placeholder("p");
  const int a = g.compute("a", {p});
  const int ag = g.collective("ag", {a});
  const int w = g.wait("w", ag);
  const int b = g.compute("b", {w});
  const int mm = g.compute("mm", {b}, tensor({4, 4}), 100);
  const int v = g.view("v", mm);
  g.output({v});
  validate(make_doc({g.graph()}));
  const std::vector<FusionGroup> groups = fusion_groups(g.graph());
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].compute_nodes, (std::vector<int>{a}));
  EXPECT_EQ(groups[1].compute_nodes, (std::vector<int>{b}));
}

TEST(FusionGroups, NoGroupSpansAKernelBetweenItsNodes) {
  // A residual stream: x -> norm -> mm -> add(x, mm) -> norm2 -> mm2. x's norm and the add are joined by the edge
  // x -> add, but mm runs between them (norm -> mm -> add): Inductor runs norm, then mm, then add + norm2. Two
  // groups, not one; the add's group reads x again (bytes_in) and writes its sum for mm2's neighbour (bytes_out).
  GraphBuilder g;
  const int p = g.placeholder("p", bytes_tensor(8));
  const int x = g.compute("x", {p}, bytes_tensor(8));
  const int norm = g.compute("norm", {x}, bytes_tensor(8));
  const int mm = g.compute("mm", {norm}, bytes_tensor(8), /*flops=*/100);
  const int add = g.compute("add", {x, mm}, bytes_tensor(8));
  const int norm2 = g.compute("norm2", {add}, bytes_tensor(8));
  const int mm2 = g.compute("mm2", {norm2}, bytes_tensor(8), /*flops=*/100);
  g.output({mm2, add});
  validate(make_doc({g.graph()}));
  const std::vector<FusionGroup> groups = fusion_groups(g.graph());
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].compute_nodes, (std::vector<int>{x, norm}));
  EXPECT_EQ(groups[0].bytes_in, 8);       // p
  EXPECT_EQ(groups[0].bytes_out, 8 + 8);  // x (read by add) and norm (read by mm)
  EXPECT_EQ(groups[1].compute_nodes, (std::vector<int>{add, norm2}));
  EXPECT_EQ(groups[1].bytes_in, 8 + 8);   // x and mm
  EXPECT_EQ(groups[1].bytes_out, 8 + 8);  // add (an output) and norm2 (read by mm2)
  // A collective and its wait between two pointwise nodes keep them apart the same way.
  GraphBuilder c;
  const int q = c.placeholder("q");
  const int a = c.compute("a", {q});
  const int ag = c.collective("ag", {a});
  const int w = c.wait("w", ag);
  const int b = c.compute("b", {a, w});
  c.output({b});
  validate(make_doc({c.graph()}));
  const std::vector<FusionGroup> split = fusion_groups(c.graph());
  ASSERT_EQ(split.size(), 2u);
  EXPECT_EQ(split[0].compute_nodes, (std::vector<int>{a}));
  EXPECT_EQ(split[1].compute_nodes, (std::vector<int>{b}));
}

TEST(Simulate, OverlappedAndExposedCollectives) {
  // c1 (10 us) overlaps m1 (15 us): its wait finds it done, exposed 0.
  // c2 (8 us) needs m2 and is waited on at once: the compute stream idles 8 us, all exposed.
  GraphBuilder b;
  const int p = b.placeholder("p");           // 0
  const int c1 = b.collective("c1", {p});     // 1
  const int m1 = b.compute("m1", {p});        // 2
  const int w1 = b.wait("w1", c1);            // 3
  const int m2 = b.compute("m2", {w1, m1});   // 4
  const int c2 = b.collective("c2", {m2});    // 5
  const int w2 = b.wait("w2", c2);            // 6
  const int m3 = b.compute("m3", {w2});       // 7
  b.output({m3});                             // 8
  const Graph& g = b.graph();
  validate(make_doc({g}));
  const Timeline t = simulate(g, identity_order(g), {0, 10, 15, 0, 5, 8, 0, 2, 0});

  ASSERT_EQ(t.events.size(), 5u);  // c1, m1, m2, c2, m3: zero-time non-collectives leave no event
  const std::vector<std::tuple<int, Stream, double, double>> expected = {
      {c1, Stream::Comm, 0, 10}, {m1, Stream::Compute, 0, 15}, {m2, Stream::Compute, 15, 20},
      {c2, Stream::Comm, 20, 28}, {m3, Stream::Compute, 28, 30}};
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(t.events[i].node, std::get<0>(expected[i])) << i;
    EXPECT_EQ(t.events[i].stream, std::get<1>(expected[i])) << i;
    EXPECT_DOUBLE_EQ(t.events[i].start_us, std::get<2>(expected[i])) << i;
    EXPECT_DOUBLE_EQ(t.events[i].end_us, std::get<3>(expected[i])) << i;
  }
  EXPECT_DOUBLE_EQ(t.makespan_us, 30);
  EXPECT_DOUBLE_EQ(t.compute_busy_us, 22);
  EXPECT_DOUBLE_EQ(t.comm_busy_us, 18);
  ASSERT_EQ(t.exposed_us_by_collective.size(), g.nodes.size());
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[c1], 0);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[c2], 8);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[w2], 0);  // indexed by the collective, not the wait
}

TEST(Simulate, PartialOverlapExposesTheRemainder) {
  GraphBuilder b;
  const int p = b.placeholder("p");
  const int c = b.collective("c", {p});
  b.compute("m", {p});
  const int w = b.wait("w", c);
  b.compute("after", {w});
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), {0, 10, 4, 0, 1});
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[c], 6);  // m ends at 4, c at 10
  EXPECT_DOUBLE_EQ(t.makespan_us, 11);
}

TEST(Simulate, CommStreamIsFifo) {
  // Two 10 us collectives issued together: the second starts when the first ends.
  GraphBuilder b;
  const int p = b.placeholder("p");
  const int ca = b.collective("ca", {p});
  const int cb = b.collective("cb", {p});
  b.wait("wa", ca);
  b.wait("wb", cb);
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), {0, 10, 10, 0, 0});
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_DOUBLE_EQ(t.events[1].start_us, 10);
  EXPECT_DOUBLE_EQ(t.events[1].end_us, 20);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[ca], 10);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[cb], 10);  // wb blocks from 10 to 20
  EXPECT_DOUBLE_EQ(t.makespan_us, 20);
}

TEST(Simulate, CoalescedGetitemsDoNotBlockCompute) {
  // getitem views of an unwaited collective are bookkeeping: m runs at 0, the first wait blocks
  // 4 -> 10 (exposed 6), the second finds the collective done.
  GraphBuilder b;
  const int p = b.placeholder("p");
  const int cc = b.collective("coalesced", {p});
  const int g0 = b.view("getitem", cc);
  const int g1 = b.view("getitem_1", cc);
  const int m = b.compute("m", {p});
  b.wait("w0", g0);
  b.wait("w1", g1);
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), {0, 10, 0, 0, 4, 0, 0});
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[1].node, m);
  EXPECT_DOUBLE_EQ(t.events[1].start_us, 0);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[cc], 6);
  EXPECT_DOUBLE_EQ(t.makespan_us, 10);
}

TEST(Simulate, DirectReadOfACollectiveWaitsForItWithoutCountingExposure) {
  GraphBuilder b;
  const int p = b.placeholder("p");
  const int c = b.collective("c", {p});
  const int m = b.compute("m", {c});
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), {0, 10, 3});
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[1].node, m);
  EXPECT_DOUBLE_EQ(t.events[1].start_us, 10);
  EXPECT_DOUBLE_EQ(t.events[1].end_us, 13);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[c], 0);
}

// A collective of another process group: its own comm stream.
int in_group(GraphBuilder& b, int collective, const std::string& group) {
  b.node(collective).collective->group = group;
  return collective;
}

TEST(Simulate, EachGroupHasItsOwnCommStream) {
  // ca (group 0) and cb (group 1) issued together run at once; cc, group 0 again, queues behind ca.
  GraphBuilder b;
  const int p = b.placeholder("p");
  const int ca = b.collective("ca", {p});
  const int cb = in_group(b, b.collective("cb", {p}), "1");
  const int cc = b.collective("cc", {p});
  b.wait("wa", ca);
  b.wait("wb", cb);
  b.wait("wc", cc);
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), {0, 10, 10, 10, 0, 0, 0});
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_DOUBLE_EQ(t.events[1].start_us, 0);   // cb beside ca
  EXPECT_DOUBLE_EQ(t.events[2].start_us, 10);  // cc after ca
  EXPECT_DOUBLE_EQ(t.makespan_us, 20);
  EXPECT_TRUE(t.overlaps.empty());  // no link shares given: nothing shared
}

TEST(Simulate, ACollectiveStartsWhenTheComputeStreamReachesIt) {
  // c's input p is ready at 0, but c is issued after m (10 us): its stream waits for the issuing stream, as NCCL's
  // and the copy engines' do.
  GraphBuilder b;
  const int p = b.placeholder("p");
  b.compute("m", {p});
  const int c = b.collective("c", {p});
  const int w = b.wait("w", c);
  b.compute("after", {w});
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), {0, 10, 5, 0, 1});
  EXPECT_DOUBLE_EQ(t.events[1].start_us, 10);
  EXPECT_DOUBLE_EQ(t.events[1].end_us, 15);
  EXPECT_DOUBLE_EQ(t.exposed_us_by_collective[c], 5);
  EXPECT_DOUBLE_EQ(t.makespan_us, 16);
}

TEST(Simulate, CollectivesOfTwoGroupsShareTheLinkWhereTheyOverlap) {
  // ca (0.8 of the link) runs 0-10, cb (0.7) 4-14 alone: 6 us together at 1.5 x the link, each 1 / 1.5 as fast, so
  // each gains 6 x (1 - 1 / 1.5) = 2 us; a third collective of a third group below the link's rest (0.1) shares
  // nothing with either (0.8 + 0.1, 0.7 + 0.1 <= 1).
  GraphBuilder b;
  const int p = b.placeholder("p");                               // 0
  const int ca = b.collective("ca", {p});                         // 1
  const int m = b.compute("m", {p});                              // 2
  const int cb = in_group(b, b.collective("cb", {m}), "1");       // 3
  const int cc = in_group(b, b.collective("cc", {m}), "2");       // 4
  const int wa = b.wait("wa", ca);                                // 5
  const int wb = b.wait("wb", cb);                                // 6
  const int wc = b.wait("wc", cc);                                // 7
  b.output({wa, wb, wc});                                         // 8
  const std::vector<double> durations = {0, 10, 4, 10, 10, 0, 0, 0, 0};
  SimulateOptions shared;
  shared.link_share = {0, 0.8, 0, 0.7, 0.1, 0, 0, 0, 0};
  const Timeline alone = simulate(b.graph(), identity_order(b.graph()), durations);
  const Timeline t = simulate(b.graph(), identity_order(b.graph()), durations, shared);
  ASSERT_EQ(t.overlaps.size(), 1u);
  EXPECT_EQ(t.overlaps[0].a, ca);
  EXPECT_EQ(t.overlaps[0].b, cb);
  EXPECT_DOUBLE_EQ(t.overlaps[0].overlap_us, 6);
  EXPECT_NEAR(t.overlaps[0].added_a_us, 2, 1e-9);
  EXPECT_NEAR(t.overlaps[0].added_b_us, 2, 1e-9);
  EXPECT_DOUBLE_EQ(alone.makespan_us, 14);
  EXPECT_NEAR(t.makespan_us, 16, 1e-9);  // cb: 4 + 10 + 2
  EXPECT_NEAR(t.exposed_us_by_collective[ca], 12 - 4, 1e-9);
  SimulateOptions wrong;
  wrong.link_share = {0.5};
  EXPECT_THROW(simulate(b.graph(), identity_order(b.graph()), durations, wrong), IrError);
}

TEST(Simulate, RejectsBadOrderAndDurations) {
  GraphBuilder b;
  const int p = b.placeholder("p");
  b.compute("m", {p});
  EXPECT_THROW(simulate(b.graph(), {1, 0}, {0, 1}), IrError);
  EXPECT_THROW(simulate(b.graph(), {0, 1}, {0}), IrError);
}

}  // namespace
}  // namespace ce_overlap
