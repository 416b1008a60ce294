// Compute priced by shape (profile key "shapes", docs/profiles.md): the efficiency tables `ce-overlap calibrate
// --compute-grid` measures on one GPU (bf16 GEMMs by m, n, k; SDPA by sequence, heads, head dimension and causality;
// fused memory-bound kernels by kind and bytes), and the factor per class between those bursts and the same kernels
// inside a training step (in_step, fitted to recorded steps' kernel times). The cost model reads an efficiency from
// them by multilinear interpolation in log coordinates, clamped at each table's edges.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../graph/ir.h"

namespace ce_overlap {

// Efficiencies over a grid: axes (each strictly ascending, positive) and values in row-major order over them.
struct ShapeTable {
  std::vector<std::vector<double>> axes;
  std::vector<double> values;
  // The value at `x` (one coordinate per axis): multilinear in log(x), each coordinate clamped to its axis.
  double at(const std::vector<double>& x) const;
};

// The kinds of fused memory-bound kernels the grid measures apart (their rates differ by up to 3x at one size).
// The loss's forward and backward are kinds of their own: over the same logits the forward (the softmax statistics,
// a reduction over each row) runs at half the backward's rate per byte (bench/results/compute-grid-2026-12-04).
enum class MemoryKind { Pointwise, Reduction, GeluTanh, GeluErf, LossForward, LossBackward };
inline constexpr int kMemoryKinds = 6;
const char* to_string(MemoryKind kind);  // the profile's key: "pointwise", "reduction", "gelu_tanh", ...
// The kind of a fused kernel of these ops (IR op names): the loss's backward (its softmax recomputed with exp beside
// a one-hot target built from iota / eq, or log-softmax's / NLL's backward ops), the loss's forward (the online
// softmax statistics, log-softmax, NLL, the log of the sum), an erf or tanh GELU, a reduction (sum, mean, variance,
// max, ...), else pointwise; first match in that order.
MemoryKind memory_kind(const std::vector<const std::string*>& ops);

struct ComputeShapes {
  std::string source;  // where the tables were measured (a results folder, the command)
  ShapeTable gemm;     // axes m, n, k (elements); burst efficiency of peak bf16 FLOP/s (executed FLOPs)
  // SDPA, [0] causal, [1] not: axes seq, heads at `attention_tokens` tokens (batch x heads x seq / tokens), head_dim;
  // burst efficiency of peak on the executed FLOPs (causal: half the square). Absent ones: the scalar efficiencies.
  std::array<std::optional<ShapeTable>, 2> attention_forward, attention_backward;
  double attention_tokens = 8192;
  // Per memory kind, axis bytes (HBM traffic per kernel); efficiency of the HBM peak in bursts, by the kernels' own
  // durations. Pointwise and reduction are required; a kind that is absent takes pointwise's (GELUs) or reduction's
  // (the loss's forward and backward).
  std::array<std::optional<ShapeTable>, kMemoryKinds> memory;
  // Inside a training step over the bursts (the board at its power limit, caches shared): per class.
  double in_step_gemm = 1;
  double in_step_attention = 1;
  double in_step_memory = 1;

  double gemm_efficiency(double m, double n, double k) const;
  // nullopt where the table of that causality is absent.
  std::optional<double> attention_efficiency(double batch, double heads, double seq, double head_dim, bool causal,
                                             bool backward) const;
  double memory_efficiency(MemoryKind kind, double bytes) const;
};

// Parse and validate the profile's "shapes" object; `path` prefixes error messages ("shapes").
ComputeShapes shapes_from_json(const nlohmann::json& j, const std::string& path);
nlohmann::json shapes_to_json(const ComputeShapes& s);

}  // namespace ce_overlap
