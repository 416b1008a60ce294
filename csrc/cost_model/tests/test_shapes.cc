// Compute priced by shape (shapes.h): the tables' interpolation, the fused kernels' kinds, the profile's "shapes"
// section (round trip, errors that name the field) and the cost model's use of it, hand-computed on the round profile.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cost_model/cost_model.h"
#include "cost_model/shapes.h"
#include "graph/analysis.h"
#include "graph/tests/graph_builder.h"
#include "test_util.h"

namespace ce_overlap {
namespace {

using nlohmann::json;
using testing::round_profile;

// A 2 x 2 x 2 GEMM table over dims {1000, 4000}: efficiency 0.2 at the small corner, 0.8 at the large one, and
// 0.5 everywhere else; attention causal 0.4 / 0.3 and non-causal 0.6 / 0.5 everywhere; memory pointwise 0.1 at 1 MB
// and 0.9 at 100 MB, reduction half of that, the loss 0.05 flat; the in-step factors 0.5 / 0.5 / 0.5.
json shapes_json() {
  std::vector<double> gemm(8, 0.5);
  gemm.front() = 0.2;
  gemm.back() = 0.8;
  auto att = [](double f, double b) {
    return json{{"seqs", {512, 4096}}, {"heads", {8, 32}}, {"head_dims", {64, 128}},
                {"forward", std::vector<double>(8, f)}, {"backward", std::vector<double>(8, b)}};
  };
  return {{"source", "test"},
          {"gemm", {{"dims", {1000, 4000}}, {"efficiency", gemm}}},
          {"attention", {{"tokens", 8192}, {"causal", att(0.4, 0.3)}, {"non_causal", att(0.6, 0.5)}}},
          {"memory", {{"bytes", {1e6, 1e8}}, {"pointwise", {0.1, 0.9}}, {"reduction", {0.05, 0.45}},
                      {"loss_forward", {0.05, 0.05}}}},
          {"in_step", {{"gemm", 0.5}, {"attention", 0.5}, {"memory", 0.5}}}};
}

Profile shaped_profile() {
  Profile p = round_profile();
  p.shapes = shapes_from_json(shapes_json(), "shapes");
  return p;
}

Node node(const std::string& op, std::vector<int64_t> shape, int64_t flops, int64_t bytes,
          const std::string& dtype = "bfloat16") {
  Node n;
  n.name = op;
  n.kind = NodeKind::Compute;
  n.op = op;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  n.outputs.push_back({shape, dtype, numel * dtype_itemsize(dtype)});
  n.flops = flops;
  n.bytes_accessed = bytes;
  return n;
}

TEST(ShapeTable, ExactAtPointsLogLinearBetweenClampedOutside) {
  ShapeTable t;
  t.axes = {{1, 100}};
  t.values = {0.2, 0.8};
  EXPECT_DOUBLE_EQ(t.at({1}), 0.2);
  EXPECT_DOUBLE_EQ(t.at({100}), 0.8);
  EXPECT_NEAR(t.at({10}), 0.5, 1e-12);  // halfway in log
  EXPECT_DOUBLE_EQ(t.at({0.01}), 0.2);  // clamped below and above
  EXPECT_DOUBLE_EQ(t.at({1e9}), 0.8);
  const ComputeShapes s = shapes_from_json(shapes_json(), "shapes");
  EXPECT_DOUBLE_EQ(s.gemm_efficiency(1000, 1000, 1000), 0.2);
  EXPECT_DOUBLE_EQ(s.gemm_efficiency(4000, 4000, 4000), 0.8);
  EXPECT_DOUBLE_EQ(s.gemm_efficiency(4000, 1000, 4000), 0.5);
  EXPECT_NEAR(s.gemm_efficiency(2000, 1000, 1000), 0.35, 1e-12);  // halfway along m between 0.2 and 0.5
}

TEST(ShapeTable, MemoryKindsFromOps) {
  auto kind = [](std::vector<std::string> ops) {
    std::vector<const std::string*> p;
    for (const std::string& o : ops) p.push_back(&o);
    return memory_kind(p);
  };
  EXPECT_EQ(kind({"prims.convert_element_type.default", "aten.mul.Tensor"}), MemoryKind::Pointwise);
  EXPECT_EQ(kind({"aten.mul.Tensor", "aten.sum.dim_IntList"}), MemoryKind::Reduction);
  EXPECT_EQ(kind({"aten.tanh.default", "aten.sum.dim_IntList"}), MemoryKind::GeluTanh);
  EXPECT_EQ(kind({"aten.erf.default"}), MemoryKind::GeluErf);
  EXPECT_EQ(kind({"prims.prepare_softmax_online.default", "aten.sub.Tensor"}), MemoryKind::LossForward);
  EXPECT_EQ(kind({"aten.log.default", "aten.sum.dim_IntList", "aten.gather.default"}), MemoryKind::LossForward);
  EXPECT_EQ(kind({"aten.exp.default", "prims.iota.default", "aten.eq.Tensor"}), MemoryKind::LossBackward);
  EXPECT_EQ(kind({"aten._log_softmax_backward_data.default", "aten.nll_loss_backward.default"}),
            MemoryKind::LossBackward);
  EXPECT_EQ(kind({"aten.exp.default", "aten.mul.Tensor"}), MemoryKind::Pointwise);  // an exp alone is no loss
  EXPECT_STREQ(to_string(MemoryKind::GeluErf), "gelu_erf");
}

TEST(ShapeTable, AbsentKindsFallBack) {
  const ComputeShapes s = shapes_from_json(shapes_json(), "shapes");
  EXPECT_DOUBLE_EQ(s.memory_efficiency(MemoryKind::GeluTanh, 1e8), 0.9);   // no gelu_tanh table: pointwise
  EXPECT_DOUBLE_EQ(s.memory_efficiency(MemoryKind::Reduction, 1e8), 0.45);
  EXPECT_DOUBLE_EQ(s.memory_efficiency(MemoryKind::LossForward, 1e8), 0.05);
  EXPECT_DOUBLE_EQ(s.memory_efficiency(MemoryKind::LossBackward, 1e8), 0.45);  // no loss_backward table: reduction
  json no_noncausal = shapes_json();
  no_noncausal["attention"].erase("non_causal");
  const ComputeShapes t = shapes_from_json(no_noncausal, "shapes");
  EXPECT_FALSE(t.attention_efficiency(1, 8, 512, 64, /*causal=*/false, false).has_value());
  EXPECT_DOUBLE_EQ(*t.attention_efficiency(1, 8, 512, 64, true, true), 0.3);
}

TEST(ShapeTable, ProfileRoundTrip) {
  const Profile p = shaped_profile();
  const json j = profile_to_json(p);
  ASSERT_TRUE(j.contains("shapes"));
  const Profile back = profile_from_json(j);
  ASSERT_TRUE(back.shapes.has_value());
  EXPECT_EQ(profile_to_json(back), j);
  EXPECT_EQ(back.shapes->gemm.values, p.shapes->gemm.values);
  EXPECT_DOUBLE_EQ(back.shapes->in_step_memory, 0.5);
  EXPECT_FALSE(profile_to_json(round_profile()).contains("shapes"));  // absent stays absent
}

TEST(ShapeTable, BadSectionsNameTheField) {
  auto error = [](json s) {
    try {
      shapes_from_json(s, "shapes");
    } catch (const IrError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  json a = shapes_json();
  a["gemm"]["efficiency"].erase(0);
  EXPECT_EQ(error(a), "shapes.gemm.efficiency: expected 8 values (m x n x k over dims, row-major), got 7");
  json b = shapes_json();
  b["gemm"]["dims"] = {4000, 1000};
  EXPECT_EQ(error(b), "shapes.gemm.dims[1]: an axis must ascend, got 1000.0 after 4000.0");
  json c = shapes_json();
  c["memory"].erase("pointwise");
  EXPECT_EQ(error(c), "shapes.memory.pointwise: missing (expected an array of efficiencies)");
  json d = shapes_json();
  d["memory"]["loss_backward"] = {0.05, 1.5};
  EXPECT_EQ(error(d), "shapes.memory.loss_backward[1]: expected an efficiency in (0, 1], got 1.5");
  json old = shapes_json();  // a grid measured before the loss's two kernels were priced apart
  old["memory"]["loss"] = {0.05, 0.05};
  EXPECT_EQ(error(old), "shapes.memory.loss: the loss's forward and backward are priced apart since 2026-12-04 "
                        "(loss_forward, loss_backward): measure the grid again (ce-overlap calibrate --compute-grid)");
  json e = shapes_json();
  e["in_step"]["gemm"] = 0;
  EXPECT_EQ(error(e), "shapes.in_step.gemm: expected a factor in (0, 2], got 0");
  json f = shapes_json();
  f["attention"]["causal"]["speed"] = 1;
  EXPECT_EQ(error(f), "shapes.attention.causal.speed: unknown key (expected one of: seqs, heads, head_dims, forward, "
                      "backward)");
}

TEST(ShapeCostModel, GemmFromItsShapeAndTheInStepFactor) {
  CostModel m(shaped_profile());
  // 4000^3 bf16: 1.28e11 FLOPs at 100 TFLOP/s x 0.8 x 0.5 = 3200 us.
  const int64_t f = int64_t{2} * 4000 * 4000 * 4000;
  EXPECT_NEAR(m.compute_us(node("aten.mm.default", {4000, 4000}, f, 1)), 3200.0, 1e-6);
  // A batched GEMM's m spans its batch: 4 x 1000 rows of n = 1000 -> (m, n, k) = (4000, 1000, 4000): 0.5.
  const int64_t fb = int64_t{2} * 4000 * 1000 * 4000;
  EXPECT_NEAR(m.compute_us(node("aten.bmm.default", {4, 1000, 1000}, fb, 1)), fb / (100e6 * 0.5 * 0.5), 1e-6);
  // A convolution's implicit GEMM: output [batch, channels, h, w] -> m = batch x h x w, n = channels.
  const int64_t fc = int64_t{2} * 1000 * 1000 * 1000;
  EXPECT_NEAR(m.compute_us(node("aten.convolution.default", {10, 1000, 10, 10}, fc, 1)), fc / (100e6 * 0.2 * 0.5),
              1e-6);
  // fp32 and ops without GEMM dims keep the scalar model (round profile: gemm 1, no ramp; fp32 peak 10 TFLOP/s).
  EXPECT_NEAR(m.compute_us(node("aten.mm.default", {4000, 4000}, f, 1, "float32")), f / 10e6, 1e-6);
  EXPECT_NEAR(m.compute_us(node("aten.convolution_backward.default", {4000, 4000}, f, 1)), f / 100e6, 1e-6);
}

TEST(ShapeCostModel, AttentionByCausalityAndFlexAtItsRatio) {
  Profile p = shaped_profile();
  p.efficiency.attention = 0.4;
  p.efficiency.attention_backward = 0.4;
  p.efficiency.flex_attention = 0.2;  // flex at half of SDPA's rate
  p.efficiency.flex_attention_backward = 0.2;
  CostModel m(p);
  const double full = 4.0 * 1 * 32 * 4096.0 * 4096.0 * 128;
  const int64_t causal = static_cast<int64_t>(full / 2), dense = static_cast<int64_t>(full);
  const std::vector<int64_t> q = {1, 32, 4096, 128};
  EXPECT_NEAR(m.compute_us(node("aten._scaled_dot_product_cudnn_attention.default", q, causal, 1)),
              causal / (100e6 * 0.4 * 0.5), 1e-3);
  EXPECT_NEAR(m.compute_us(node("aten._scaled_dot_product_cudnn_attention.default", q, dense, 1)),
              dense / (100e6 * 0.6 * 0.5), 1e-3);
  EXPECT_NEAR(m.compute_us(node("aten._scaled_dot_product_cudnn_attention_backward.default", q,
                                static_cast<int64_t>(2.5 * causal), 1)),
              2.5 * causal / (100e6 * 0.3 * 0.5), 1e-3);
  EXPECT_NEAR(m.compute_us(node("higher_order.flex_attention", q, causal, 1)), causal / (100e6 * 0.4 * 0.5 * 0.5),
              1e-3);
}

TEST(ShapeCostModel, MemoryBoundByKindAndSize) {
  CostModel m(shaped_profile());
  // A pointwise node of its own at 1e8 bytes: round HBM 1000 GB/s x 0.9 x 0.5 -> 1e8 / 4.5e5 us.
  EXPECT_NEAR(m.compute_us(node("aten.add.Tensor", {10}, 0, 100'000'000)), 1e8 / (1e6 * 0.45), 1e-6);
  EXPECT_NEAR(m.compute_us(node("aten.sum.dim_IntList", {10}, 0, 100'000'000)), 1e8 / (1e6 * 0.225), 1e-6);
  // Small: the launch floor (round profile: 5 us) still holds.
  EXPECT_DOUBLE_EQ(m.compute_us(node("aten.add.Tensor", {10}, 0, 1000)), 5.0);
}

TEST(ShapeCostModel, FusedGroupsAtTheirKindsRate) {
  // x -> exp -> mul (a pointwise group) and x -> prepare_softmax_online (the loss): each at its own rate.
  using testing::GraphBuilder;
  using testing::bytes_tensor;
  GraphBuilder g;
  const int x = g.placeholder("x", bytes_tensor(50'000'000));
  const int e = g.compute("exp", {x}, bytes_tensor(50'000'000));
  g.node(e).op = "aten.exp.default";
  g.node(e).bytes_accessed = 100'000'000;
  const int mul = g.compute("mul", {e}, bytes_tensor(50'000'000));
  g.node(mul).op = "aten.mul.Tensor";
  g.node(mul).bytes_accessed = 100'000'000;
  const int mm = g.compute("mm", {mul}, bytes_tensor(1000), /*flops=*/1000);  // a barrier: the loss is its own group
  const int sm = g.compute("softmax", {mm, x}, bytes_tensor(1000));
  g.node(sm).op = "prims.prepare_softmax_online.default";
  g.node(sm).bytes_accessed = 60'000'000;
  g.output({sm});
  CostModel m(shaped_profile());
  const std::vector<double> d = m.durations_us(g.graph());
  // The pointwise group moves x in and mul out: 1e8 bytes at 0.9 x 0.5 of 1000 GB/s.
  EXPECT_NEAR(d[e] + d[mul], 1e8 / (1e6 * 0.45), 1e-3);
  // The loss reads mm's 1000 bytes and x's 5e7 and writes 1000 at 0.05 x 0.5.
  EXPECT_NEAR(d[sm], 50'002'000 / (1e6 * 0.025), 1e-3);
}

}  // namespace
}  // namespace ce_overlap
