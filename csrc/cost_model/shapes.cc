// The shape tables of a profile (shapes.h): loading with checks that name the field, saving, and the lookups.
#include "shapes.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "json_reader.h"

namespace ce_overlap {

namespace {

using nlohmann::json;
using namespace json_reader;

constexpr const char* kMemoryKeys[kMemoryKinds] = {"pointwise", "reduction",    "gelu_tanh",
                                                   "gelu_erf",  "loss_forward", "loss_backward"};

// A strictly ascending array of positive numbers (a table's axis).
std::vector<double> read_axis(const ObjectReader& r, const char* key) {
  const json& a = r.array(key, "an ascending array of positive numbers");
  if (a.empty()) throw IrError(r.child(key) + ": expected at least one value, got []");
  std::vector<double> out;
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string p = index_path(r.child(key), i);
    const double x = positive_value(a[i], p);
    if (!out.empty() && x <= out.back()) {
      throw IrError(p + ": an axis must ascend, got " + num(x) + " after " + num(out.back()));
    }
    out.push_back(x);
  }
  return out;
}

// `size` efficiencies in (0, 1].
std::vector<double> read_values(const ObjectReader& r, const char* key, size_t size, const std::string& layout) {
  const json& a = r.array(key, "an array of efficiencies");
  if (a.size() != size) {
    throw IrError(r.child(key) + ": expected " + std::to_string(size) + " values (" + layout + "), got " +
                  std::to_string(a.size()));
  }
  std::vector<double> out;
  for (size_t i = 0; i < a.size(); ++i) {
    out.push_back(number_value(a[i], index_path(r.child(key), i), "an efficiency in (0, 1]",
                               [](double x) { return x > 0 && x <= 1; }));
  }
  return out;
}

// An SDPA table: {seqs, heads, head_dims, forward, backward}.
void read_attention(const ObjectReader& parent, const char* key, std::optional<ShapeTable>& fwd,
                    std::optional<ShapeTable>& bwd) {
  if (!parent.has(key)) return;
  ObjectReader r = parent.object(key, {"seqs", "heads", "head_dims", "forward", "backward"});
  ShapeTable t;
  t.axes = {read_axis(r, "seqs"), read_axis(r, "heads"), read_axis(r, "head_dims")};
  const size_t size = t.axes[0].size() * t.axes[1].size() * t.axes[2].size();
  const std::string layout = "seqs x heads x head_dims, row-major";
  fwd = t;
  bwd = t;
  fwd->values = read_values(r, "forward", size, layout);
  bwd->values = read_values(r, "backward", size, layout);
}

json table_axes_json(const ShapeTable& t, std::initializer_list<const char*> names) {
  json j = json::object();
  size_t i = 0;
  for (const char* n : names) j[n] = t.axes[i++];
  return j;
}

bool has(const std::vector<const std::string*>& ops, const char* part) {
  return std::any_of(ops.begin(), ops.end(), [&](const std::string* op) { return op->find(part) != std::string::npos; });
}

}  // namespace

double ShapeTable::at(const std::vector<double>& x) const {
  const size_t d = axes.size();
  // Per axis: the two neighbouring indices and the weight of the upper one.
  std::vector<size_t> lo(d), hi(d);
  std::vector<double> w(d);
  for (size_t a = 0; a < d; ++a) {
    const std::vector<double>& ax = axes[a];
    const double v = std::clamp(x[a], ax.front(), ax.back());
    size_t i = static_cast<size_t>(std::upper_bound(ax.begin(), ax.end(), v) - ax.begin());
    i = std::clamp<size_t>(i, 1, ax.size()) - 1;
    lo[a] = i;
    hi[a] = std::min(i + 1, ax.size() - 1);
    w[a] = hi[a] == lo[a] ? 0.0 : std::log(v / ax[lo[a]]) / std::log(ax[hi[a]] / ax[lo[a]]);
  }
  double total = 0;
  for (size_t corner = 0; corner < (size_t{1} << d); ++corner) {
    double weight = 1;
    size_t index = 0;
    for (size_t a = 0; a < d; ++a) {
      const bool upper = (corner >> a) & 1;
      weight *= upper ? w[a] : 1 - w[a];
      index = index * axes[a].size() + (upper ? hi[a] : lo[a]);
    }
    if (weight > 0) total += weight * values[index];
  }
  return total;
}

const char* to_string(MemoryKind kind) { return kMemoryKeys[static_cast<int>(kind)]; }

MemoryKind memory_kind(const std::vector<const std::string*>& ops) {
  // The loss's backward (the softmax recomputed with exp, minus a one-hot target built from iota / eq; or the
  // backward ops undecomposed), then its forward (Inductor's online softmax statistics, the log of the sum).
  if (has(ops, "_log_softmax_backward") || has(ops, "nll_loss_backward") ||
      (has(ops, "aten.exp.") && (has(ops, "iota") || has(ops, "aten.eq.")))) {
    return MemoryKind::LossBackward;
  }
  if (has(ops, "prepare_softmax_online") || has(ops, "_log_softmax") || has(ops, "nll_loss") ||
      has(ops, "aten.log.")) {
    return MemoryKind::LossForward;
  }
  if (has(ops, "aten.erf.")) return MemoryKind::GeluErf;
  if (has(ops, "aten.tanh.")) return MemoryKind::GeluTanh;
  for (const char* r : {"aten.sum.", "aten.mean.", "aten.var_mean.", "aten.amax.", "aten.amin.", "aten.max.",
                        "aten.min.", "aten.prod.", "aten.argmax.", "aten.argmin.", "aten.topk.", "aten.sort."}) {
    if (has(ops, r)) return MemoryKind::Reduction;
  }
  return MemoryKind::Pointwise;
}

double ComputeShapes::gemm_efficiency(double m, double n, double k) const { return gemm.at({m, n, k}); }

std::optional<double> ComputeShapes::attention_efficiency(double batch, double heads, double seq, double head_dim,
                                                          bool causal, bool backward) const {
  const std::optional<ShapeTable>& t = (backward ? attention_backward : attention_forward)[causal ? 0 : 1];
  if (!t) return std::nullopt;
  return t->at({seq, batch * heads * seq / attention_tokens, head_dim});
}

double ComputeShapes::memory_efficiency(MemoryKind kind, double bytes) const {
  const int i = static_cast<int>(kind);
  const bool loss = kind == MemoryKind::LossForward || kind == MemoryKind::LossBackward;
  const int fallback = static_cast<int>(loss ? MemoryKind::Reduction : MemoryKind::Pointwise);
  const ShapeTable& t = memory[i] ? *memory[i] : *memory[fallback];
  return t.at({bytes});
}

ComputeShapes shapes_from_json(const json& j, const std::string& path) {
  ObjectReader root(j, path, {"source", "gemm", "attention", "memory", "in_step"});
  ComputeShapes s;
  s.source = root.string("source", false);

  ObjectReader gemm = root.object("gemm", {"dims", "efficiency"});
  const std::vector<double> dims = read_axis(gemm, "dims");
  s.gemm.axes = {dims, dims, dims};
  s.gemm.values = read_values(gemm, "efficiency", dims.size() * dims.size() * dims.size(),
                              "m x n x k over dims, row-major");

  ObjectReader att = root.object("attention", {"tokens", "causal", "non_causal"});
  s.attention_tokens = att.positive_number("tokens");
  read_attention(att, "causal", s.attention_forward[0], s.attention_backward[0]);
  read_attention(att, "non_causal", s.attention_forward[1], s.attention_backward[1]);

  if (const json* m = root.has("memory") ? &root.field("memory", "an object") : nullptr;
      m != nullptr && m->is_object() && m->contains("loss")) {
    throw IrError(root.child("memory") + ".loss: the loss's forward and backward are priced apart since 2026-12-04 "
                  "(loss_forward, loss_backward): measure the grid again (ce-overlap calibrate --compute-grid)");
  }
  ObjectReader mem = root.object("memory", {"bytes", "pointwise", "reduction", "gelu_tanh", "gelu_erf", "loss_forward",
                                            "loss_backward"});
  const std::vector<double> bytes = read_axis(mem, "bytes");
  for (int i = 0; i < kMemoryKinds; ++i) {
    const bool required = i == static_cast<int>(MemoryKind::Pointwise) || i == static_cast<int>(MemoryKind::Reduction);
    if (!required && !mem.has(kMemoryKeys[i])) continue;
    ShapeTable t;
    t.axes = {bytes};
    t.values = read_values(mem, kMemoryKeys[i], bytes.size(), "one per bytes entry");
    s.memory[i] = std::move(t);
  }

  ObjectReader in_step = root.object("in_step", {"gemm", "attention", "memory"});
  auto factor = [&](const char* key) {
    return number_value(in_step.field(key, "a factor in (0, 2]"), in_step.child(key), "a factor in (0, 2]",
                        [](double x) { return x > 0 && x <= 2; });
  };
  s.in_step_gemm = factor("gemm");
  s.in_step_attention = factor("attention");
  s.in_step_memory = factor("memory");
  return s;
}

json shapes_to_json(const ComputeShapes& s) {
  json att = {{"tokens", s.attention_tokens}};
  for (int c = 0; c < 2; ++c) {
    if (!s.attention_forward[c]) continue;
    json t = table_axes_json(*s.attention_forward[c], {"seqs", "heads", "head_dims"});
    t["forward"] = s.attention_forward[c]->values;
    t["backward"] = s.attention_backward[c]->values;
    att[c == 0 ? "causal" : "non_causal"] = std::move(t);
  }
  json mem = {{"bytes", s.memory[0]->axes[0]}};
  for (int i = 0; i < kMemoryKinds; ++i) {
    if (s.memory[i]) mem[kMemoryKeys[i]] = s.memory[i]->values;
  }
  return {{"source", s.source},
          {"gemm", {{"dims", s.gemm.axes[0]}, {"efficiency", s.gemm.values}}},
          {"attention", std::move(att)},
          {"memory", std::move(mem)},
          {"in_step", {{"gemm", s.in_step_gemm}, {"attention", s.in_step_attention}, {"memory", s.in_step_memory}}}};
}

}  // namespace ce_overlap
