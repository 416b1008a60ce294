// Loading, validating and saving hardware profiles (schema ce_overlap.profile/2, docs/profiles.md).
// Every field is required and checked, unknown keys are rejected: a typo must not become a default.
// The only optional parts have a stated meaning when absent (no per-pair overrides, no inter-node
// link, no calibrated curves).
#include "profile.h"

#include <map>
#include <string>
#include <utility>

#include "json_reader.h"

namespace ce_overlap {

namespace {

using nlohmann::json;
using namespace json_reader;

LinkSpec read_link(const ObjectReader& r) {
  LinkSpec l;
  l.kind = r.string("kind", true);
  l.gbps_per_direction = r.positive_number("gbps_per_direction");
  l.p2p = r.boolean("p2p");
  return l;
}

LinkSpec read_link(const ObjectReader& parent, const char* key) {
  return read_link(parent.object(key, {"kind", "gbps_per_direction", "p2p"}));
}

json link_to_json(const LinkSpec& l) {
  return json{{"kind", l.kind}, {"gbps_per_direction", l.gbps_per_direction}, {"p2p", l.p2p}};
}

std::string pair_text(int a, int b) { return "(" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

// The n x n matrix form: every off-diagonal entry present, symmetric, diagonal "X" / 0 / true.
std::vector<LinkSpec> read_matrix(const ObjectReader& topo, int n) {
  ObjectReader m = topo.object("matrix", {"kind", "gbps_per_direction", "p2p"});
  const char* what = "an array with one row per GPU of a node";
  const json& kinds = m.array("kind", what);
  const json& gbps = m.array("gbps_per_direction", what);
  const json& p2p = m.array("p2p", what);
  std::vector<LinkSpec> out(static_cast<size_t>(n) * n);
  // Entry (i, j) of one of the three arrays, with "missing pair" for short rows, short matrices and nulls.
  auto entry = [&](const json& rows, const char* key, int i, int j) -> const json& {
    const std::string row_path = index_path(m.child(key), i);
    const std::string path = index_path(row_path, j);
    if (static_cast<int>(rows.size()) > n) {
      throw IrError(m.child(key) + ": expected " + std::to_string(n) + " rows (topology.gpus_per_node), got " +
                    std::to_string(rows.size()));
    }
    if (i >= static_cast<int>(rows.size())) throw IrError(path + ": missing pair " + pair_text(i, j));
    const json& row = rows[i];
    if (!row.is_array()) throw IrError(row_path + ": expected an array with one entry per GPU, got " + describe(row));
    if (static_cast<int>(row.size()) > n) {
      throw IrError(row_path + ": expected " + std::to_string(n) + " entries (topology.gpus_per_node), got " +
                    std::to_string(row.size()));
    }
    if (j >= static_cast<int>(row.size()) || row[j].is_null()) {
      throw IrError(path + ": missing pair " + pair_text(i, j));
    }
    return row[j];
  };
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const std::string kp = index_path(index_path(m.child("kind"), i), j);
      const std::string gp = index_path(index_path(m.child("gbps_per_direction"), i), j);
      const std::string pp = index_path(index_path(m.child("p2p"), i), j);
      const json& k = entry(kinds, "kind", i, j);
      const json& g = entry(gbps, "gbps_per_direction", i, j);
      const json& p = entry(p2p, "p2p", i, j);
      if (i == j) {
        if (k != "X") throw IrError(kp + ": expected \"X\" on the diagonal, got " + describe(k));
        if (!g.is_number() || g.get<double>() != 0) {
          throw IrError(gp + ": expected 0 on the diagonal, got " + describe(g));
        }
        if (p != true) throw IrError(pp + ": expected true on the diagonal, got " + describe(p));
        continue;
      }
      LinkSpec& l = out[static_cast<size_t>(i) * n + j];
      if (!k.is_string() || k.get_ref<const std::string&>().empty() || k == "X") {
        throw IrError(kp + ": expected a link kind (a non-empty string other than \"X\"), got " + describe(k));
      }
      l.kind = k.get<std::string>();
      l.gbps_per_direction = positive_value(g, gp);
      if (!p.is_boolean()) throw IrError(pp + ": expected a boolean, got " + describe(p));
      l.p2p = p.get<bool>();
      if (j < i) {  // the mirror entry was read already
        const LinkSpec& mirror = out[static_cast<size_t>(j) * n + i];
        const std::string at = "[" + std::to_string(j) + "][" + std::to_string(i) + "]";
        if (l.kind != mirror.kind) {
          throw IrError(kp + ": \"" + l.kind + "\" differs from " + at + " = \"" + mirror.kind +
                        "\" (links are symmetric)");
        }
        if (l.gbps_per_direction != mirror.gbps_per_direction) {
          throw IrError(gp + ": " + num(l.gbps_per_direction) + " differs from " + at + " = " +
                        num(mirror.gbps_per_direction) + " (links are symmetric: the same GB/s each way)");
        }
        if (l.p2p != mirror.p2p) {
          throw IrError(pp + ": " + std::string(l.p2p ? "true" : "false") + " differs from " + at +
                        " (P2P must hold both ways)");
        }
      }
    }
  }
  return out;
}

json matrix_to_json(const std::vector<LinkSpec>& m, int n) {
  json kinds = json::array(), gbps = json::array(), p2p = json::array();
  for (int i = 0; i < n; ++i) {
    json kr = json::array(), gr = json::array(), pr = json::array();
    for (int j = 0; j < n; ++j) {
      if (i == j) {
        kr.push_back("X");
        gr.push_back(0);
        pr.push_back(true);
        continue;
      }
      const LinkSpec& l = m[static_cast<size_t>(i) * n + j];
      kr.push_back(l.kind);
      gr.push_back(l.gbps_per_direction);
      pr.push_back(l.p2p);
    }
    kinds.push_back(std::move(kr));
    gbps.push_back(std::move(gr));
    p2p.push_back(std::move(pr));
  }
  return json{{"kind", kinds}, {"gbps_per_direction", gbps}, {"p2p", p2p}};
}

TopologySpec read_topology(const json& j, const std::string& path) {
  ObjectReader topo(j, path,
                    {"gpus_per_node", "numa_node", "intra_node", "pairs", "matrix", "inter_node", "rails"});
  TopologySpec t;
  t.gpus_per_node = topo.positive_int("gpus_per_node");
  if (t.gpus_per_node > kMaxGpusPerNode) {
    throw IrError(topo.child("gpus_per_node") + ": expected at most " + std::to_string(kMaxGpusPerNode) + ", got " +
                  std::to_string(t.gpus_per_node));
  }
  const int n = t.gpus_per_node;

  const json& numa = topo.array("numa_node", "an array with the NUMA node of each GPU of a node");
  if (static_cast<int>(numa.size()) != n) {
    throw IrError(topo.child("numa_node") + ": expected " + std::to_string(n) +
                  " entries (one per GPU of a node, topology.gpus_per_node), got " + std::to_string(numa.size()));
  }
  for (size_t i = 0; i < numa.size(); ++i) {
    t.numa_node.push_back(non_negative_int_value(numa[i], index_path(topo.child("numa_node"), i)));
  }

  const bool has_intra = topo.has("intra_node");
  const bool has_matrix = topo.has("matrix");
  if (has_intra && has_matrix) {
    throw IrError(topo.child("matrix") + ": not allowed together with " + topo.child("intra_node") +
                  " (give a default link with optional pairs, or every pair in the matrix)");
  }
  if (!has_intra && !has_matrix) {
    throw IrError(topo.child("intra_node") + ": missing (expected a default link for pairs in a node, or " +
                  topo.child("matrix") + " with every pair)");
  }
  if (has_matrix) {
    if (topo.has("pairs")) {
      throw IrError(topo.child("pairs") + ": not allowed with " + topo.child("matrix") +
                    " (the matrix lists every pair already)");
    }
    t.matrix = read_matrix(topo, n);
  } else {
    t.intra_node = read_link(topo, "intra_node");
  }

  if (topo.has("pairs")) {
    const json& pairs = topo.array("pairs", "an array of per-pair links");
    std::map<std::pair<int, int>, size_t> seen;
    for (size_t i = 0; i < pairs.size(); ++i) {
      const std::string p = index_path(topo.child("pairs"), i);
      ObjectReader r(pairs[i], p, {"gpus", "kind", "gbps_per_direction", "p2p"});
      const json& gpus = r.field("gpus", "two local GPU indices");
      if (!gpus.is_array() || gpus.size() != 2) {
        throw IrError(r.child("gpus") + ": expected two local GPU indices, got " + describe(gpus));
      }
      int ab[2];
      for (size_t k = 0; k < 2; ++k) {
        const std::string gp = index_path(r.child("gpus"), k);
        ab[k] = non_negative_int_value(gpus[k], gp);
        if (ab[k] >= n) {
          throw IrError(gp + ": expected a local GPU index below topology.gpus_per_node = " + std::to_string(n) +
                        ", got " + std::to_string(ab[k]));
        }
      }
      if (ab[0] == ab[1]) throw IrError(r.child("gpus") + ": expected two different GPUs, got " + describe(gpus));
      PairLink pl;
      pl.a = std::min(ab[0], ab[1]);
      pl.b = std::max(ab[0], ab[1]);
      auto [it, inserted] = seen.emplace(std::make_pair(pl.a, pl.b), i);
      if (!inserted) {
        throw IrError(r.child("gpus") + ": pair " + pair_text(pl.a, pl.b) + " listed twice (also at " +
                      index_path(topo.child("pairs"), it->second) + ")");
      }
      pl.link = read_link(r);
      t.pairs.push_back(std::move(pl));
    }
  }
  if (topo.has("inter_node")) t.inter_node = read_link(topo, "inter_node");
  if (topo.has("rails")) {
    t.rails = topo.positive_int("rails");
    if (!t.inter_node) throw IrError(topo.child("rails") + ": given without " + topo.child("inter_node"));
    if (t.rails > n) {
      throw IrError(topo.child("rails") + ": expected at most topology.gpus_per_node = " + std::to_string(n) +
                    " NICs per node (one per rail), got " + std::to_string(t.rails));
    }
  }
  return t;
}

std::string collective_name_at(const json& v, const std::string& path) {
  if (!v.is_string()) throw IrError(path + ": expected a collective type name, got " + describe(v));
  try {
    collective_type_from_string(v.get<std::string>());
  } catch (const IrError& e) {
    throw IrError(path + ": " + e.what());
  }
  return v.get<std::string>();
}

// The "group_size" of a per-group-size entry (a curve, an NCCL scale): an integer >= 2.
int group_size_at(const ObjectReader& r) {
  const int n = r.positive_int("group_size");
  if (n < 2) throw IrError(r.child("group_size") + ": expected at least 2 (a group of 1 moves nothing), got 1");
  return n;
}

std::vector<NcclScale> read_nccl_scales(const ObjectReader& nccl) {
  std::vector<NcclScale> out;
  const json& entries = nccl.array("bus_efficiency_scale", "an array of {collective, group_size, scale}");
  const std::string where = nccl.child("bus_efficiency_scale");
  std::map<std::pair<CollectiveType, int>, size_t> seen;
  for (size_t i = 0; i < entries.size(); ++i) {
    ObjectReader r(entries[i], index_path(where, i), {"collective", "group_size", "scale"});
    NcclScale e;
    e.collective = collective_type_from_string(collective_name_at(r.field("collective", "a collective type"),
                                                                  r.child("collective")));
    e.group_size = group_size_at(r);
    e.scale = r.positive_number("scale");
    auto [it, inserted] = seen.emplace(std::make_pair(e.collective, e.group_size), i);
    if (!inserted) {
      throw IrError(index_path(where, i) + ": a second scale for " + std::string(to_string(e.collective)) + " with " +
                    std::to_string(e.group_size) + " ranks (also at " + index_path(where, it->second) + ")");
    }
    out.push_back(e);
  }
  return out;
}

std::vector<Curve> read_curves(const ObjectReader& root) {
  std::vector<Curve> out;
  const json& curves = root.array("curves", "an array of calibrated curves");
  std::map<std::tuple<CollectiveType, Backend, int>, size_t> seen;
  for (size_t i = 0; i < curves.size(); ++i) {
    const std::string p = index_path("curves", i);
    ObjectReader r(curves[i], p, {"collective", "backend", "group_size", "points"});
    Curve c;
    c.collective = collective_type_from_string(collective_name_at(r.field("collective", "a collective type"),
                                                                  r.child("collective")));
    const std::string backend = r.string("backend", true);
    try {
      c.backend = backend_from_string(backend);
    } catch (const IrError& e) {
      throw IrError(r.child("backend") + ": " + e.what());
    }
    if (c.backend == Backend::Hier) {  // priced from its halves: their curves
      throw IrError(r.child("backend") + ": a curve is measured for \"nccl\" or \"ce\"; \"hier\" is priced from "
                    "those (its NCCL half over the nodes, its copy-engine half inside each)");
    }
    c.group_size = group_size_at(r);
    auto [it, inserted] = seen.emplace(std::make_tuple(c.collective, c.backend, c.group_size), i);
    if (!inserted) {
      throw IrError(p + ": a second curve for " + std::string(to_string(c.collective)) + " on " + backend + " with " +
                    std::to_string(c.group_size) + " ranks (also at " + index_path("curves", it->second) + ")");
    }
    const json& points = r.array("points", "an array of [bytes, us] pairs");
    if (points.size() < 2) {
      throw IrError(r.child("points") + ": expected at least 2 [bytes, us] points, got " +
                    std::to_string(points.size()));
    }
    for (size_t k = 0; k < points.size(); ++k) {
      const std::string pp = index_path(r.child("points"), k);
      if (!points[k].is_array() || points[k].size() != 2) {
        throw IrError(pp + ": expected [bytes, us], got " + describe(points[k]));
      }
      CurvePoint pt;
      pt.bytes = positive_value(points[k][0], pp + "[0]");
      pt.us = positive_value(points[k][1], pp + "[1]");
      if (!c.points.empty()) {
        if (pt.bytes <= c.points.back().bytes) {
          throw IrError(pp + "[0]: bytes must increase from point to point, got " + num(pt.bytes) + " after " +
                        num(c.points.back().bytes));
        }
        if (pt.us < c.points.back().us) {
          throw IrError(pp + "[1]: time must not decrease with bytes, got " + num(pt.us) + " us after " +
                        num(c.points.back().us) + " us");
        }
      }
      c.points.push_back(pt);
    }
    out.push_back(std::move(c));
  }
  return out;
}

KernelSensitivity read_kernel_sensitivity(const ObjectReader& parent, const char* key) {
  ObjectReader r = parent.object(key, {"sm_sensitivity", "hbm_sensitivity"});
  return {r.non_negative_number("sm_sensitivity"), r.non_negative_number("hbm_sensitivity")};
}

CollectiveSensitivity read_collective_sensitivity(const ObjectReader& parent, const char* key) {
  ObjectReader r = parent.object(key, {"compute_bound", "memory_bound", "residency_us"});
  return {r.non_negative_number("compute_bound"), r.non_negative_number("memory_bound"),
          r.has("residency_us") ? r.non_negative_number("residency_us") : 0.0};
}

// SMs a collective takes must leave some for the kernels beside it.
void check_below_sms(int sms_taken, const std::string& path, const GpuSpec& gpu) {
  if (sms_taken >= gpu.sms) {
    throw IrError(path + ": expected fewer than gpu.sms = " + std::to_string(gpu.sms) + ", got " +
                  std::to_string(sms_taken));
  }
}

}  // namespace

const LinkSpec& TopologySpec::link(int a, int b) const {
  if (!matrix.empty()) return matrix[static_cast<size_t>(a) * gpus_per_node + b];
  const int lo = std::min(a, b), hi = std::max(a, b);
  for (const PairLink& p : pairs) {
    if (p.a == lo && p.b == hi) return p.link;
  }
  return *intra_node;
}

const char* to_string(Backend b) {
  switch (b) {
    case Backend::Nccl: return "nccl";
    case Backend::Ce: return "ce";
    case Backend::Hier: return "hier";
  }
  throw IrError("invalid Backend value " + std::to_string(static_cast<int>(b)));
}

double NcclSpec::scale(CollectiveType collective, int group_size) const {
  const NcclScale* below = nullptr;  // the largest listed size <= group_size
  const NcclScale* above = nullptr;  // the smallest listed size >= group_size
  for (const NcclScale& e : bus_efficiency_scale) {
    if (e.collective != collective) continue;
    if (e.group_size <= group_size && (!below || e.group_size > below->group_size)) below = &e;
    if (e.group_size >= group_size && (!above || e.group_size < above->group_size)) above = &e;
  }
  if (!below && !above) return 1.0;
  if (!below) return above->scale;
  if (!above || above == below) return below->scale;
  const double t = static_cast<double>(group_size - below->group_size) / (above->group_size - below->group_size);
  return below->scale + t * (above->scale - below->scale);
}

Backend backend_from_string(const std::string& s) {
  if (s == "nccl") return Backend::Nccl;
  if (s == "ce") return Backend::Ce;
  if (s == "hier") return Backend::Hier;
  throw IrError("unknown backend \"" + s + "\" (accepted: nccl, ce, hier)");
}

TopologySpec topology_from_json(const json& j, const std::string& path) { return read_topology(j, path); }

json topology_to_json(const TopologySpec& t) {
  json j = {{"gpus_per_node", t.gpus_per_node}, {"numa_node", t.numa_node}};
  if (t.intra_node) j["intra_node"] = link_to_json(*t.intra_node);
  if (!t.pairs.empty()) {
    json pairs = json::array();
    for (const PairLink& p : t.pairs) {
      json e = link_to_json(p.link);
      e["gpus"] = {p.a, p.b};
      pairs.push_back(std::move(e));
    }
    j["pairs"] = std::move(pairs);
  }
  if (!t.matrix.empty()) j["matrix"] = matrix_to_json(t.matrix, t.gpus_per_node);
  if (t.inter_node) j["inter_node"] = link_to_json(*t.inter_node);
  if (t.rails != 1) j["rails"] = t.rails;
  return j;
}

Profile profile_from_json(const json& j) {
  ObjectReader root(j, "", {"schema", "name", "description", "gpu", "topology", "efficiency", "nccl", "ce",
                            "contention", "curves", "shapes", "host"});
  const json& schema = root.field("schema", "\"ce_overlap.profile/2\"");
  if (!schema.is_string() || schema.get_ref<const std::string&>() != kProfileSchema) {
    std::string msg = "schema: expected \"" + std::string(kProfileSchema) + "\", got " + describe(schema);
    if (schema == "ce_overlap.profile/1") {
      msg += " (profile/2 adds topology.numa_node, nccl protocols and channels, ce and contention: see "
             "docs/profiles.md)";
    }
    throw IrError(msg);
  }

  Profile p;
  p.name = root.string("name", true);
  p.description = root.string("description", false);

  ObjectReader gpu = root.object(
      "gpu", {"name", "sms", "peak_bf16_tflops", "peak_fp32_tflops", "hbm_gbps", "copy_engines", "memory_gib"});
  p.gpu.name = gpu.string("name", true);
  p.gpu.sms = gpu.positive_int("sms");
  p.gpu.peak_bf16_tflops = gpu.positive_number("peak_bf16_tflops");
  p.gpu.peak_fp32_tflops = gpu.positive_number("peak_fp32_tflops");
  p.gpu.hbm_gbps = gpu.positive_number("hbm_gbps");
  p.gpu.copy_engines = gpu.positive_int("copy_engines");
  p.gpu.memory_gib = gpu.positive_number("memory_gib");

  p.topology = read_topology(root.field("topology", "an object"), "topology");

  ObjectReader eff = root.object("efficiency", {"gemm", "gemm_ramp_flops", "memory", "kernel_launch_us", "attention",
                                                "attention_backward", "optimizer", "kernel_gap_us",
                                                "fused_memory", "flex_attention", "flex_attention_backward"});
  p.efficiency.gemm = eff.fraction("gemm");
  p.efficiency.gemm_ramp_flops = eff.non_negative_number("gemm_ramp_flops");
  p.efficiency.memory = eff.fraction("memory");
  p.efficiency.kernel_launch_us = eff.non_negative_number("kernel_launch_us");
  if (eff.has("attention")) p.efficiency.attention = eff.fraction("attention");
  if (eff.has("attention_backward")) p.efficiency.attention_backward = eff.fraction("attention_backward");
  if (eff.has("optimizer")) p.efficiency.optimizer = eff.fraction("optimizer");
  if (eff.has("kernel_gap_us")) p.efficiency.kernel_gap_us = eff.non_negative_number("kernel_gap_us");
  if (eff.has("fused_memory")) p.efficiency.fused_memory = eff.fraction("fused_memory");
  if (eff.has("flex_attention")) p.efficiency.flex_attention = eff.fraction("flex_attention");
  if (eff.has("flex_attention_backward")) {
    p.efficiency.flex_attention_backward = eff.fraction("flex_attention_backward");
  }

  ObjectReader nccl = root.object("nccl", {"channels", "protocols", "reduction_bandwidth_factor",
                                           "inter_node_step_latency_us", "inter_node_bus_efficiency",
                                           "bus_efficiency_scale"});
  p.nccl.channels = nccl.positive_int("channels");
  check_below_sms(p.nccl.channels, nccl.child("channels"), p.gpu);
  const json& protocols = nccl.array("protocols", "a non-empty array of protocol lines");
  if (protocols.empty()) throw IrError(nccl.child("protocols") + ": expected at least one protocol line, got []");
  for (size_t i = 0; i < protocols.size(); ++i) {
    ObjectReader r(protocols[i], index_path(nccl.child("protocols"), i),
                   {"name", "base_latency_us", "per_step_latency_us", "bus_efficiency"});
    NcclProtocol proto;
    proto.name = r.string("name", true);
    for (const NcclProtocol& q : p.nccl.protocols) {
      if (q.name == proto.name) throw IrError(r.child("name") + ": \"" + proto.name + "\" listed twice");
    }
    proto.base_latency_us = r.non_negative_number("base_latency_us");
    proto.per_step_latency_us = r.non_negative_number("per_step_latency_us");
    proto.bus_efficiency = r.fraction("bus_efficiency");
    p.nccl.protocols.push_back(std::move(proto));
  }
  p.nccl.reduction_bandwidth_factor = nccl.fraction("reduction_bandwidth_factor");
  p.nccl.inter_node_step_latency_us = nccl.non_negative_number("inter_node_step_latency_us");
  p.nccl.inter_node_bus_efficiency = nccl.fraction("inter_node_bus_efficiency");
  if (nccl.has("bus_efficiency_scale")) p.nccl.bus_efficiency_scale = read_nccl_scales(nccl);

  ObjectReader ce = root.object("ce", {"copy_latency_us", "signal_latency_us", "one_way_efficiency",
                                       "bidirectional_efficiency", "engine_gbps", "reduce_sms",
                                       "reduce_gbps_per_sm"});
  p.ce.copy_latency_us = ce.non_negative_number("copy_latency_us");
  p.ce.signal_latency_us = ce.non_negative_number("signal_latency_us");
  p.ce.one_way_efficiency = ce.fraction("one_way_efficiency");
  p.ce.bidirectional_efficiency = ce.fraction("bidirectional_efficiency");
  p.ce.engine_gbps = ce.positive_number("engine_gbps");
  p.ce.reduce_sms = ce.positive_int("reduce_sms");
  check_below_sms(p.ce.reduce_sms, ce.child("reduce_sms"), p.gpu);
  p.ce.reduce_gbps_per_sm = ce.positive_number("reduce_gbps_per_sm");

  ObjectReader con = root.object("contention", {"compute_bound", "memory_bound", "nccl_beside_compute",
                                                "ce_beside_compute", "ce_reduction", "ce_copies"});
  p.contention.compute_bound = read_kernel_sensitivity(con, "compute_bound");
  p.contention.memory_bound = read_kernel_sensitivity(con, "memory_bound");
  p.contention.nccl_beside_compute = read_collective_sensitivity(con, "nccl_beside_compute");
  p.contention.ce_beside_compute = read_collective_sensitivity(con, "ce_beside_compute");
  for (auto [key, out] : {std::pair{"ce_reduction", &p.contention.ce_reduction},
                           std::pair{"ce_copies", &p.contention.ce_copies}}) {
    if (!con.has(key)) continue;
    ObjectReader r = con.object(key, {"compute_bound", "memory_bound"});
    *out = KernelClassSlowdown{r.non_negative_number("compute_bound"), r.non_negative_number("memory_bound")};
  }

  if (root.has("curves")) p.curves = read_curves(root);
  if (root.has("shapes")) p.shapes = shapes_from_json(root.field("shapes", "an object"), "shapes");
  if (root.has("host")) {
    ObjectReader h = root.object("host", {"launch_us", "graph_input_us", "collective_us", "step_us", "source"});
    HostSpec host;
    host.launch_us = h.non_negative_number("launch_us");
    host.graph_input_us = h.non_negative_number("graph_input_us");
    host.collective_us = h.non_negative_number("collective_us");
    host.step_us = h.non_negative_number("step_us");
    if (h.has("source")) host.source = h.string("source", false);
    p.host = std::move(host);
  }
  return p;
}

Profile load_profile(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers beyond a double
    std::string message = e.what();
    const auto tag_end = message.find("] ");
    if (message.rfind("[json.exception.", 0) == 0 && tag_end != std::string::npos) message.erase(0, tag_end + 2);
    throw IrError("malformed JSON: " + message);
  }
  return profile_from_json(j);
}

namespace {

json efficiency_to_json(const EfficiencySpec& e) {
  json j = {{"gemm", e.gemm},
            {"gemm_ramp_flops", e.gemm_ramp_flops},
            {"memory", e.memory},
            {"kernel_launch_us", e.kernel_launch_us}};
  if (e.attention > 0) j["attention"] = e.attention;  // optional ones only when given: absent means "the default"
  if (e.attention_backward > 0) j["attention_backward"] = e.attention_backward;
  if (e.optimizer > 0) j["optimizer"] = e.optimizer;
  if (e.kernel_gap_us > 0) j["kernel_gap_us"] = e.kernel_gap_us;
  if (e.fused_memory > 0) j["fused_memory"] = e.fused_memory;
  if (e.flex_attention > 0) j["flex_attention"] = e.flex_attention;
  if (e.flex_attention_backward > 0) j["flex_attention_backward"] = e.flex_attention_backward;
  return j;
}

}  // namespace

json profile_to_json(const Profile& p) {
  json protocols = json::array();
  for (const NcclProtocol& q : p.nccl.protocols) {
    protocols.push_back({{"name", q.name},
                         {"base_latency_us", q.base_latency_us},
                         {"per_step_latency_us", q.per_step_latency_us},
                         {"bus_efficiency", q.bus_efficiency}});
  }
  auto kernel = [](const KernelSensitivity& k) {
    return json{{"sm_sensitivity", k.sm_sensitivity}, {"hbm_sensitivity", k.hbm_sensitivity}};
  };
  auto coll = [](const CollectiveSensitivity& c) {
    json out{{"compute_bound", c.compute_bound}, {"memory_bound", c.memory_bound}};
    if (c.residency_us > 0) out["residency_us"] = c.residency_us;
    return out;
  };
  json j = {
      {"schema", kProfileSchema},
      {"name", p.name},
      {"description", p.description},
      {"gpu",
       {{"name", p.gpu.name},
        {"sms", p.gpu.sms},
        {"peak_bf16_tflops", p.gpu.peak_bf16_tflops},
        {"peak_fp32_tflops", p.gpu.peak_fp32_tflops},
        {"hbm_gbps", p.gpu.hbm_gbps},
        {"copy_engines", p.gpu.copy_engines},
        {"memory_gib", p.gpu.memory_gib}}},
      {"topology", topology_to_json(p.topology)},
      {"efficiency", efficiency_to_json(p.efficiency)},
      {"nccl",
       {{"channels", p.nccl.channels},
        {"protocols", protocols},
        {"reduction_bandwidth_factor", p.nccl.reduction_bandwidth_factor},
        {"inter_node_step_latency_us", p.nccl.inter_node_step_latency_us},
        {"inter_node_bus_efficiency", p.nccl.inter_node_bus_efficiency}}},
      {"ce",
       {{"copy_latency_us", p.ce.copy_latency_us},
        {"signal_latency_us", p.ce.signal_latency_us},
        {"one_way_efficiency", p.ce.one_way_efficiency},
        {"bidirectional_efficiency", p.ce.bidirectional_efficiency},
        {"engine_gbps", p.ce.engine_gbps},
        {"reduce_sms", p.ce.reduce_sms},
        {"reduce_gbps_per_sm", p.ce.reduce_gbps_per_sm}}},
      {"contention",
       {{"compute_bound", kernel(p.contention.compute_bound)},
        {"memory_bound", kernel(p.contention.memory_bound)},
        {"nccl_beside_compute", coll(p.contention.nccl_beside_compute)},
        {"ce_beside_compute", coll(p.contention.ce_beside_compute)}}},
  };
  for (auto [key, r] : {std::pair{"ce_reduction", &p.contention.ce_reduction},
                         std::pair{"ce_copies", &p.contention.ce_copies}}) {
    if (*r) j["contention"][key] = {{"compute_bound", (*r)->compute_bound}, {"memory_bound", (*r)->memory_bound}};
  }
  if (!p.nccl.bus_efficiency_scale.empty()) {
    json scales = json::array();
    for (const NcclScale& e : p.nccl.bus_efficiency_scale) {
      scales.push_back({{"collective", to_string(e.collective)}, {"group_size", e.group_size}, {"scale", e.scale}});
    }
    j["nccl"]["bus_efficiency_scale"] = std::move(scales);
  }
  if (!p.curves.empty()) {
    json curves = json::array();
    for (const Curve& c : p.curves) {
      json points = json::array();
      for (const CurvePoint& pt : c.points) points.push_back({pt.bytes, pt.us});
      curves.push_back({{"collective", to_string(c.collective)},
                        {"backend", to_string(c.backend)},
                        {"group_size", c.group_size},
                        {"points", points}});
    }
    j["curves"] = std::move(curves);
  }
  if (p.shapes) j["shapes"] = shapes_to_json(*p.shapes);
  if (p.host) {
    j["host"] = {{"launch_us", p.host->launch_us},
                 {"graph_input_us", p.host->graph_input_us},
                 {"collective_us", p.host->collective_us},
                 {"step_us", p.host->step_us}};
    if (!p.host->source.empty()) j["host"]["source"] = p.host->source;
  }
  return j;
}

}  // namespace ce_overlap
