// The cost model's compute side (docs/cost_model.md, "Compute"): one kernel's time by the roofline, with the
// profile's scalar efficiencies or its shape tables (shapes.h), and every node's time in a graph with Inductor's
// kernel fusion and the gap between kernels.
#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "../graph/analysis.h"
#include "cost_model.h"

namespace ce_overlap {

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// A GEMM's (m, n, k) from its output and its FLOPs (2 m n k): a convolution's m is its output's pixels over the batch
// (the implicit GEMM), a batched GEMM's m spans the batch. nullopt for other ops (a convolution's backward among them).
std::optional<std::array<double, 3>> gemm_mnk(const Node& node) {
  const std::string& op = node.op;
  const bool conv = starts_with(op, "aten.convolution.");
  if (!(conv || starts_with(op, "aten.mm.") || starts_with(op, "aten.addmm.") || starts_with(op, "aten.bmm.") ||
        starts_with(op, "aten.baddbmm."))) {
    return std::nullopt;
  }
  const std::vector<int64_t>& shape = node.outputs.front().shape;
  if (shape.size() < 2) return std::nullopt;
  double numel = 1;
  for (int64_t d : shape) numel *= static_cast<double>(d);
  const double n = static_cast<double>(conv ? shape[1] : shape.back());
  const double m = n > 0 ? numel / n : 0;
  if (m <= 0 || n <= 0) return std::nullopt;
  return std::array<double, 3>{m, n, static_cast<double>(node.flops) / (2 * m * n)};
}

// Op names of the nodes a kernel runs, for memory_kind.
std::vector<const std::string*> op_names(const Graph& g, const std::vector<int>& nodes) {
  std::vector<const std::string*> ops;
  for (int m : nodes) ops.push_back(&g.nodes[static_cast<size_t>(m)].op);
  return ops;
}

}  // namespace

CostModel::Roofline CostModel::roofline(const Node& node) const {
  const GpuSpec& gpu = profile_.gpu;
  const EfficiencySpec& eff = profile_.efficiency;
  const std::optional<ComputeShapes>& shapes = profile_.shapes;
  // Half-precision types run on tensor cores; everything else is charged the fp32 (non-tensor-core) peak.
  double peak_tflops = gpu.peak_fp32_tflops;
  bool half = false;
  if (!node.outputs.empty()) {
    const std::string& dtype = node.outputs.front().dtype;
    half = dtype == "bfloat16" || dtype == "float16";
    if (half) peak_tflops = gpu.peak_bf16_tflops;
  }
  const double flops = static_cast<double>(node.flops);
  Roofline r;
  if (flops > 0 && is_attention_op(node.op)) {  // its own efficiency, no GEMM ramp
    const bool backward = node.op.find("backward") != std::string::npos;
    const bool flex = is_flex_attention_op(node.op);
    double e = flex ? eff.flex_attention_or_attention(backward) : eff.attention_or_gemm(backward);
    // The output (forward) or grad_q (backward): [b, h, s, d]. `half` means there is an output.
    if (shapes && half && node.outputs.front().shape.size() == 4) {
      const std::vector<int64_t>& q = node.outputs.front().shape;
      const double b = static_cast<double>(q[0]), h = static_cast<double>(q[1]), seq = static_cast<double>(q[2]),
                   d = static_cast<double>(q[3]);
      // Executed FLOPs well under the full square's (4 b h s^2 d forward, 2.5x that backward): causal.
      const bool causal = flops < 0.75 * 4 * b * h * seq * seq * d * (backward ? 2.5 : 1.0);
      // Flex attention's Triton kernels: SDPA's shape dependence at the rate the scalars give flex against SDPA.
      if (std::optional<double> table = shapes->attention_efficiency(b, h, seq, d, causal || flex, backward)) {
        const double flex_ratio = flex ? e / eff.attention_or_gemm(backward) : 1.0;
        e = *table * shapes->in_step_attention * flex_ratio;
      }
    }
    r.flops_us = flops / (peak_tflops * 1e6 * e);
  } else if (const std::optional<std::array<double, 3>> mnk =
                 flops > 0 && shapes && half ? gemm_mnk(node) : std::nullopt) {
    const double e = shapes->gemm_efficiency((*mnk)[0], (*mnk)[1], (*mnk)[2]) * shapes->in_step_gemm;
    r.flops_us = flops / (peak_tflops * 1e6 * e);
  } else {
    // Efficiency gemm x F / (F + ramp): small GEMMs leave SMs idle (too few output tiles for one wave).
    // Written as (F + ramp) / (peak x gemm) the time is monotone in F.
    r.flops_us = flops > 0 ? (flops + eff.gemm_ramp_flops) / (peak_tflops * 1e6 * eff.gemm) : 0.0;
  }
  const double bytes = static_cast<double>(node.bytes_accessed);
  double memory_eff = eff.memory;
  if (shapes && flops <= 0 && bytes > 0) {  // a memory-bound kernel of its own: its kind's rate at its size
    memory_eff = shapes->memory_efficiency(memory_kind({&node.op}), bytes) * shapes->in_step_memory;
  }
  r.memory_us = bytes / (gpu.hbm_gbps * 1e3 * memory_eff);
  return r;
}

double CostModel::compute_us(const Node& node) const {
  if (node.kind != NodeKind::Compute) return 0.0;
  const Roofline r = roofline(node);
  return std::max({r.flops_us, r.memory_us, profile_.efficiency.kernel_launch_us});
}

bool CostModel::compute_bound(const Node& node) const {
  if (node.kind != NodeKind::Compute || node.flops <= 0) return false;
  const Roofline r = roofline(node);  // without the launch floor, which would make tiny kernels ties
  return r.flops_us >= r.memory_us;
}

double CostModel::node_us(const Node& node) const {
  if (node.kind == NodeKind::Collective) {
    if (!node.collective) {
      throw IrError("node " + std::to_string(node.id) + " (" + node.name + "): collective without collective fields");
    }
    return collective_us(*node.collective);
  }
  return compute_us(node);
}

std::vector<double> CostModel::durations_us(const Graph& g, std::vector<char>* kernel_starts) const {
  std::vector<double> out;
  out.reserve(g.nodes.size());
  for (const Node& n : g.nodes) out.push_back(node_us(n));
  // Fused kernels at the rate a compiled step's fused kernels reach: with shape tables their kind's at their bytes,
  // else efficiency.fused_memory (else memory).
  const double hbm_bytes_per_us = profile_.gpu.hbm_gbps * 1e3;
  const std::optional<ComputeShapes>& shapes = profile_.shapes;
  // A kernel's first node: the first compute node of a fusion group, or a compute node outside any group.
  std::vector<char> fused(g.nodes.size(), 0), starts(g.nodes.size(), 0);
  for (const FusionGroup& fg : fusion_groups(g)) {
    if (fg.compute_nodes.empty()) continue;
    starts[static_cast<size_t>(fg.compute_nodes.front())] = 1;
    const double group_bytes = static_cast<double>(fg.bytes_in + fg.bytes_out);
    const double rate = shapes ? shapes->memory_efficiency(memory_kind(op_names(g, fg.compute_nodes)), group_bytes) *
                                     shapes->in_step_memory
                               : profile_.efficiency.fused_memory_or_memory();
    const double hbm_us_per_byte = 1.0 / (hbm_bytes_per_us * rate);
    double unfused = 0;  // the group's nodes as kernels of their own, at the same rate (a group holds no FLOPs)
    for (int m : fg.compute_nodes) {
      fused[static_cast<size_t>(m)] = 1;
      out[m] = std::max(static_cast<double>(g.nodes[static_cast<size_t>(m)].bytes_accessed) * hbm_us_per_byte,
                        profile_.efficiency.kernel_launch_us);
      unfused += out[m];
    }
    const double fused_us = std::max(group_bytes * hbm_us_per_byte, profile_.efficiency.kernel_launch_us);
    if (unfused <= 0 || fused_us >= unfused) continue;  // fusion never makes a group slower than its kernels apart
    const double scale = fused_us / unfused;
    for (int m : fg.compute_nodes) out[m] *= scale;
  }
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].kind == NodeKind::Compute && !fused[i]) starts[i] = 1;
  }
  // The idle time between kernels: once per kernel, charged to the kernel's first node.
  const double gap = profile_.efficiency.kernel_gap_us;
  for (size_t i = 0; i < out.size(); ++i) out[i] += starts[i] ? gap : 0.0;
  if (kernel_starts != nullptr) *kernel_starts = std::move(starts);
  return out;
}

}  // namespace ce_overlap
