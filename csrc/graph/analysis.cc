// Graph algorithms over the IR: stable topological order, critical path, aliasing, block detection,
// liveness-based peak memory and a two-stream (compute + comm) list-schedule timeline.
#include "analysis.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <queue>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "graph_internal.h"

namespace ce_overlap {
namespace detail {

std::string node_label(const Graph& g, int id) {
  if (id < 0 || id >= static_cast<int>(g.nodes.size())) return "node " + std::to_string(id);
  return "node " + std::to_string(id) + " (\"" + g.nodes[id].name + "\")";
}

bool stable_topological_order(const Graph& g, std::vector<int>& order, std::vector<int>& cycle) {
  const int n = static_cast<int>(g.nodes.size());
  // Users in CSR form: one allocation instead of a vector per node.
  std::vector<int> user_offsets(n + 1, 0);
  std::vector<int> in_degree(n, 0);
  for (int v = 0; v < n; ++v) {
    for (int input : g.nodes[v].inputs) ++user_offsets[input + 1];
    in_degree[v] = static_cast<int>(g.nodes[v].inputs.size());
  }
  for (int i = 0; i < n; ++i) user_offsets[i + 1] += user_offsets[i];
  std::vector<int> users(user_offsets[n]);
  std::vector<int> fill(user_offsets.begin(), user_offsets.end() - 1);
  for (int v = 0; v < n; ++v) {
    for (int input : g.nodes[v].inputs) users[fill[input]++] = v;
  }

  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (int v = 0; v < n; ++v) {
    if (in_degree[v] == 0) ready.push(v);
  }
  order.clear();
  order.reserve(n);
  while (!ready.empty()) {
    const int v = ready.top();
    ready.pop();
    order.push_back(v);
    for (int k = user_offsets[v]; k < user_offsets[v + 1]; ++k) {
      if (--in_degree[users[k]] == 0) ready.push(users[k]);
    }
  }
  if (static_cast<int>(order.size()) == n) return true;

  // Every node Kahn left behind still has an input that was left behind, so walking such inputs
  // from any of them must revisit a node; the revisited stretch is a real cycle.
  std::vector<char> done(n, 0);
  for (int v : order) done[v] = 1;
  int start = 0;
  while (done[start]) ++start;
  std::vector<int> seen_at(n, -1);
  std::vector<int> walk;
  int cur = start;
  while (seen_at[cur] < 0) {
    seen_at[cur] = static_cast<int>(walk.size());
    walk.push_back(cur);
    for (int input : g.nodes[cur].inputs) {
      if (!done[input]) {
        cur = input;
        break;
      }
    }
  }
  cycle.assign(walk.begin() + seen_at[cur], walk.end());
  std::reverse(cycle.begin(), cycle.end());  // the walk went user -> input; report data flow
  std::rotate(cycle.begin(), std::min_element(cycle.begin(), cycle.end()), cycle.end());
  return false;
}

std::string describe_cycle(const Graph& g, const std::vector<int>& cycle) {
  constexpr size_t kMaxShown = 24;
  std::string out;
  for (size_t i = 0; i < cycle.size(); ++i) {
    if (cycle.size() > kMaxShown && i == kMaxShown / 2) {
      out += " -> ... (" + std::to_string(cycle.size() - kMaxShown) + " more)";
      i = cycle.size() - kMaxShown / 2;
    }
    if (!out.empty()) out += " -> ";
    out += g.nodes[cycle[i]].name;
  }
  if (!cycle.empty()) out += " -> " + g.nodes[cycle[0]].name;
  return out;
}

}  // namespace detail

namespace {

using detail::node_label;

std::string graph_label(const Graph& g) { return "graph \"" + g.name + "\""; }

// Analysis entry points accept graphs that were never validated; bad ids must not index out of bounds.
void check_inputs_in_range(const Graph& g) {
  const int n = static_cast<int>(g.nodes.size());
  for (int v = 0; v < n; ++v) {
    const Node& node = g.nodes[v];
    if (node.id != v) {
      throw IrError(graph_label(g) + ": nodes[" + std::to_string(v) + "] has id " + std::to_string(node.id) +
                    ", expected its position " + std::to_string(v));
    }
    for (int input : node.inputs) {
      if (input < 0 || input >= n) {
        throw IrError(graph_label(g) + ": " + node_label(g, v) + " has input " + std::to_string(input) +
                      " out of range [0, " + std::to_string(n) + ")");
      }
    }
  }
}

void check_durations(const Graph& g, const std::vector<double>& durations) {
  if (durations.size() != g.nodes.size()) {
    throw IrError("durations: expected " + std::to_string(g.nodes.size()) + " entries (one per node of " +
                  graph_label(g) + "), got " + std::to_string(durations.size()));
  }
  for (size_t i = 0; i < durations.size(); ++i) {
    if (!std::isfinite(durations[i]) || durations[i] < 0) {
      throw IrError("durations[" + std::to_string(i) + "]: expected a finite non-negative time, got " +
                    std::to_string(durations[i]));
    }
  }
}

bool aliases_input(const Node& node) {
  return (node.kind == NodeKind::View || node.kind == NodeKind::Wait) && !node.inputs.empty();
}

// Splits a path into digit and non-digit runs and compares digit runs by value, so that
// layers.2 < layers.10; equal-valued runs (07 vs 7) fall back to plain order for a total order.
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])) != 0;
    const bool db = std::isdigit(static_cast<unsigned char>(b[j])) != 0;
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      size_t is = i, js = j;
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      const std::string_view ra(a.data() + is, ie - is), rb(b.data() + js, je - js);
      if (ra.size() != rb.size()) return ra.size() < rb.size();
      if (ra != rb) return ra < rb;
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i;
    ++j;
  }
  if ((a.size() - i) != (b.size() - j)) return (a.size() - i) < (b.size() - j);
  return a < b;
}

}  // namespace

std::vector<int> topological_order(const Graph& g) {
  check_inputs_in_range(g);
  std::vector<int> order, cycle;
  if (!detail::stable_topological_order(g, order, cycle)) {
    throw IrError(graph_label(g) + ": dependency cycle through nodes " + detail::describe_cycle(g, cycle));
  }
  return order;
}

void check_order(const Graph& g, const std::vector<int>& order) {
  check_inputs_in_range(g);
  const int n = static_cast<int>(g.nodes.size());
  if (order.size() != g.nodes.size()) {
    throw IrError("order: expected " + std::to_string(n) + " node ids (every node of " + graph_label(g) +
                  " once), got " + std::to_string(order.size()));
  }
  std::vector<int> position(n, -1);
  for (int i = 0; i < n; ++i) {
    const int v = order[i];
    if (v < 0 || v >= n) {
      throw IrError("order[" + std::to_string(i) + "]: node id " + std::to_string(v) + " out of range [0, " +
                    std::to_string(n) + ")");
    }
    if (position[v] >= 0) {
      throw IrError("order[" + std::to_string(i) + "]: " + node_label(g, v) + " appears twice (also order[" +
                    std::to_string(position[v]) + "])");
    }
    position[v] = i;
  }
  for (int i = 0; i < n; ++i) {
    const int v = order[i];
    for (int input : g.nodes[v].inputs) {
      if (position[input] > i) {
        throw IrError("order[" + std::to_string(i) + "]: " + node_label(g, v) + " runs before its input " +
                      node_label(g, input) + " at order[" + std::to_string(position[input]) + "]");
      }
    }
  }
}

CriticalPath critical_path(const Graph& g, const std::vector<double>& durations) {
  check_durations(g, durations);
  const std::vector<int> order = topological_order(g);
  const int n = static_cast<int>(g.nodes.size());
  std::vector<double> finish(n, 0);
  std::vector<int> via(n, -1);  // the input on the longest path into each node
  int last = -1;
  for (int v : order) {
    double best_input = 0;
    for (int input : g.nodes[v].inputs) {
      if (via[v] < 0 || finish[input] > best_input) {
        best_input = finish[input];
        via[v] = input;
      }
    }
    finish[v] = best_input + durations[v];
    if (last < 0 || finish[v] > finish[last] || (finish[v] == finish[last] && v < last)) last = v;
  }
  CriticalPath result;
  if (last < 0) return result;
  result.length = finish[last];
  for (int v = last; v >= 0; v = via[v]) result.nodes.push_back(v);
  std::reverse(result.nodes.begin(), result.nodes.end());
  return result;
}

int storage_owner(const Graph& g, int node_id) {
  const int n = static_cast<int>(g.nodes.size());
  if (node_id < 0 || node_id >= n) {
    throw IrError(graph_label(g) + ": node id " + std::to_string(node_id) + " out of range [0, " +
                  std::to_string(n) + ")");
  }
  int cur = node_id;
  // A chain longer than the graph can only be a cycle; stop rather than spin.
  for (int steps = 0; aliases_input(g.nodes[cur]); ++steps) {
    const int next = g.nodes[cur].inputs[0];
    if (steps >= n || next < 0 || next >= n) {
      throw IrError(graph_label(g) + ": alias chain from " + node_label(g, node_id) + " is broken or cyclic");
    }
    cur = next;
  }
  return cur;
}

int waited_collective(const Graph& g, int node_id) {
  const int n = static_cast<int>(g.nodes.size());
  if (node_id < 0 || node_id >= n) {
    throw IrError(graph_label(g) + ": node id " + std::to_string(node_id) + " out of range [0, " +
                  std::to_string(n) + ")");
  }
  const Node& wait = g.nodes[node_id];
  if (wait.kind != NodeKind::Wait || wait.inputs.empty()) return -1;
  int cur = wait.inputs[0];
  for (int steps = 0; cur >= 0 && cur < n && steps <= n; ++steps) {
    const Node& node = g.nodes[cur];
    if (node.kind == NodeKind::Collective) return cur;
    if (node.kind != NodeKind::View || node.inputs.empty()) return -1;
    cur = node.inputs[0];
  }
  return -1;
}

void detect_blocks(Document& doc) {
  // Intern module types and paths: stacks repeat the same few hundred strings across 10k+ nodes.
  std::unordered_map<std::string_view, int> type_ids, path_ids;
  std::vector<const std::string*> type_names, path_names;
  auto intern = [](std::unordered_map<std::string_view, int>& ids, std::vector<const std::string*>& names,
                   const std::string& s) {
    auto [it, inserted] = ids.emplace(s, static_cast<int>(names.size()));
    if (inserted) names.push_back(&s);
    return it->second;
  };
  // Consecutive nodes nearly always share a stack; intern each run of equal stacks once.
  struct StackRun {
    std::vector<std::pair<int, int>> entries;  // (type id, path id), outermost first
    int64_t num_nodes = 0;
  };
  std::vector<StackRun> runs;
  std::vector<int> run_of_node;  // per node, all graphs in order
  std::vector<std::vector<int>> type_paths;  // per type: distinct instance paths
  std::unordered_set<int64_t> seen_instances;
  const std::vector<std::pair<std::string, std::string>>* previous_stack = nullptr;
  for (const Graph& g : doc.graphs) {
    for (const Node& node : g.nodes) {
      if (previous_stack == nullptr || *previous_stack != node.module_stack) {
        StackRun run;
        for (const auto& [path, type] : node.module_stack) {
          const int t = intern(type_ids, type_names, type);
          const int p = intern(path_ids, path_names, path);
          if (t >= static_cast<int>(type_paths.size())) type_paths.resize(t + 1);
          if (seen_instances.insert((static_cast<int64_t>(t) << 32) | p).second) type_paths[t].push_back(p);
          run.entries.emplace_back(t, p);
        }
        runs.push_back(std::move(run));
        previous_stack = &node.module_stack;
      }
      ++runs.back().num_nodes;
      run_of_node.push_back(static_cast<int>(runs.size()) - 1);
    }
  }
  // Coverage counts a node once per type even if its stack holds that type twice.
  std::vector<int64_t> coverage(type_paths.size(), 0);
  std::vector<int> last_counted_run(type_paths.size(), -1);
  for (int r = 0; r < static_cast<int>(runs.size()); ++r) {
    for (const auto& [t, p] : runs[r].entries) {
      if (last_counted_run[t] == r) continue;
      last_counted_run[t] = r;
      coverage[t] += runs[r].num_nodes;
    }
  }

  int best = -1;
  for (int t = 0; t < static_cast<int>(type_paths.size()); ++t) {
    const auto& paths = type_paths[t];
    if (paths.size() < 2) continue;
    // Nested instances of one type (a Sequential inside a Sequential) are not a flat block list.
    std::unordered_set<std::string_view> own_paths;
    for (int p : paths) own_paths.insert(*path_names[p]);
    bool nested = own_paths.count(std::string_view()) > 0;
    for (size_t k = 0; k < paths.size() && !nested; ++k) {
      const std::string& q = *path_names[paths[k]];
      for (size_t dot = q.find('.'); dot != std::string::npos && !nested; dot = q.find('.', dot + 1)) {
        nested = own_paths.count(std::string_view(q.data(), dot)) > 0;
      }
    }
    if (nested) continue;
    if (best < 0 || coverage[t] > coverage[best] ||
        (coverage[t] == coverage[best] &&
         (paths.size() < type_paths[best].size() ||
          (paths.size() == type_paths[best].size() && *type_names[t] < *type_names[best])))) {
      best = t;
    }
  }

  doc.blocks.clear();
  std::vector<int> block_of_path(path_names.size(), -1);
  if (best >= 0) {
    std::vector<int> paths = type_paths[best];
    std::sort(paths.begin(), paths.end(),
              [&](int a, int b) { return natural_less(*path_names[a], *path_names[b]); });
    for (int p : paths) {
      block_of_path[p] = static_cast<int>(doc.blocks.size());
      Block block;
      block.id = static_cast<int>(doc.blocks.size());
      block.path = *path_names[p];
      block.type = *type_names[best];
      doc.blocks.push_back(std::move(block));
    }
  }
  // The outermost chosen instance on a stack names the node's block.
  std::vector<int> block_of_run(runs.size(), -1);
  for (size_t r = 0; r < runs.size() && best >= 0; ++r) {
    for (const auto& [t, p] : runs[r].entries) {
      if (t != best) continue;
      block_of_run[r] = block_of_path[p];
      break;
    }
  }
  size_t node_index = 0;
  for (Graph& g : doc.graphs) {
    for (Node& node : g.nodes) node.block = block_of_run[run_of_node[node_index++]];
  }
}

namespace detail {

void liveness_peak(const LivenessItems& items, MemoryEstimate& result) {
  const int n = static_cast<int>(items.size());
  const int kLiveToEnd = n;  // past the last position: never freed
  std::vector<int> last_use(n);
  for (int i = 0; i < n; ++i) last_use[i] = i;  // unused outputs die right after their item
  for (int i = 0; i < n; ++i) {
    const bool is_output = items.is_output[i] != 0;
    for (int k = items.input_offsets[i]; k < items.input_offsets[i + 1]; ++k) {
      int& last = last_use[items.owner[items.inputs[k]]];
      last = is_output ? kLiveToEnd : std::max(last, i);
    }
  }
  std::vector<int64_t> freed_bytes_at(n, 0);  // per position
  for (int i = 0; i < n; ++i) {
    if (items.alloc_bytes[i] != 0 && last_use[i] != kLiveToEnd) freed_bytes_at[last_use[i]] += items.alloc_bytes[i];
  }
  result.peak_bytes = 0;
  result.peak_node = -1;
  result.live_bytes_after.assign(n, 0);
  int64_t live_bytes = 0;
  for (int i = 0; i < n; ++i) {
    // While an item runs its inputs are still held and its outputs already exist.
    const int64_t running_bytes = live_bytes + items.alloc_bytes[i];
    if (result.peak_node < 0 || running_bytes > result.peak_bytes) {
      result.peak_bytes = running_bytes;
      result.peak_node = i;
    }
    live_bytes = running_bytes - freed_bytes_at[i];
    result.live_bytes_after[i] = live_bytes;
  }
}

}  // namespace detail

MemoryEstimate peak_memory(const Graph& g, const std::vector<int>& order) {
  check_order(g, order);
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> position(n);
  for (int i = 0; i < n; ++i) position[order[i]] = i;

  MemoryEstimate result;
  detail::LivenessItems items;
  items.alloc_bytes.resize(n);
  items.owner.resize(n);
  items.is_output.resize(n);
  items.input_offsets.reserve(n + 1);
  // Owners are resolved in order, so a view's input already knows its owner.
  for (int i = 0; i < n; ++i) {
    const Node& node = g.nodes[order[i]];
    const bool alias = aliases_input(node);
    items.owner[i] = alias ? items.owner[position[node.inputs[0]]] : i;
    items.is_output[i] = node.op == "output";
    if (node.op == "placeholder") {
      result.input_bytes += node.output_bytes();
    } else if (!alias && !items.is_output[i]) {
      items.alloc_bytes[i] = node.output_bytes();  // views, waits and the output take no new memory
    }
    for (int input : node.inputs) items.inputs.push_back(position[input]);
    // A collective reads its inputs until it completes, and the graph learns that only at the wait: NCCL's
    // functional collectives keep them stashed until wait_tensor, ce_overlap's wait keeps them alive. So a wait
    // uses its collective's inputs too (a reduce-scatter's input held until a sunk wait is real memory).
    const int waited = node.kind == NodeKind::Wait ? waited_collective(g, order[i]) : -1;
    if (waited >= 0) {
      for (int input : g.nodes[waited].inputs) items.inputs.push_back(position[input]);
    }
    items.input_offsets.push_back(static_cast<int>(items.inputs.size()));
  }
  detail::liveness_peak(items, result);
  if (result.peak_node >= 0) result.peak_node = order[result.peak_node];
  return result;
}

std::vector<FusionGroup> fusion_groups(const Graph& g) {
  // Positions, not Node::id: the loader guarantees they agree, graphs built in memory need not.
  const int n = static_cast<int>(g.nodes.size());
  auto fusible = [&](int i) { return g.nodes[i].kind == NodeKind::Compute && g.nodes[i].flops == 0; };
  auto member = [&](int i) { return fusible(i) || g.nodes[i].kind == NodeKind::View; };
  // Union-find over producer -> consumer edges between members.
  std::vector<int> parent(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) parent[i] = i;
  auto find = [&](int x) {
    while (parent[x] != x) {
      parent[x] = parent[parent[x]];
      x = parent[x];
    }
    return x;
  };
  std::vector<std::vector<int>> users(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    for (int in : g.nodes[i].inputs) {
      if (in < 0 || in >= n) throw IrError("fusion_groups: node " + std::to_string(i) + " has input " +
                                           std::to_string(in) + " outside the graph");
      users[in].push_back(i);
    }
  }
  // Inductor never fuses two nodes with a kernel of another kind between them (a GEMM, attention, a collective or
  // its wait on a path from one to the other): the fused kernel would have to run both before and after it. Without
  // this rule the residual adds and RMSNorms of every layer joined one group (2 kernels where Inductor runs 75 at 8
  // layers). Per node, the set of such nodes before it (anc) and after it (desc), as bitsets in node order (the
  // loader's order has every input first); two groups join only if neither's nodes lie before a barrier that lies
  // before the other's. Past kMaxBarrierBits (a graph far larger than a training step's) the groups join by edges.
  auto barrier = [&](int i) {
    const NodeKind k = g.nodes[i].kind;
    return !member(i) && (k == NodeKind::Compute || k == NodeKind::Collective || k == NodeKind::Wait);
  };
  std::vector<int> bit(static_cast<size_t>(n), -1);
  int barriers = 0;
  for (int i = 0; i < n; ++i) {
    if (barrier(i)) bit[i] = barriers++;
  }
  constexpr int64_t kMaxBarrierBits = int64_t{1} << 28;  // 32 MiB per direction
  const size_t words = static_cast<size_t>(barriers + 63) / 64;
  const bool paths = barriers > 0 && static_cast<int64_t>(n) * static_cast<int64_t>(words) * 64 <= kMaxBarrierBits;
  std::vector<uint64_t> anc, desc;  // node i's bits at [i * words, (i + 1) * words)
  auto set_of = [&](std::vector<uint64_t>& v, int i) { return v.data() + static_cast<size_t>(i) * words; };
  if (paths) {
    anc.assign(static_cast<size_t>(n) * words, 0);
    desc.assign(static_cast<size_t>(n) * words, 0);
    for (int i = 0; i < n; ++i) {
      uint64_t* a = set_of(anc, i);
      for (int in : g.nodes[i].inputs) {
        if (in >= i) continue;  // out of order (a graph built in memory): its paths are not followed
        const uint64_t* b = set_of(anc, in);
        for (size_t w = 0; w < words; ++w) a[w] |= b[w];
        if (bit[in] >= 0) a[bit[in] / 64] |= uint64_t{1} << (bit[in] % 64);
      }
    }
    for (int i = n - 1; i >= 0; --i) {
      uint64_t* d = set_of(desc, i);
      for (int u : users[i]) {
        if (u <= i) continue;
        const uint64_t* b = set_of(desc, u);
        for (size_t w = 0; w < words; ++w) d[w] |= b[w];
        if (bit[u] >= 0) d[bit[u] / 64] |= uint64_t{1} << (bit[u] % 64);
      }
    }
  }
  // A group's sets live at its root's index (after the pass above, only roots' entries are read).
  auto crosses = [&](int x, int y) {
    const uint64_t *ax = set_of(anc, x), *dx = set_of(desc, x), *ay = set_of(anc, y), *dy = set_of(desc, y);
    for (size_t w = 0; w < words; ++w) {
      if ((ax[w] & dy[w]) | (ay[w] & dx[w])) return true;
    }
    return false;
  };
  // A reduction over leading dimensions (a bias or norm weight's gradient: the sum over tokens of a [tokens, width]
  // tensor) iterates its input column-wise, where the pointwise kernel producing that input iterates it row by row:
  // Inductor runs it as a kernel of its own, which reads the input again (the GPT-2 and ViT traces on an H200: a
  // separate `triton_red_fused_..._sum` per bias, bench/results/compute-models-2026-12-01). Such a node joins no
  // producer's group; its consumers may join it.
  auto column_reduction = [&](int i) {
    const Node& node = g.nodes[i];
    if (node.kind != NodeKind::Compute || node.inputs.empty() || node.outputs.empty()) return false;
    if (node.op.rfind("aten.sum.", 0) != 0 && node.op.rfind("aten.mean.", 0) != 0) return false;
    const Node& src = g.nodes[node.inputs.front()];
    if (src.outputs.empty()) return false;
    const std::vector<int64_t>& in = src.outputs.front().shape;
    const std::vector<int64_t>& out = node.outputs.front().shape;
    if (in.size() < 2 || out.empty() || out.back() != in.back() || in.back() <= 1) return false;
    int64_t in_numel = 1, out_numel = 1;
    for (int64_t d : in) in_numel *= d;
    for (int64_t d : out) out_numel *= d;
    return out_numel < in_numel;
  };
  for (int i = 0; i < n; ++i) {
    if (!member(i) || column_reduction(i)) continue;
    for (int in : g.nodes[i].inputs) {
      if (!member(in)) continue;
      const int ri = find(i), rin = find(in);
      if (ri == rin) continue;
      if (paths && crosses(ri, rin)) continue;
      parent[rin] = ri;
      if (paths) {
        uint64_t *a = set_of(anc, ri), *d = set_of(desc, ri);
        const uint64_t *a2 = set_of(anc, rin), *d2 = set_of(desc, rin);
        for (size_t w = 0; w < words; ++w) {
          a[w] |= a2[w];
          d[w] |= d2[w];
        }
      }
    }
  }
  // Members by group root, in node order.
  std::unordered_map<int, std::vector<int>> by_root;
  std::vector<int> roots;
  for (int i = 0; i < n; ++i) {
    if (!member(i)) continue;
    auto [it, inserted] = by_root.try_emplace(find(i));
    if (inserted) roots.push_back(find(i));
    it->second.push_back(i);
  }
  auto inside = [&](int x, int root) { return member(x) && find(x) == root; };
  std::vector<FusionGroup> groups;
  for (int r : roots) {
    FusionGroup fg;
    std::unordered_set<int> read_producers;  // outside producers already counted
    std::unordered_set<int> escaping;        // compute members whose output leaves the group
    for (int m : by_root[r]) {
      const Node& node = g.nodes[m];
      if (node.kind == NodeKind::Compute) fg.compute_nodes.push_back(m);
      for (int in : node.inputs) {
        if (inside(in, r)) continue;
        if (node.kind == NodeKind::View) {
          fg.bytes_in += node.output_bytes();  // the group reads the viewed part, once per view
        } else if (read_producers.insert(in).second) {
          fg.bytes_in += g.nodes[in].output_bytes();
        }
      }
      const bool leaves = users[m].empty() ||
                          std::any_of(users[m].begin(), users[m].end(), [&](int u) { return !inside(u, r); });
      if (!leaves) continue;
      // A view read outside the group makes the compute members it aliases write their outputs.
      std::vector<int> stack{m};
      while (!stack.empty()) {
        const int x = stack.back();
        stack.pop_back();
        if (g.nodes[x].kind == NodeKind::Compute) {
          escaping.insert(x);
          continue;
        }
        for (int in : g.nodes[x].inputs) {
          if (inside(in, r)) stack.push_back(in);
        }
      }
    }
    if (fg.compute_nodes.empty()) continue;
    for (int m : fg.compute_nodes) {
      if (escaping.count(m)) fg.bytes_out += g.nodes[m].output_bytes();
    }
    groups.push_back(std::move(fg));
  }
  return groups;
}

namespace {

// One pass of simulate() with these collective durations.
Timeline simulate_pass(const Graph& g, const std::vector<int>& order, const std::vector<double>& durations_us) {
  const int n = static_cast<int>(g.nodes.size());

  // A view of a collective's output that no wait has released yet (getitem of a coalesced
  // collective) is pure bookkeeping: it must not hold the compute stream until the collective ends,
  // only its data does. `pending` marks such views; their readiness passes on to the wait.
  std::vector<char> pending(n, 0);
  auto carries_collective = [&](int v) { return g.nodes[v].kind == NodeKind::Collective || pending[v]; };
  for (int v : order) {
    const Node& node = g.nodes[v];
    pending[v] = node.kind == NodeKind::View && !node.inputs.empty() && carries_collective(node.inputs[0]);
  }

  Timeline timeline;
  timeline.exposed_us_by_collective.assign(n, 0.0);
  std::vector<double> ready_us(n, 0.0);  // when each node's output can be used
  double compute_free_us = 0;
  std::unordered_map<std::string, double> comm_free_us;  // per process group
  for (int v : order) {
    const Node& node = g.nodes[v];
    const double duration_us = durations_us[v];
    if (node.kind == NodeKind::Collective) {
      const std::string group = node.collective ? node.collective->group : std::string();
      double& stream_free_us = comm_free_us[group];
      double start_us = std::max(stream_free_us, compute_free_us);
      for (int input : node.inputs) start_us = std::max(start_us, ready_us[input]);
      const double end_us = start_us + duration_us;
      stream_free_us = end_us;
      ready_us[v] = end_us;
      timeline.comm_busy_us += duration_us;
      timeline.events.push_back({v, Stream::Comm, start_us, end_us});
      timeline.makespan_us = std::max(timeline.makespan_us, end_us);
      continue;
    }
    const bool gates_on_collective = node.kind == NodeKind::Wait || pending[v];
    double unblocked_us = compute_free_us;  // when the stream could start it, collectives aside
    double collective_ready_us = 0;
    for (int input : node.inputs) {
      if (gates_on_collective && carries_collective(input)) {
        collective_ready_us = std::max(collective_ready_us, ready_us[input]);
      } else {
        unblocked_us = std::max(unblocked_us, ready_us[input]);
      }
    }
    double start_us = unblocked_us;
    if (node.kind == NodeKind::Wait) {
      start_us = std::max(unblocked_us, collective_ready_us);
      const int collective = waited_collective(g, v);
      if (collective >= 0) timeline.exposed_us_by_collective[collective] += start_us - unblocked_us;
    }
    const double end_us = start_us + duration_us;
    compute_free_us = end_us;
    ready_us[v] = pending[v] ? std::max(end_us, collective_ready_us) : end_us;
    timeline.compute_busy_us += duration_us;
    if (duration_us > 0) timeline.events.push_back({v, Stream::Compute, start_us, end_us});
  }
  timeline.makespan_us = std::max(timeline.makespan_us, compute_free_us);
  return timeline;
}

// The overlapping pairs of collectives of different groups in `t` whose link shares sum above 1, with what each
// gains (SimulateOptions::link_share).
std::vector<CollectiveOverlap> link_overlaps(const Graph& g, const Timeline& t, const std::vector<double>& share) {
  std::vector<const TimelineEvent*> comm;
  for (const TimelineEvent& e : t.events) {
    if (e.stream == Stream::Comm && e.end_us > e.start_us && share[e.node] > 0) comm.push_back(&e);
  }
  std::stable_sort(comm.begin(), comm.end(),
                   [](const TimelineEvent* x, const TimelineEvent* y) { return x->start_us < y->start_us; });
  std::vector<CollectiveOverlap> out;
  for (size_t i = 0; i < comm.size(); ++i) {
    const TimelineEvent& a = *comm[i];
    for (size_t j = i + 1; j < comm.size() && comm[j]->start_us < a.end_us; ++j) {
      const TimelineEvent& b = *comm[j];
      if (g.nodes[a.node].collective->group == g.nodes[b.node].collective->group) continue;
      const double overlap = std::min(a.end_us, b.end_us) - b.start_us;
      const double sum = share[a.node] + share[b.node];
      if (overlap <= 0 || sum <= 1) continue;
      const double added = overlap * (1 - 1 / sum);
      out.push_back({a.node, b.node, overlap, added, added});
    }
  }
  return out;
}

}  // namespace

Timeline simulate(const Graph& g, const std::vector<int>& order, const std::vector<double>& durations_us,
                  const SimulateOptions& options) {
  check_order(g, order);
  check_durations(g, durations_us);
  const int n = static_cast<int>(g.nodes.size());
  if (!options.link_share.empty() && options.link_share.size() != static_cast<size_t>(n)) {
    throw IrError("simulate: link_share has " + std::to_string(options.link_share.size()) + " entries for " +
                  std::to_string(n) + " nodes");
  }
  Timeline timeline = simulate_pass(g, order, durations_us);
  if (options.link_share.empty()) return timeline;
  std::vector<CollectiveOverlap> overlaps = link_overlaps(g, timeline, options.link_share);
  if (overlaps.empty()) return timeline;
  std::vector<double> shared = durations_us;
  for (const CollectiveOverlap& o : overlaps) {
    shared[o.a] += o.added_a_us;
    shared[o.b] += o.added_b_us;
  }
  timeline = simulate_pass(g, order, shared);
  timeline.overlaps = std::move(overlaps);
  return timeline;
}

}  // namespace ce_overlap
