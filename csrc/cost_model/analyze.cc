// The analyzer: simulates each captured graph in its captured order with the cost model and sums
// collectives, FLOPs and (exposed) time per block into the ce_overlap.analysis/1 report.
#include "analyze.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "../graph/analysis.h"
#include "../graph/saturating.h"

namespace ce_overlap {

namespace {

using nlohmann::ordered_json;

// An empty object with room for `keys` members: the report holds ~one object per node, and growing
// each member vector from empty dominated analyze() time on large graphs.
ordered_json object_with_capacity(size_t keys) {
  ordered_json j = ordered_json::object();
  j.get_ref<ordered_json::object_t&>().reserve(keys);
  return j;
}

struct Row {
  // All-gathers apart per pass: FSDP's backward re-gathers what the forward gathered.
  int64_t forward_all_gather_count = 0;
  int64_t forward_all_gather_bytes = 0;
  int64_t backward_all_gather_count = 0;
  int64_t backward_all_gather_bytes = 0;
  int64_t reduce_scatter_count = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t other_collective_count = 0;
  int64_t other_collective_bytes = 0;
  // Tensor parallelism's collectives (role tp), apart from FSDP's above: count, bytes (each rank's input), time.
  int64_t tp_collective_count = 0;
  int64_t tp_collective_bytes = 0;
  double tp_comm_us = 0;
  double tp_exposed_comm_us = 0;
  int64_t forward_flops = 0;
  int64_t backward_flops = 0;
  double compute_us = 0;
  double comm_us = 0;
  double exposed_comm_us = 0;
  int64_t ce_candidates = 0;  // collectives CostModel::decide would give to the copy engines

  void add(const Row& o) {
    forward_all_gather_count += o.forward_all_gather_count;
    forward_all_gather_bytes = sat_add(forward_all_gather_bytes, o.forward_all_gather_bytes);
    backward_all_gather_count += o.backward_all_gather_count;
    backward_all_gather_bytes = sat_add(backward_all_gather_bytes, o.backward_all_gather_bytes);
    reduce_scatter_count += o.reduce_scatter_count;
    reduce_scatter_bytes = sat_add(reduce_scatter_bytes, o.reduce_scatter_bytes);
    other_collective_count += o.other_collective_count;
    other_collective_bytes = sat_add(other_collective_bytes, o.other_collective_bytes);
    tp_collective_count += o.tp_collective_count;
    tp_collective_bytes = sat_add(tp_collective_bytes, o.tp_collective_bytes);
    tp_comm_us += o.tp_comm_us;
    tp_exposed_comm_us += o.tp_exposed_comm_us;
    forward_flops = sat_add(forward_flops, o.forward_flops);
    backward_flops = sat_add(backward_flops, o.backward_flops);
    compute_us += o.compute_us;
    comm_us += o.comm_us;
    exposed_comm_us += o.exposed_comm_us;
    ce_candidates += o.ce_candidates;
  }
};

ordered_json row_json(int block, const std::string& path, const std::string& type, const Row& r) {
  ordered_json j = object_with_capacity(21);
  j["block"] = block;
  j["path"] = path;
  j["type"] = type;
  j["forward_all_gather_count"] = r.forward_all_gather_count;
  j["forward_all_gather_bytes"] = r.forward_all_gather_bytes;
  j["backward_all_gather_count"] = r.backward_all_gather_count;
  j["backward_all_gather_bytes"] = r.backward_all_gather_bytes;
  j["reduce_scatter_count"] = r.reduce_scatter_count;
  j["reduce_scatter_bytes"] = r.reduce_scatter_bytes;
  j["other_collective_count"] = r.other_collective_count;
  j["other_collective_bytes"] = r.other_collective_bytes;
  j["tp_collective_count"] = r.tp_collective_count;
  j["tp_collective_bytes"] = r.tp_collective_bytes;
  j["forward_flops"] = r.forward_flops;
  j["backward_flops"] = r.backward_flops;
  j["compute_us"] = r.compute_us;
  j["comm_us"] = r.comm_us;
  j["exposed_comm_us"] = r.exposed_comm_us;
  j["tp_comm_us"] = r.tp_comm_us;
  j["tp_exposed_comm_us"] = r.tp_exposed_comm_us;
  j["ce_candidates"] = r.ce_candidates;
  return j;
}

const char* stream_name(Stream s) { return s == Stream::Comm ? "comm" : "compute"; }

// Per collective node id, the compute that ran beside it in the simulated timeline, by kernel class.
// The compute stream runs its events back to back in time order; the collectives, one stream per group, are sorted by
// start, so one sweep pairs them.
std::vector<OverlapWindow> windows_beside(const Graph& g, const Timeline& tl, const CostModel& model) {
  std::vector<OverlapWindow> out(g.nodes.size());
  std::vector<const TimelineEvent*> compute, comm;
  for (const TimelineEvent& ev : tl.events) (ev.stream == Stream::Comm ? comm : compute).push_back(&ev);
  std::stable_sort(comm.begin(), comm.end(),
                   [](const TimelineEvent* a, const TimelineEvent* b) { return a->start_us < b->start_us; });
  size_t first = 0;
  for (const TimelineEvent* c : comm) {
    while (first < compute.size() && compute[first]->end_us <= c->start_us) ++first;
    for (size_t k = first; k < compute.size() && compute[k]->start_us < c->end_us; ++k) {
      const double overlap = std::min(c->end_us, compute[k]->end_us) - std::max(c->start_us, compute[k]->start_us);
      if (overlap <= 0) continue;
      OverlapWindow& w = out[static_cast<size_t>(c->node)];
      const Node& node = g.nodes[static_cast<size_t>(compute[k]->node)];
      (model.compute_bound(node) ? w.compute_bound_us : w.memory_bound_us) += overlap;
    }
  }
  return out;
}

}  // namespace

ordered_json analyze(const Document& doc, const CostModel& model) {
  validate(doc);

  // rows[0] is outside_blocks (block -1), rows[b + 1] is block b: node.block + 1 indexes directly.
  std::vector<Row> rows(doc.blocks.size() + 1);
  ordered_json graphs = ordered_json::array();
  ordered_json timeline = ordered_json::array();
  double graph_start_us = 0;  // graphs run end to end in document order

  for (const Graph& g : doc.graphs) {
    const size_t n = g.nodes.size();
    const bool backward = g.name == "backward";
    std::vector<char> starts;  // each kernel's first node
    const std::vector<double> durations = model.durations_us(g, &starts);
    timeline.get_ref<ordered_json::array_t&>().reserve(timeline.size() + n);

    // Validation guarantees ids 0..n-1 in captured order with inputs first: that order is the schedule.
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    SimulateOptions link;  // collectives of different groups (TP beside FSDP) share the GPU's NVLink
    link.link_share.assign(n, 0.0);
    for (const Node& node : g.nodes) {
      if (node.collective) link.link_share[node.id] = model.link_share(*node.collective, durations[node.id]);
    }
    const Timeline tl = simulate(g, order, durations, link);
    const MemoryEstimate mem = peak_memory(g, order);
    const CriticalPath cp = critical_path(g, durations);
    const std::vector<OverlapWindow> windows = windows_beside(g, tl, model);

    double compute_us = 0;
    double comm_us = 0;
    double exposed_us = 0;
    double tp_comm_us = 0, tp_exposed_us = 0;
    int64_t collectives = 0;
    // Where compute time goes: attention kernels, other compute-bound ops (GEMMs), memory-bound ops.
    double matmul_us = 0, attention_us = 0, memory_bound_us = 0, gap_us = 0;
    for (size_t i = 0; i < n; ++i) {
      const Node& node = g.nodes[i];
      Row& row = rows[static_cast<size_t>(node.block + 1)];
      if (backward) {
        row.backward_flops = sat_add(row.backward_flops, node.flops);
      } else {
        row.forward_flops = sat_add(row.forward_flops, node.flops);
      }
      if (node.kind != NodeKind::Collective) {
        compute_us += durations[i];
        row.compute_us += durations[i];
        if (node.kind == NodeKind::Compute) {  // kernel time by class; the gap between kernels apart
          const double gap = starts[i] ? model.profile().efficiency.kernel_gap_us : 0.0;
          gap_us += gap;
          (is_attention_op(node.op) ? attention_us : model.compute_bound(node) ? matmul_us : memory_bound_us) +=
              durations[i] - gap;
        }
        continue;
      }
      const CollectiveInfo& c = *node.collective;
      const double exposed = i < tl.exposed_us_by_collective.size() ? tl.exposed_us_by_collective[i] : 0.0;
      ++collectives;
      comm_us += durations[i];
      exposed_us += exposed;
      row.comm_us += durations[i];
      row.exposed_comm_us += exposed;
      if (c.role == CollectiveRole::TensorParallel) {  // on the critical path, kept on NCCL (not a CE candidate)
        ++row.tp_collective_count;
        row.tp_collective_bytes = sat_add(row.tp_collective_bytes, c.bytes);
        row.tp_comm_us += durations[i];
        row.tp_exposed_comm_us += exposed;
        tp_comm_us += durations[i];
        tp_exposed_us += exposed;
        continue;
      }
      if (model.decide(c, windows[i]).choice == Backend::Ce) ++row.ce_candidates;
      switch (c.type) {
        case CollectiveType::AllGather: {  // what it produces: every rank's shard
          int64_t& count = backward ? row.backward_all_gather_count : row.forward_all_gather_count;
          int64_t& bytes = backward ? row.backward_all_gather_bytes : row.forward_all_gather_bytes;
          ++count;
          bytes = sat_add(bytes, sat_mul(c.bytes, c.group_size));
          break;
        }
        case CollectiveType::ReduceScatter:  // what it consumes: the full input
          ++row.reduce_scatter_count;
          row.reduce_scatter_bytes = sat_add(row.reduce_scatter_bytes, c.bytes);
          break;
        default:
          ++row.other_collective_count;
          row.other_collective_bytes = sat_add(row.other_collective_bytes, c.bytes);
          break;
      }
    }

    ordered_json gj = object_with_capacity(16);
    gj["name"] = g.name;
    gj["nodes"] = n;
    gj["compute_us"] = compute_us;
    gj["comm_us"] = comm_us;
    gj["exposed_comm_us"] = exposed_us;
    gj["tp_comm_us"] = tp_comm_us;
    gj["tp_exposed_comm_us"] = tp_exposed_us;
    gj["makespan_us"] = tl.makespan_us;
    gj["critical_path_us"] = cp.length;
    gj["peak_memory_bytes"] = mem.peak_bytes;
    gj["input_bytes"] = mem.input_bytes;
    gj["collectives"] = collectives;
    const int64_t kernels = std::count(starts.begin(), starts.end(), 1);
    const int64_t inputs = std::count_if(g.nodes.begin(), g.nodes.end(),
                                         [](const Node& node) { return node.op == "placeholder"; });
    gj["kernels"] = kernels;
    gj["kernel_gap_us"] = gap_us;
    gj["inputs"] = inputs;
    ordered_json by_class = object_with_capacity(3);
    by_class["matmul"] = matmul_us;
    by_class["attention"] = attention_us;
    by_class["memory_bound"] = memory_bound_us;
    gj["compute_by_class_us"] = std::move(by_class);
    graphs.push_back(std::move(gj));

    for (const TimelineEvent& ev : tl.events) {
      const Node& node = g.nodes[static_cast<size_t>(ev.node)];
      ordered_json e = object_with_capacity(10);
      e["graph"] = g.name;
      e["node"] = ev.node;
      e["name"] = node.name;
      e["op"] = node.op;
      e["kind"] = to_string(node.kind);
      e["block"] = node.block;
      e["stream"] = stream_name(ev.stream);
      if (node.collective) e["group"] = node.collective->group;  // one comm stream per group
      e["start_us"] = graph_start_us + ev.start_us;
      e["end_us"] = graph_start_us + ev.end_us;
      timeline.push_back(std::move(e));
    }
    graph_start_us += tl.makespan_us;
  }

  ordered_json blocks = ordered_json::array();
  Row totals;
  for (const Block& b : doc.blocks) {
    const Row& r = rows[static_cast<size_t>(b.id + 1)];
    blocks.push_back(row_json(b.id, b.path, b.type, r));
    totals.add(r);
  }
  totals.add(rows[0]);

  ordered_json report = ordered_json::object();
  report["schema"] = kAnalysisSchema;
  report["profile"] = model.profile().name;
  // meta is free-form and small; a text round trip converts it without caring about its shape.
  report["meta"] = ordered_json::parse(doc.meta.dump());
  report["graphs"] = std::move(graphs);
  report["blocks"] = std::move(blocks);
  report["outside_blocks"] = row_json(-1, "", "", rows[0]);
  report["totals"] = row_json(-1, "", "", totals);
  report["timeline"] = std::move(timeline);
  return report;
}

ordered_json graph_kernels(const Document& doc, const std::string& graph, const CostModel& model) {
  validate(doc);
  const Graph& g = find_graph(doc, graph);
  const std::vector<double> durations = model.durations_us(g);
  std::vector<std::pair<int, ordered_json>> kernels;  // (first node, kernel)
  auto add = [&](const std::vector<int>& nodes, int64_t bytes, bool fused) {
    ordered_json k = object_with_capacity(5);
    ordered_json ids = ordered_json::array();
    ordered_json ops = ordered_json::array();
    double us = 0;
    for (int m : nodes) {
      ids.push_back(g.nodes[static_cast<size_t>(m)].id);
      ops.push_back(g.nodes[static_cast<size_t>(m)].op);
      us += durations[static_cast<size_t>(m)];
    }
    k["nodes"] = std::move(ids);
    k["ops"] = std::move(ops);
    k["bytes"] = bytes;
    k["us"] = us;
    k["fused"] = fused;
    kernels.emplace_back(nodes.front(), std::move(k));
  };
  std::vector<char> grouped(g.nodes.size(), 0);
  for (const FusionGroup& fg : fusion_groups(g)) {
    for (int m : fg.compute_nodes) grouped[static_cast<size_t>(m)] = 1;
    add(fg.compute_nodes, sat_add(fg.bytes_in, fg.bytes_out), true);
  }
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].kind == NodeKind::Compute && !grouped[i]) add({static_cast<int>(i)}, g.nodes[i].bytes_accessed, false);
  }
  std::stable_sort(kernels.begin(), kernels.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  ordered_json out = ordered_json::array();
  out.get_ref<ordered_json::array_t&>().reserve(kernels.size());
  for (auto& k : kernels) out.push_back(std::move(k.second));
  return out;
}

}  // namespace ce_overlap
