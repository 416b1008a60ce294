// The planner: bucketing and scheduling from csrc/graph, backends from the cost model.
#include "planner.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <tuple>

#include "../graph/analysis.h"
#include "../graph/bucketing.h"
#include "../graph/schedule.h"

namespace ce_overlap {
namespace {

struct Choice {
  Backend backend = Backend::Nccl;
  std::string reason;
};

Choice choose(const Bucket& bucket, const CollectiveInfo& c, const Decision& d, const CostModel& model,
              const PlanConfig& config) {
  if (!bucket.planned) return {Backend::Nccl, "nccl: " + bucket.kept_reason + "; kept where captured"};
  if (bucket.role == CollectiveRole::TensorParallel) {
    return {Backend::Nccl, "nccl: tensor-parallel, on its block's critical path (issued as soon as its input is "
                           "ready; kept on NCCL)"};
  }
  if (config.ce == CeMode::Off) return {Backend::Nccl, "nccl: config.ce is off"};
  const bool ce_serves = std::find(std::begin(kCeCollectiveTypes), std::end(kCeCollectiveTypes), c.type) !=
                         std::end(kCeCollectiveTypes);
  if (ce_serves && !ce_allows(config, c.type)) {
    return {Backend::Nccl, std::string("nccl: config.ce_collectives excludes ") + to_string(c.type)};
  }
  // A group of 1 moves no data; "on" still puts it on CE (the runtime's self copy), so one GPU exercises the CE path.
  if (c.group_size <= 1 && config.ce != CeMode::On) return {Backend::Nccl, d.reason};
  // Where CE cannot serve the group (it spans nodes), the alternative to flat NCCL is the hierarchical choice, if any.
  const bool across = c.group_size > 1 && model.ce_blocker(c.group_size, c.nodes);
  if (across && !d.hier) return {Backend::Nccl, d.reason};
  if (c.bytes < config.min_ce_bytes) {
    return {Backend::Nccl, "nccl: " + format_bytes(static_cast<double>(c.bytes)) + " is under min_ce_bytes (" +
                               format_bytes(static_cast<double>(config.min_ce_bytes)) + ")"};
  }
  const Backend alternative = across ? Backend::Hier : Backend::Ce;
  if (config.ce == CeMode::On && d.choice != alternative) {
    return {alternative,
            std::string(to_string(alternative)) + ": config.ce is on (the cost model prefers " + d.reason + ")"};
  }
  return {d.choice, d.reason};
}

// What one peer copy of a CE bucket moves: the runtime paces each peer copy (one per peer lane), and an all-gather
// copies each peer's whole input, a reduce-scatter each peer's 1/n of it.
double copy_bytes(const CollectiveInfo& c) {
  return c.type == CollectiveType::ReduceScatter ? static_cast<double>(c.bytes) / c.group_size
                                                 : static_cast<double>(c.bytes);
}

// The copy rate that stretches a CE bucket's copies over config.copy_pace_fill of its slot (docs/plan.md "Copy
// rate": its window, cut where the next bucket of its group is issued), or nullopt to leave them unpaced: pacing off,
// no slot, or copies that already fill that much of it. The rate is per peer copy (at 8 ranks 7 copies share the
// links: each runs at ~50 GB/s unpaced). Never under kMinPaceGbps (a pacer waits per chunk of at least 1 MiB: 100 us
// at that rate); not set when the rate would be at least 90% of the copy's unpaced rate (nothing to gain).
constexpr double kMinPaceGbps = 10;

std::optional<double> pace_rate(const CollectiveInfo& c, const BackendCost& ce, double slot_us,
                                const PlanConfig& config) {
  if (config.copy_pace_fill <= 0 || slot_us <= 0 || c.group_size <= 1) return std::nullopt;
  const double bytes = copy_bytes(c);
  const double fixed_us = ce.estimate.latency_us;
  const double unpaced_us = ce.comm_us - fixed_us;
  const double target_us = config.copy_pace_fill * slot_us - fixed_us;
  if (bytes <= 0 || unpaced_us <= 0 || target_us <= unpaced_us) return std::nullopt;
  const double unpaced_gbps = bytes / unpaced_us / 1e3;  // bytes per us / 1e3 = GB/s
  const double gbps = std::max(kMinPaceGbps, bytes / target_us / 1e3);
  if (gbps >= 0.9 * unpaced_gbps) return std::nullopt;
  return gbps;
}

// A paced bucket's time: its fixed part plus its copies at the rate (at least its unpaced time).
double paced_us(const CollectiveInfo& c, const BackendCost& ce, double gbps) {
  return std::max(ce.comm_us, ce.estimate.latency_us + copy_bytes(c) / gbps / 1e3);
}

// What a plan bucket carries in the timeline: the node that carries its time, its collective, the fixed part of its
// time on the chosen backend, and (CE) the compute it can stretch over without delaying anything (0: none).
struct Carried {
  int node = -1;
  CollectiveInfo c;
  double fixed_us = 0;
  double room_us = 0;
};

// Paces the unpaced CE data-parallel buckets that `tl` shows beside tensor-parallel collectives, where that fits:
// each to the share of NVLink the graph's TP collectives leave (1 - the largest of their shares: stretched, a bucket
// may reach the next one), when its copies stretched so still end within its room; sharing the link costs less than
// a bucket that outlasts its window. Updates `after` and the link shares; returns whether it paced any (then the
// timeline is simulated again).
bool pace_for_tp(const Graph& g, const Timeline& tl, const std::vector<Carried>& carried,
                 const std::vector<int>& plan_bucket_of, std::vector<double>& after, SimulateOptions& link,
                 Plan& plan) {
  std::vector<double> beside(plan.buckets.size(), 0.0);  // the largest TP share each bucket runs beside
  std::vector<int> tp_node(plan.buckets.size(), -1);
  for (const CollectiveOverlap& o : tl.overlaps) {
    for (const auto& [mine, other] : {std::pair{o.a, o.b}, std::pair{o.b, o.a}}) {
      const int pbi = plan_bucket_of[mine], obi = plan_bucket_of[other];
      if (pbi < 0 || obi < 0 || plan.buckets[obi].role != CollectiveRole::TensorParallel ||
          plan.buckets[pbi].role == CollectiveRole::TensorParallel || plan.buckets[pbi].backend != "ce") {
        continue;
      }
      if (link.link_share[other] > beside[pbi]) {
        beside[pbi] = link.link_share[other];
        tp_node[pbi] = other;
      }
    }
  }
  double tp_share = 0;  // the largest link share of any TP collective of the graph
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    if (plan.buckets[i].role == CollectiveRole::TensorParallel) {
      tp_share = std::max(tp_share, link.link_share[carried[i].node]);
    }
  }
  bool paced = false;
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    PlanBucket& pb = plan.buckets[i];
    const Carried& k = carried[i];
    const double allowed = 1 - std::max(beside[i], tp_share), share = link.link_share[k.node];
    if (beside[i] <= 0 || pb.copy_rate_gbps || allowed < 0.05 || share <= allowed) continue;
    const double t = after[k.node];
    const double paced_us = k.fixed_us + (t - k.fixed_us) * share / allowed;  // the same bus bytes at `allowed`
    if (paced_us > k.room_us || paced_us <= k.fixed_us) continue;
    const double gbps = copy_bytes(k.c) / (paced_us - k.fixed_us) / 1e3;
    if (gbps < kMinPaceGbps) continue;
    pb.copy_rate_gbps = gbps;
    after[k.node] = paced_us;
    link.link_share[k.node] = allowed;
    pb.reason += "; paced at " + std::to_string(static_cast<int>(gbps + 0.5)) +
                 " GB/s per peer copy to leave NVLink to tensor-parallel " + g.nodes[tp_node[i]].name;
    paced = true;
  }
  return paced;
}

}  // namespace

Plan make_plan(const Document& doc, const std::string& graph_name, const CostModel& base_model,
               const PlanConfig& config) {
  const auto t0 = std::chrono::steady_clock::now();
  CostModel model = base_model;  // priced the way the pass will run a CE reduce-scatter
  model.set_ce_reduction(config.ce_reduction);
  const Graph& g = find_graph(doc, graph_name);
  const int n = static_cast<int>(g.nodes.size());
  for (const Node& node : g.nodes) {  // the scheduler relies on ids being a topological order
    for (int input : node.inputs) {
      if (input < 0 || input >= node.id) {
        throw IrError("graph \"" + g.name + "\": node " + std::to_string(node.id) +
                      " reads a later or unknown node; plan a validated IR (docs/ir.md)");
      }
    }
  }

  std::vector<Bucket> buckets = bucket_collectives(g, doc.blocks, config);
  Schedule s = schedule_graph(g, std::move(buckets), config);
  const std::vector<Bucket>& bs = s.buckets;

  // Compute before each position of the new order, by kernel class (the windows).
  const std::vector<double> durations = model.durations_us(g);
  std::vector<double> cb_prefix(n + 1, 0), mb_prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    const Node& node = g.nodes[s.order[i]];
    const bool compute = node.kind == NodeKind::Compute;
    const bool cb = compute && model.compute_bound(node);
    cb_prefix[i + 1] = cb_prefix[i] + (cb ? durations[node.id] : 0.0);
    mb_prefix[i + 1] = mb_prefix[i] + (compute && !cb ? durations[node.id] : 0.0);
  }
  std::vector<int> position(n);
  for (int i = 0; i < n; ++i) position[s.order[i]] = i;

  Plan plan;
  plan.graph = g.name;
  plan.profile = model.profile().name;
  plan.config = config;
  std::vector<double> after = durations;  // collectives: the chosen backend, once per bucket
  std::vector<size_t> by_issue(bs.size());
  std::iota(by_issue.begin(), by_issue.end(), 0);
  std::stable_sort(by_issue.begin(), by_issue.end(),
                   [&](size_t a, size_t b) { return s.issue_position[a] < s.issue_position[b]; });
  // Each bucket's slot for pacing: from its issue to the next bucket of its group is issued (the runtime runs a group's
  // collectives one after another on its streams: a bucket stretched past that delays the next) or to its own wait.
  std::vector<int> slot_end(bs.size());
  for (size_t i = 0; i < by_issue.size(); ++i) {
    const size_t b = by_issue[i];
    slot_end[b] = s.wait_position[b];
    for (size_t j = i + 1; j < by_issue.size(); ++j) {
      if (bs[by_issue[j]].group == bs[b].group) {
        slot_end[b] = std::min(slot_end[b], s.issue_position[by_issue[j]]);
        break;
      }
    }
  }
  int64_t collectives = 0, ce_buckets = 0;
  // Per node: the NVLink share of the collective it carries (simulate's SimulateOptions), after and before.
  SimulateOptions after_link, before_link;
  after_link.link_share.assign(n, 0.0);
  before_link.link_share.assign(n, 0.0);
  for (const Node& node : g.nodes) {
    if (node.kind == NodeKind::Collective && node.collective) {
      before_link.link_share[node.id] = model.link_share(*node.collective, durations[node.id]);
    }
  }
  std::vector<int> plan_bucket_of(n, -1);  // the node that carries a bucket's time -> its plan bucket
  // Per plan bucket, what pacing it around tensor parallelism needs (pace_for_tp).
  std::vector<Carried> carried;
  for (size_t b : by_issue) {
    const Bucket& bucket = bs[b];
    CollectiveInfo c;
    c.type = bucket.type;
    c.group = bucket.group;
    c.group_size = bucket.group_size;
    c.reduce_op = bucket.reduce_op;
    c.bytes = bucket.bytes;
    c.role = bucket.role;
    c.nodes = bucket.nodes;
    OverlapWindow w;
    if (s.wait_position[b] > s.issue_position[b]) {
      // Strictly between the last member collective and the first member wait.
      const int from = s.issue_position[b] + static_cast<int>(bucket.members.size());
      const int to = s.wait_position[b];
      if (to > from) {
        w.compute_bound_us = cb_prefix[to] - cb_prefix[from];
        w.memory_bound_us = mb_prefix[to] - mb_prefix[from];
      }
    }
    const Decision d = model.decide(c, w);
    const Choice choice = choose(bucket, c, d, model, config);
    const BackendCost& chosen = choice.backend == Backend::Ce     ? *d.ce
                                : choice.backend == Backend::Hier ? *d.hier
                                                                  : d.nccl;

    PlanBucket pb;
    pb.id = static_cast<int>(plan.buckets.size());
    pb.type = bucket.type;
    if (bucket.block >= 0) pb.block = bucket.block;
    if (bucket.scope != BucketScope::Outside) pb.block_path = bucket.key;
    pb.group = bucket.group;
    pb.group_size = bucket.group_size;
    pb.dtype = bucket.dtype;
    pb.reduce_op = bucket.reduce_op;
    int last_member = bucket.members.front();
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      const int m = bucket.members[k];
      PlanMember member;
      member.collective = g.nodes[m].name;
      if (bucket.waits[k] >= 0) member.wait = g.nodes[bucket.waits[k]].name;
      member.bytes = g.nodes[m].collective->bytes;
      pb.members.push_back(std::move(member));
      after[m] = 0;
      if (position[m] > position[last_member]) last_member = m;
    }
    const double window_us = w.compute_bound_us + w.memory_bound_us;
    double room_us = 0;  // a CE bucket's window, cut where the next bucket of its group is issued
    if (choice.backend == Backend::Ce) {
      const int from = s.issue_position[b] + static_cast<int>(bucket.members.size());
      const int to = std::max(from, slot_end[b]);
      const double slot_us = cb_prefix[to] - cb_prefix[from] + mb_prefix[to] - mb_prefix[from];
      room_us = std::min(window_us, slot_us);
      pb.copy_rate_gbps = pace_rate(c, chosen, room_us, config);
    }
    // The bucket starts when its last member's inputs are ready: it carries the whole time (paced: the longer one).
    // A sum left to the consumer runs on the compute stream after the wait: the first wait carries it.
    after[last_member] = pb.copy_rate_gbps ? paced_us(c, chosen, *pb.copy_rate_gbps) : chosen.comm_us;
    after_link.link_share[last_member] = model.link_share(c, after[last_member]);
    plan_bucket_of[last_member] = static_cast<int>(plan.buckets.size());
    carried.push_back({last_member, c, chosen.estimate.latency_us, room_us});
    pb.role = bucket.role;
    for (int w : bucket.waits) {
      if (w < 0) continue;
      after[w] += chosen.estimate.consumer_us;
      break;
    }
    pb.bytes = bucket.bytes;
    pb.backend = to_string(choice.backend);
    pb.reason = choice.reason;
    if (!s.notes[b].empty()) pb.reason += "; " + s.notes[b];
    if (pb.copy_rate_gbps) {
      pb.reason += "; paced at " + std::to_string(static_cast<int>(*pb.copy_rate_gbps + 0.5)) +
                   " GB/s per peer copy to fill " + std::to_string(static_cast<int>(config.copy_pace_fill * 100 + 0.5)) +
                   "% of its slot";
    }
    pb.predicted.nccl_us = d.nccl.comm_us;
    pb.predicted.nccl_cost_us = d.nccl.cost_us;
    if (d.ce) {
      pb.predicted.ce_us = d.ce->comm_us;
      pb.predicted.ce_cost_us = d.ce->cost_us;
    }
    if (d.hier) {
      pb.predicted.hier_us = d.hier->comm_us;
      pb.predicted.hier_cost_us = d.hier->cost_us;
    }
    pb.predicted.window_us = window_us;
    pb.predicted.exposed_us = chosen.exposed_us;
    collectives += static_cast<int64_t>(bucket.members.size());
    if (choice.backend == Backend::Ce) ++ce_buckets;
    plan.buckets.push_back(std::move(pb));
  }
  plan.order.reserve(n);
  for (int v : s.order) plan.order.push_back(g.nodes[v].name);

  std::vector<int> captured(n);
  std::iota(captured.begin(), captured.end(), 0);
  const Timeline before_tl = simulate(g, captured, durations, before_link);
  Timeline after_tl = simulate(g, s.order, after, after_link);
  if (pace_for_tp(g, after_tl, carried, plan_bucket_of, after, after_link, plan)) {
    after_tl = simulate(g, s.order, after, after_link);
  }
  // What sharing NVLink with another group's collectives cost each data-parallel bucket and them.
  for (const CollectiveOverlap& o : after_tl.overlaps) {
    for (const auto& [mine, other, mine_added, other_added] :
         {std::tuple{o.a, o.b, o.added_a_us, o.added_b_us}, std::tuple{o.b, o.a, o.added_b_us, o.added_a_us}}) {
      const int pbi = plan_bucket_of[mine];
      const int obi = plan_bucket_of[other];
      if (pbi < 0 || plan.buckets[pbi].role == CollectiveRole::TensorParallel || obi < 0 ||
          plan.buckets[obi].role != CollectiveRole::TensorParallel) {
        continue;
      }
      plan.buckets[pbi].overlaps.push_back({g.nodes[other].name, o.overlap_us, other_added, mine_added});
    }
  }
  PlanSummary& sum = plan.summary;
  sum.collectives = collectives;
  sum.buckets = static_cast<int64_t>(plan.buckets.size());
  sum.ce_buckets = ce_buckets;
  for (double x : before_tl.exposed_us_by_collective) sum.exposed_comm_us_before += x;
  for (double x : after_tl.exposed_us_by_collective) sum.exposed_comm_us_after += x;
  sum.makespan_us_before = before_tl.makespan_us;
  sum.makespan_us_after = after_tl.makespan_us;
  sum.peak_memory_bytes_before = s.peak_bytes_before;
  sum.peak_memory_bytes_after = s.peak_bytes_after;
  sum.memory_budget_bytes = config.memory_budget_bytes;
  check_plan(doc, plan);
  sum.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace ce_overlap
