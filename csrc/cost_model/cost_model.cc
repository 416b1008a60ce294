// The cost model (docs/cost_model.md): a roofline with a GEMM efficiency ramp for compute, NCCL's own
// line-per-protocol model for ring/tree collectives, per-peer copies for the copy engines, SM and HBM
// contention kept apart, and the NCCL/CE decision. GB/s = 1e9 bytes/s, so bytes / (gbps * 1e3) is us.
#include "cost_model.h"

#include "ce_algorithms.h"

#include "../graph/analysis.h"
#include "../graph/saturating.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>

namespace ce_overlap {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Traffic is never charged more than this share of the achievable HBM bandwidth: the sharing
// formula R / (H - R) would diverge at R = H.
constexpr double kMaxHbmShare = 0.9;
// The CE reduce-scatter's round: at most this many bytes of every chunk, and one staging bank's slot for each of
// the n - 1 senders (the runtime's defaults: RuntimeConfig.rs_round_mb = 64, a 256 MiB staging region in 2 banks;
// docs/runtime.md).
constexpr double kCeReduceRoundBytes = 64.0 * 1024 * 1024;
constexpr double kCeStagingBankBytes = 128.0 * 1024 * 1024;

// Time the CE reduction kernel runs in an estimate (the phases that hold it).
double reduction_us(const CollectiveEstimate& e) {
  double us = 0;
  for (const CollectivePhase& ph : e.phases) us += ph.reduction ? ph.us : 0.0;
  return us;
}

double us_for(double bytes, double gbps) { return bytes / (gbps * 1e3); }

bool reduces(CollectiveType t) { return t == CollectiveType::ReduceScatter || t == CollectiveType::AllReduce; }

// Ring algorithm: bytes each rank moves over its link, and the number of sequential steps.
struct RingShape {
  double bus_bytes = 0;
  int steps = 0;
};

RingShape ring_shape(const CollectiveInfo& c) {
  const double n = c.group_size;
  const double bytes = static_cast<double>(c.bytes);
  const int hops = c.group_size - 1;
  switch (c.type) {
    case CollectiveType::AllGather:  // bytes is this rank's shard; it receives every other shard
      return {hops * bytes, hops};
    case CollectiveType::ReduceScatter:  // bytes is the full input; each step moves one 1/n chunk
      return {hops / n * bytes, hops};
    case CollectiveType::AllReduce:  // reduce-scatter then all-gather
      return {2.0 * hops / n * bytes, 2 * hops};
    case CollectiveType::AllToAll:
      return {hops / n * bytes, hops};
    case CollectiveType::Broadcast:  // pipelined along the ring: every byte crosses each link once
      return {bytes, hops};
    case CollectiveType::Send:
    case CollectiveType::Recv:
      return {bytes, 1};
  }
  return {bytes, 1};
}

// HBM bytes per bus byte on one GPU: copies read what they send and write what they receive;
// reductions also read the local operand.
double nccl_hbm_per_bus_byte(CollectiveType t) {
  switch (t) {
    case CollectiveType::ReduceScatter:
      return 3.0;
    case CollectiveType::AllReduce:
      return 2.5;
    case CollectiveType::Send:
    case CollectiveType::Recv:
      return 1.0;
    default:
      return 2.0;
  }
}

std::string fixed(const char* fmt, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

std::string format_us(double us) { return us >= 100 ? fixed("%.2f ms", us / 1000) : fixed("%.1f us", us); }
std::string format_pct(double fraction) { return fixed("%.0f%%", 100 * fraction); }

bool starts_with_nvlink(const std::string& kind) {
  std::string k = kind.substr(0, 6);
  std::transform(k.begin(), k.end(), k.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return k == "nvlink";
}

// Time at `bytes` on a calibrated curve: a power law between neighbouring points (linear in
// log-log space, exact for purely latency- or bandwidth-bound segments), the first point's time
// below the table, and the last segment's marginal rate above it.
double curve_us(const Curve& curve, double bytes) {
  const std::vector<CurvePoint>& p = curve.points;
  if (bytes <= p.front().bytes) return p.front().us;
  for (size_t i = 1; i < p.size(); ++i) {
    if (bytes <= p[i].bytes) {
      const double f = std::log(bytes / p[i - 1].bytes) / std::log(p[i].bytes / p[i - 1].bytes);
      return p[i - 1].us * std::pow(p[i].us / p[i - 1].us, f);
    }
  }
  const CurvePoint& a = p[p.size() - 2];
  const CurvePoint& b = p.back();
  return b.us + (bytes - b.bytes) * (b.us - a.us) / (b.bytes - a.bytes);
}

}  // namespace

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  std::string s = fixed(u == 0 || bytes >= 100 ? "%.0f" : "%.1f", bytes);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  return s + " " + units[u];
}

CostModel::CostModel(Profile profile) : profile_(std::move(profile)) {
  // A profile built in memory gets the loader's checks too: a zero bandwidth must fail here, not
  // turn every estimate into infinity later.
  profile_from_json(profile_to_json(profile_));
  const TopologySpec& t = profile_.topology;
  ring_prefix_gbps_.assign(static_cast<size_t>(t.gpus_per_node), kInf);
  for (int k = 1; k < t.gpus_per_node; ++k) {
    ring_prefix_gbps_[k] = std::min(ring_prefix_gbps_[k - 1], t.link(k - 1, k).gbps_per_direction);
  }
}

// ---------------------------------------------------------------------------------------------
// Placement: a group of n ranks occupies GPUs 0..n-1, filling node 0 first.

CostModel::Placement CostModel::place(int group_size, int nodes) const {
  const TopologySpec& t = profile_.topology;
  const int g = t.gpus_per_node;
  Placement p;
  p.nodes = nodes > 0 ? nodes : (group_size + g - 1) / g;
  if (p.nodes == 1) {
    if (group_size > g) {
      throw IrError("a group of " + std::to_string(group_size) + " ranks on one node of " + std::to_string(g) +
                    " GPUs");
    }
    p.ring_gbps = std::min(ring_prefix_gbps_[group_size - 1], t.link(group_size - 1, 0).gbps_per_direction);
    return p;
  }
  if (!t.inter_node) {
    throw IrError("a group of " + std::to_string(group_size) + " ranks spans " + std::to_string(p.nodes) +
                  " nodes of " + std::to_string(g) + " GPUs, but the profile has no topology.inter_node link");
  }
  // The ring runs through each node's ranks of the group (as many as the group puts there) and leaves every node over
  // the inter-node link.
  const int per_node = std::min(g, (group_size + p.nodes - 1) / p.nodes);
  p.ring_gbps = ring_prefix_gbps_[per_node - 1];
  return p;
}

std::optional<std::string> CostModel::ce_blocker(int group_size, int on_nodes) const {
  if (group_size <= 1) return std::nullopt;
  const TopologySpec& t = profile_.topology;
  const int g = t.gpus_per_node;
  const int nodes = on_nodes > 0 ? on_nodes : (group_size + g - 1) / g;
  if (nodes > 1) {
    const bool nvlink = g >= 2 && starts_with_nvlink(t.link(0, 1).kind);
    return "group spans " + std::to_string(nodes) + " nodes; CE needs one " + (nvlink ? "NVLink" : "P2P") + " domain";
  }
  for (int i = 0; i < group_size; ++i) {
    for (int j = i + 1; j < group_size; ++j) {
      const LinkSpec& l = t.link(i, j);
      if (l.p2p) continue;
      std::string why = "no P2P between ranks " + std::to_string(i) + " and " + std::to_string(j) + " (" + l.kind +
                        " link";
      if (t.numa_node[i] != t.numa_node[j]) {
        why += ", NUMA nodes " + std::to_string(t.numa_node[i]) + " and " + std::to_string(t.numa_node[j]);
      }
      return why + ")";
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// NCCL: for each protocol line, ring (and, across nodes, tree for all-reduce); NCCL runs the fastest.

CollectiveEstimate CostModel::nccl_estimate(const CollectiveInfo& c) const {
  CollectiveEstimate e;
  e.backend = Backend::Nccl;
  e.algorithm = "none";
  if (c.group_size <= 1) return e;  // nothing to exchange
  const NcclSpec& nccl = profile_.nccl;
  const Placement pl = place(c.group_size, c.nodes);
  const bool spans = pl.nodes > 1;
  const RingShape ring = ring_shape(c);
  const double red = reduces(c.type) ? nccl.reduction_bandwidth_factor : 1.0;
  // As in NCCL's tuner, only the steps that cross nodes pay the inter-node latency.
  const int inter_steps = !spans                                 ? 0
                          : c.type == CollectiveType::AllReduce ? 2 * (pl.nodes - 1)
                          : c.type == CollectiveType::Send || c.type == CollectiveType::Recv ? 1
                                                                 : pl.nodes - 1;
  const double extra_step_us = spans ? nccl.inter_node_step_latency_us : 0.0;

  // Measured per collective and group size inside a node (nccl.bus_efficiency_scale); a group across nodes scales
  // its in-node part (the inter-node cap below applies after).
  const double scale = nccl.scale(c.type, std::min(c.group_size, profile_.topology.gpus_per_node));
  // Across nodes the ring leaves each node once per channel, over the NICs of the group's ranks there (rail-optimized:
  // one per rank, at most `rails`): every bus byte crosses one of them, so those NICs together cap the bus rate.
  double inter_gbps = kInf;
  if (spans) {
    // The node with the fewest of the group's ranks: spread evenly (nodes given), else the last, partly filled one.
    const int g = profile_.topology.gpus_per_node;
    // A send or receive is one rank's: one NIC.
    const bool p2p = c.type == CollectiveType::Send || c.type == CollectiveType::Recv;
    const int fewest = p2p ? 1 : c.nodes > 0 ? c.group_size / pl.nodes : c.group_size - (pl.nodes - 1) * g;
    inter_gbps = std::min(std::max(1, fewest), profile_.topology.rails) *
                 profile_.topology.inter_node->gbps_per_direction * nccl.inter_node_bus_efficiency;
  }
  double best = kInf;
  for (const NcclProtocol& proto : nccl.protocols) {
    double gbps = pl.ring_gbps * std::min(1.0, proto.bus_efficiency * scale);
    if (spans) gbps = std::min(gbps, inter_gbps);
    gbps *= red;
    const double step_us = proto.per_step_latency_us + extra_step_us;  // one inter-node step
    const double ring_latency =
        proto.base_latency_us + ring.steps * proto.per_step_latency_us + inter_steps * extra_step_us;
    const double ring_us = ring_latency + us_for(ring.bus_bytes, gbps);
    if (ring_us < best) {
      best = ring_us;
      e.latency_us = ring_latency;
      e.algorithm = "ring/" + proto.name;
    }
    if (c.type == CollectiveType::AllReduce && spans) {
      // Tree: a chain inside each node, a binary tree across nodes, up then down; every byte goes up
      // and comes down, so 2 x bytes cross the bottleneck link (NCCL's tree bandwidth ratio 1/2).
      const int in_node = std::min(c.group_size, profile_.topology.gpus_per_node);
      const int depth = static_cast<int>(std::ceil(std::log2(static_cast<double>(pl.nodes))));
      const double tree_latency = proto.base_latency_us + 2.0 * (in_node - 1) * proto.per_step_latency_us +
                                  2.0 * depth * step_us;
      const double tree_us = tree_latency + us_for(2.0 * static_cast<double>(c.bytes), gbps);
      if (tree_us < best) {
        best = tree_us;
        e.latency_us = tree_latency;
        e.algorithm = "tree/" + proto.name;
      }
    }
  }
  e.us = best;
  e.phases.push_back({best, nccl.channels, nccl_hbm_per_bus_byte(c.type) * ring.bus_bytes});
  return e;
}

// ---------------------------------------------------------------------------------------------
// Copy engines: every rank pulls from its peers' mapped memory; a rank's copies share its engines
// (copy_engines at a time) and its link port (switched fabric: the fastest of its pairs).

CollectiveEstimate CostModel::ce_estimate(const CollectiveInfo& c) const {
  if (auto blocker = ce_blocker(c.group_size, c.nodes)) throw IrError("ce: " + *blocker);
  CollectiveEstimate e;
  e.backend = Backend::Ce;
  e.algorithm = "none";
  const int n = c.group_size;
  if (n <= 1) return e;
  const CeSpec& ce = profile_.ce;
  const TopologySpec& t = profile_.topology;
  const double bytes = static_cast<double>(c.bytes);

  // Slowest port and slowest pair in the group.
  double port_gbps = kInf, pair_gbps = kInf;
  for (int i = 0; i < n; ++i) {
    double port_i = 0;
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      const double g = t.link(i, j).gbps_per_direction;
      port_i = std::max(port_i, g);
      pair_gbps = std::min(pair_gbps, g);
    }
    port_gbps = std::min(port_gbps, port_i);
  }

  // n - 1 pulls of `chunk` bytes per rank, every rank at once (both directions of each link busy). A rank copies
  // from one peer after another on its comm stream (the runtime's peer lanes = 1: on 4x H200 every peer at once over
  // 3 engines ran at 200-230 GB/s against 330-380 one after another, bench/results/collectives-2026-11-27), so one
  // engine's rate and one copy latency per peer.
  auto pull_all = [&](double chunk) {
    const int copies = n - 1;
    const double eff = ce.bidirectional_efficiency;
    const double rank_gbps = std::min(port_gbps * eff, ce.engine_gbps);
    const double bw_us = std::max(us_for(copies * chunk, rank_gbps),
                                  us_for(chunk, std::min(pair_gbps * eff, ce.engine_gbps)));
    const double latency = ce.signal_latency_us + copies * ce.copy_latency_us;
    return std::make_pair(latency, CollectivePhase{latency + bw_us, 0, 2.0 * copies * chunk});
  };
  // Reduction of n chunks of `chunk` bytes (own + staged) into one, on reduce_sms SMs.
  auto reduce = [&](double chunk) {
    const double hbm = (n + 1) * chunk;
    const double gbps =
        std::min(profile_.gpu.hbm_gbps * profile_.efficiency.memory, ce.reduce_sms * ce.reduce_gbps_per_sm);
    const double latency = profile_.efficiency.kernel_launch_us;
    return std::make_pair(latency, CollectivePhase{latency + us_for(hbm, gbps), ce.reduce_sms, hbm});
  };
  // The n - 1 received chunks of `chunk` bytes copied out of the staging slots into the output rows by one copy
  // engine (the unreduced reduce-scatter): read and written in HBM, no SMs.
  auto copy_out = [&](double chunk) {
    const double moved = (n - 1) * chunk;
    const double gbps = std::min(ce.engine_gbps, profile_.gpu.hbm_gbps * profile_.efficiency.memory / 2);
    const double latency = (n - 1) * ce.copy_latency_us;
    return std::make_pair(latency, CollectivePhase{latency + us_for(moved, gbps), 0, 2 * moved});
  };
  auto add = [&](std::pair<double, CollectivePhase> part) {
    e.latency_us += part.first;
    e.us += part.second.us;
    e.phases.push_back(part.second);
  };

  switch (c.type) {
    case CollectiveType::AllGather:
      e.algorithm = "ce/pull";
      add(pull_all(bytes));
      break;
    case CollectiveType::AllToAll:
      e.algorithm = "ce/pull";
      add(pull_all(bytes / n));
      break;
    case CollectiveType::ReduceScatter: {
      // The runtime moves rounds of at most kCeReduceRoundBytes per chunk: a two-stage pipeline of R rounds, the
      // copies c of round k+1 beside the second stage d of round k (reduce stream): the reduction kernel, or, with
      // the sum in the consumer (n > 1), the copy-out of the n - 1 received slots by a copy engine, no SMs; the
      // consumer then reads the n - 1 peer chunks besides its own (consumer_us, not part of the collective).
      const bool consumer = ce_reduction_ == CeReduction::Consumer && n > 1;
      e.algorithm = consumer ? "ce/a2a, sum in the consumer" : "ce/a2a+reduce";
      const double chunk = bytes / n;
      const double round_bytes = std::min(kCeReduceRoundBytes, kCeStagingBankBytes / (n - 1));
      const double rounds = std::max(1.0, std::ceil(chunk / round_bytes));
      const auto [copy_latency, copy_all] = pull_all(chunk / rounds);
      const auto [second_latency, second] = consumer ? copy_out(chunk / rounds) : reduce(chunk / rounds);
      // Per round: a handshake with every peer (the runtime posts "bank free" and waits for the peers' before it
      // pushes, then posts and waits for "landed": one signal latency per round, measured ~17 us per extra round on
      // 2x H200 by bench/ce_probe.py (c)), the copies with their per-copy latency, and the second stage.
      const double c_us = copy_all.us, d_us = second.us;
      const double copy_rate = copy_all.hbm_bytes / c_us, second_rate = second.hbm_bytes / d_us;
      // Copies alone, copies beside the second stage, then the last second stage alone (R max(c, d) + min(c, d)).
      const double both_us = (rounds - 1) * std::min(c_us, d_us);
      const double copy_alone_us = c_us >= d_us ? rounds * c_us - both_us : c_us;
      const double second_alone_us = c_us >= d_us ? d_us : rounds * d_us - both_us;
      e.latency_us = copy_latency + second_latency;
      e.us = copy_alone_us + both_us + second_alone_us;
      e.phases.push_back(CollectivePhase{copy_alone_us, 0, copy_rate * copy_alone_us});
      if (both_us > 0) {
        e.phases.push_back(CollectivePhase{both_us, second.sms, (copy_rate + second_rate) * both_us, !consumer,
                                           consumer ? 0.0 : second_rate * both_us});
      }
      e.phases.push_back(CollectivePhase{second_alone_us, second.sms, second_rate * second_alone_us, !consumer,
                                         consumer ? 0.0 : second_rate * second_alone_us});
      if (consumer) e.consumer_us = us_for((n - 1) * chunk, profile_.gpu.hbm_gbps * profile_.efficiency.memory);
      break;
    }
    case CollectiveType::AllReduce:
      e.algorithm = "ce/a2a+reduce+pull";
      add(pull_all(bytes / n));
      add(reduce(bytes / n));
      add(pull_all(bytes / n));
      break;
    case CollectiveType::Broadcast: {
      const size_t segments = broadcast_segments(n, c.bytes, 0);
      if (segments == 0) {
        // Every peer pulls the root's buffer with its own engine; the root's port carries n - 1 copies.
        e.algorithm = "ce/pull";
        const double eff = ce.one_way_efficiency;
        const double bw_us = std::max(us_for((n - 1) * bytes, port_gbps * eff),
                                      us_for(bytes, std::min(pair_gbps * eff, ce.engine_gbps)));
        const double latency = ce.signal_latency_us + ce.copy_latency_us;
        add({latency, CollectivePhase{latency + bw_us, 0, (n - 1) * bytes}});
        break;
      }
      // Scatter + all-gather over K segments (all_to_all.cc): K + 1 rounds; the first moves a segment out of the
      // root's port, the middle ones a segment into each non-root (its piece from the root, the others' from them,
      // one peer after another), the last (n-2)/(n-1) of one; every round has a handshake and n - 1 peer steps.
      e.algorithm = "ce/scatter+all-gather x" + std::to_string(segments);
      const double K = static_cast<double>(segments);
      const double gbps = std::min(std::min(port_gbps, pair_gbps) * ce.bidirectional_efficiency, ce.engine_gbps);
      const double moved = (K + (n - 2.0) / (n - 1.0)) * bytes / K;
      const double latency = (K + 1) * (ce.signal_latency_us + (n - 1) * ce.copy_latency_us);
      add({latency, CollectivePhase{latency + us_for(moved, gbps), 0, 2.0 * moved}});
      break;
    }
    case CollectiveType::Send:
    case CollectiveType::Recv: {
      e.algorithm = "ce/copy";
      const double latency = ce.signal_latency_us + ce.copy_latency_us;
      const double gbps = std::min(t.link(0, 1).gbps_per_direction * ce.one_way_efficiency, ce.engine_gbps);
      const double bw_us = us_for(bytes, gbps);
      add({latency, CollectivePhase{latency + bw_us, 0, bytes}});
      break;
    }
  }
  return e;
}

// ---------------------------------------------------------------------------------------------
// Hierarchical (ce_overlap.runtime.hierarchical): a group of M nodes x p ranks. All-gather: the rail all-gather of
// the shard over M ranks (NCCL, one NIC each), then the node all-gather of the M shards on copy engines, then one
// copy into group-rank order on the compute stream. Reduce-scatter: that copy first, the node reduce-scatter on copy
// engines, then the rail reduce-scatter of M chunks (NCCL). The copies run on the compute stream (consumer_us).

std::optional<std::string> CostModel::hier_blocker(const CollectiveInfo& c) const {
  if (c.type != CollectiveType::AllGather && c.type != CollectiveType::ReduceScatter) {
    return std::string("hierarchical: only all-gathers and reduce-scatters, not ") + to_string(c.type);
  }
  const Placement pl = place(c.group_size, c.nodes);
  if (pl.nodes < 2) return std::string("hierarchical: the group is on one node");
  // Nodes not given: the group fills nodes in order (place), as many on each only when it fills them all.
  const bool even = c.nodes > 0 ? c.group_size % pl.nodes == 0 : c.group_size % profile_.topology.gpus_per_node == 0;
  if (!even) {
    return "hierarchical: " + std::to_string(c.group_size) + " ranks over " + std::to_string(pl.nodes) +
           " nodes are not as many on each";
  }
  const int per_node = c.group_size / pl.nodes;
  if (per_node < 2) return std::string("hierarchical: one rank per node (the rail is the group)");
  if (auto blocker = ce_blocker(per_node, 1)) return "hierarchical: inside a node, " + *blocker;
  return std::nullopt;
}

CollectiveEstimate CostModel::hier_estimate(const CollectiveInfo& c) const {
  if (auto blocker = hier_blocker(c)) throw IrError(*blocker);
  const int m = place(c.group_size, c.nodes).nodes, p = c.group_size / m;
  CollectiveInfo rail = c, node = c;
  rail.group_size = m;
  rail.nodes = m;
  node.group_size = p;
  node.nodes = 1;
  double permuted = 0;  // bytes the reordering copy reads (and writes)
  if (c.type == CollectiveType::AllGather) {
    rail.bytes = c.bytes;                          // the shard, over the rail
    node.bytes = sat_mul(c.bytes, m);              // the rail's M shards, inside the node
    permuted = static_cast<double>(c.bytes) * c.group_size;
  } else {
    node.bytes = c.bytes;                          // the full input, inside the node: M chunks per rank out
    rail.bytes = c.bytes / p;                      // those M chunks, over the rail
    permuted = static_cast<double>(c.bytes);
  }
  const CollectiveEstimate across = estimate(rail, Backend::Nccl);
  const CollectiveEstimate inside = estimate(node, Backend::Ce);
  CollectiveEstimate e;
  e.backend = Backend::Hier;
  e.algorithm = c.type == CollectiveType::AllGather ? "hier: " + across.algorithm + " over " + std::to_string(m) +
                                                          " nodes, then " + inside.algorithm
                                                    : "hier: " + inside.algorithm + ", then " + across.algorithm +
                                                          " over " + std::to_string(m) + " nodes";
  const CollectiveEstimate& first = c.type == CollectiveType::AllGather ? across : inside;
  const CollectiveEstimate& second = c.type == CollectiveType::AllGather ? inside : across;
  e.us = first.us + second.us;
  e.latency_us = first.latency_us + second.latency_us;
  for (const CollectiveEstimate* half : {&first, &second}) {
    for (CollectivePhase ph : half->phases) {
      ph.nccl = half == &across;
      e.phases.push_back(ph);
    }
  }
  e.consumer_us = inside.consumer_us + profile_.efficiency.kernel_launch_us +
                  us_for(2 * permuted, profile_.gpu.hbm_gbps * profile_.efficiency.memory);
  return e;
}

const Curve* CostModel::find_curve(const CollectiveInfo& c, Backend backend) const {
  for (const Curve& curve : profile_.curves) {
    if (curve.collective == c.type && curve.backend == backend && curve.group_size == c.group_size) return &curve;
  }
  return nullptr;
}

CollectiveEstimate CostModel::estimate(const CollectiveInfo& c, Backend backend) const {
  if (backend == Backend::Hier) return hier_estimate(c);  // priced from its two halves' estimates
  CollectiveEstimate e = backend == Backend::Nccl ? nccl_estimate(c) : ce_estimate(c);
  // A CE reduce-scatter curve was measured with the reduction kernel: it does not time the unreduced exchange.
  const bool unreduced = backend == Backend::Ce && c.type == CollectiveType::ReduceScatter &&
                         ce_reduction_ == CeReduction::Consumer;
  const Curve* curve = c.group_size > 1 && !unreduced ? find_curve(c, backend) : nullptr;
  if (curve == nullptr || e.us <= 0) return e;
  // Measured time replaces the model's; the model still says which resources the phases hold.
  const double measured = curve_us(*curve, static_cast<double>(c.bytes));
  const double scale = measured / e.us;
  for (CollectivePhase& ph : e.phases) ph.us *= scale;
  e.latency_us = std::min(e.latency_us, measured);
  e.us = measured;
  e.algorithm = "curve (" + e.algorithm + ")";
  return e;
}

double CostModel::collective_us(const CollectiveInfo& c) const { return estimate(c, Backend::Nccl).us; }

double CostModel::link_share(const CollectiveInfo& c, double us) const {
  const int n = c.group_size;
  if (n <= 1 || us <= 0 || place(n, c.nodes).nodes > 1) return 0;
  const double bytes = static_cast<double>(c.bytes);
  double bus = 0;
  switch (c.type) {
    case CollectiveType::AllGather: bus = (n - 1) * bytes; break;
    case CollectiveType::ReduceScatter:
    case CollectiveType::AllToAll: bus = (n - 1) * bytes / n; break;
    case CollectiveType::AllReduce: bus = 2.0 * (n - 1) * bytes / n; break;
    case CollectiveType::Broadcast:
    case CollectiveType::Send:
    case CollectiveType::Recv: bus = bytes; break;
  }
  const double usable_gbps = place(n, c.nodes).ring_gbps * profile_.ce.bidirectional_efficiency;
  if (usable_gbps <= 0) return 0;
  return std::min(1.0, bus / (us * usable_gbps * 1e3));  // bytes / (us x GB/s x 1e3 bytes per us per GB/s)
}

// ---------------------------------------------------------------------------------------------
// Contention

Slowdown CostModel::slowdown_beside(const CollectivePhase& phase) const {
  if (phase.us <= 0) return {};
  const ContentionSpec& con = profile_.contention;
  // A measured reduction kernel stands for itself: only the rest of the phase's traffic (copies) goes through the
  // formula below, with no SMs taken.
  const bool measured_reduction = phase.reduction && con.ce_reduction.has_value();
  const int sms_taken = measured_reduction ? 0 : phase.sms;
  const double bytes = measured_reduction ? phase.hbm_bytes - phase.reduction_hbm_bytes : phase.hbm_bytes;
  const double sms = profile_.gpu.sms;
  const double sm_term = sms_taken / (sms - sms_taken);  // validation keeps phase.sms < sms
  const double hbm = profile_.gpu.hbm_gbps * profile_.efficiency.memory;
  const double rate_gbps = std::min(std::max(0.0, bytes) / phase.us / 1e3, kMaxHbmShare * hbm);
  const double hbm_term = rate_gbps / (hbm - rate_gbps);
  Slowdown s{con.compute_bound.sm_sensitivity * sm_term + con.compute_bound.hbm_sensitivity * hbm_term,
             con.memory_bound.sm_sensitivity * sm_term + con.memory_bound.hbm_sensitivity * hbm_term};
  if (measured_reduction) {
    s.compute_bound += con.ce_reduction->compute_bound;
    s.memory_bound += con.ce_reduction->memory_bound;
  }
  return s;
}

BackendCost CostModel::cost(const CollectiveInfo& c, Backend backend, const OverlapWindow& window) const {
  BackendCost out;
  out.estimate = estimate(c, backend);
  const double window_us = std::max(0.0, window.compute_bound_us) + std::max(0.0, window.memory_bound_us);
  const double cb_share = window_us > 0 ? std::max(0.0, window.compute_bound_us) / window_us : 0.0;
  const double t_alone = out.estimate.us;

  // The collective's own slowdown while the window runs beside it (hierarchical: each half's, by its time).
  const CollectiveSensitivity& nccl_own = profile_.contention.nccl_beside_compute;
  const CollectiveSensitivity& ce_own = profile_.contention.ce_beside_compute;
  double nccl_share = backend == Backend::Nccl ? 1.0 : 0.0;
  if (backend == Backend::Hier && t_alone > 0) {
    double nccl_us = 0;
    for (const CollectivePhase& ph : out.estimate.phases) nccl_us += ph.nccl ? ph.us : 0.0;
    nccl_share = nccl_us / t_alone;
  }
  auto own_of = [&](const CollectiveSensitivity& own) {
    return cb_share * own.compute_bound + (1 - cb_share) * own.memory_bound;
  };
  const double own_slowdown = nccl_share * own_of(nccl_own) + (1 - nccl_share) * own_of(ce_own);
  // Its fixed time beside compute (profile.h, CollectiveSensitivity), no longer than the window it runs in.
  const double own_residency = backend == Backend::Ce ? ce_own.residency_us : nccl_own.residency_us;
  const double residency = t_alone > 0 && window_us > 0 ? std::min(own_residency, window_us) : 0.0;
  out.comm_us = t_alone + std::min(t_alone, window_us) * own_slowdown + residency;
  const double stretch = t_alone > 0 ? out.comm_us / t_alone : 1.0;

  // The window starts with the collective; during each phase its kernels run 1 + s times slower.
  double remaining_us = window_us;
  double weighted_cb = 0, weighted_mb = 0;
  for (const CollectivePhase& alone : out.estimate.phases) {
    CollectivePhase ph = alone;
    ph.us *= stretch;
    Slowdown s = slowdown_beside(ph);
    // The copy engines' own cost to the kernels beside them (their power, the SM clock): every CE phase that moves
    // bytes by copy engine, i.e. all but a reduction phase whose traffic is the kernel's alone.
    const auto& copies = profile_.contention.ce_copies;
    const bool by_copy_engine = backend == Backend::Ce || (backend == Backend::Hier && !ph.nccl);
    if (by_copy_engine && copies && !(ph.reduction && ph.hbm_bytes <= ph.reduction_hbm_bytes)) {
      s.compute_bound += copies->compute_bound;
      s.memory_bound += copies->memory_bound;
    }
    weighted_cb += s.compute_bound * ph.us;
    weighted_mb += s.memory_bound * ph.us;
    if (remaining_us <= 0) continue;
    const double mix = cb_share * s.compute_bound + (1 - cb_share) * s.memory_bound;
    const double work_us = ph.us / (1 + mix);  // window time (alone) this phase gets through
    if (remaining_us <= work_us) {
      out.slowdown_us += remaining_us * mix;
      remaining_us = 0;
    } else {
      out.slowdown_us += ph.us - work_us;
      remaining_us -= work_us;
    }
  }
  if (out.comm_us > 0) out.slowdown = {weighted_cb / out.comm_us, weighted_mb / out.comm_us};
  out.exposed_us = std::max(0.0, out.comm_us - (window_us + out.slowdown_us));
  out.cost_us = out.exposed_us + out.slowdown_us + out.estimate.consumer_us;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decision

Decision CostModel::decide(const CollectiveInfo& c, const OverlapWindow& window) const {
  Decision d;
  d.nccl = cost(c, Backend::Nccl, window);
  if (c.group_size <= 1) {  // both backends move nothing (CE: the self copy only)
    d.ce = cost(c, Backend::Ce, window);
    d.reason = "nccl: a group of 1 moves no data";
    return d;
  }
  if (auto blocker = ce_blocker(c.group_size, c.nodes)) {
    d.reason = "nccl: " + *blocker;
    if (hier_blocker(c)) return d;
    // Across nodes: the hierarchical choice, copy engines inside each node and NCCL over the rails.
    d.hier = cost(c, Backend::Hier, window);
    const BackendCost& h = *d.hier;
    const double saved = std::abs(d.nccl.cost_us - h.cost_us);
    const std::string vs = format_us(h.comm_us) + " hierarchical (" + format_us(h.exposed_us) + " exposed, " +
                           format_us(h.slowdown_us + h.estimate.consumer_us) + " on compute) vs " +
                           format_us(d.nccl.comm_us) + " flat NCCL (" + format_us(d.nccl.exposed_us) + " exposed, " +
                           format_us(d.nccl.slowdown_us) + " on compute)";
    if (h.cost_us < d.nccl.cost_us - 1e-9 * std::max(1.0, d.nccl.cost_us)) {
      d.choice = Backend::Hier;
      d.reason = "hier: saves " + format_us(saved) + " (" + vs + ")";
    } else {
      d.reason += "; flat NCCL saves " + format_us(saved) + " over hierarchical (" + vs + ")";
    }
    return d;
  }
  d.ce = cost(c, Backend::Ce, window);
  const BackendCost& nccl = d.nccl;
  const BackendCost& ce = *d.ce;
  const double saved = std::abs(nccl.cost_us - ce.cost_us);
  const std::string size = format_bytes(static_cast<double>(c.bytes));
  const double window_us = std::max(0.0, window.compute_bound_us) + std::max(0.0, window.memory_bound_us);
  const double cb_share = window_us > 0 ? std::max(0.0, window.compute_bound_us) / window_us : 0.0;

  // "slows 1.9 ms of GEMMs by 22%": the window's kernels that ran beside the collective.
  auto slows = [&](const BackendCost& b) {
    const double overlapped = std::min(window_us, b.comm_us);
    if (cb_share >= 0.5) {
      return "slows " + format_us(overlapped * cb_share) + " of GEMMs by " + format_pct(b.slowdown.compute_bound);
    }
    return "slows " + format_us(overlapped * (1 - cb_share)) + " of memory-bound kernels by " +
           format_pct(b.slowdown.memory_bound);
  };

  // Ties (to rounding) stay on NCCL, the backend the graph already uses.
  if (ce.cost_us < nccl.cost_us - 1e-9 * std::max(1.0, nccl.cost_us)) {
    d.choice = Backend::Ce;
    const double slowdown_gain = nccl.slowdown_us - ce.slowdown_us;
    const double exposed_gain = nccl.exposed_us - ce.exposed_us;
    if (slowdown_gain > 0 && slowdown_gain >= exposed_gain) {
      d.reason = "ce: saves " + format_us(saved) + " (NCCL " + slows(nccl) + ")";
    } else {
      d.reason = "ce: saves " + format_us(saved) + " (" + size + " in " + format_us(ce.comm_us) + " vs " +
                 format_us(nccl.comm_us) + " on NCCL)";
    }
    return d;
  }

  d.choice = Backend::Nccl;
  const CollectiveEstimate& ce_est = ce.estimate;
  if (ce_est.latency_us >= 0.5 * ce_est.us) {
    d.reason = "nccl: " + size + " is latency-bound; CE per-copy latency loses";
  } else if (reduces(c.type) && reduction_us(ce_est) > 0 && reduction_us(ce_est) >= saved) {
    std::string type = to_string(c.type);
    std::replace(type.begin(), type.end(), '_', '-');
    d.reason = "nccl: saves " + format_us(saved) + " (CE " + type + " adds a " +
               std::to_string(profile_.ce.reduce_sms) + "-SM reduction kernel of " + format_us(reduction_us(ce_est)) +
               ")";
  } else if (ce_est.consumer_us > 0 && ce.cost_us - ce_est.consumer_us <= nccl.cost_us) {
    // CE alone would win; the reads it leaves to the consumer (the sum of the peers' chunks, on the compute stream)
    // are what lose it.
    std::string type = to_string(c.type);
    std::replace(type.begin(), type.end(), '_', '-');
    d.reason = "nccl: saves " + format_us(saved) + " (CE " + type + "'s sum in the consumer adds " +
               format_us(ce_est.consumer_us) + " on the compute stream, its " + size + " in " + format_us(ce.comm_us) +
               " vs " + format_us(nccl.comm_us) + " on NCCL)";
  } else if (ce.slowdown_us - nccl.slowdown_us > nccl.exposed_us - ce.exposed_us && ce.slowdown_us > nccl.slowdown_us) {
    d.reason = "nccl: saves " + format_us(saved) + " (CE traffic " + slows(ce) + ")";
  } else {
    d.reason = "nccl: saves " + format_us(saved) + " (" + size + " in " + format_us(nccl.comm_us) + " vs " +
               format_us(ce.comm_us) + " on CE)";
  }
  return d;
}

}  // namespace ce_overlap
