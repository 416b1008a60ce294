// The planner's list scheduler: per-node priority keys, lowered to their users' keys, then a
// priority-queue topological sort over units (a bucket's collectives are one unit, its waits another).
#include "schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <queue>
#include <tuple>

#include "analysis.h"
#include "graph_internal.h"

namespace ce_overlap {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Where a unit wants to run: `primary` is a position in the captured order (fractions fall between
// nodes, -inf first, +inf last), `secondary` breaks ties (normally a node id).
struct Key {
  double primary = 0;
  int secondary = 0;
};
bool operator<(const Key& a, const Key& b) {
  return a.primary < b.primary || (a.primary == b.primary && a.secondary < b.secondary);
}

bool is_multi(const Bucket& b) { return b.planned && b.members.size() > 1; }

// Units: every node on its own, except that a planned bucket of several members merges its
// collectives into one unit and its waits into another. Edges follow the node inputs.
struct Units {
  int count = 0;
  std::vector<int> unit_of;                 // node -> unit
  std::vector<int> node_offsets{0}, nodes;  // unit -> its nodes, in emit order
  std::vector<int> user_offsets, users;     // unit -> user units (duplicates kept)
  std::vector<int> in_degree;
  std::vector<int> collective_unit, wait_unit;  // per bucket (-1: none)
  std::vector<int> first_node;                  // per unit: smallest node id (the final tie-break)
  std::vector<int> topo;                        // units in a topological order
};

// An ordering constraint of the scheduler's own (not a data edge): node `second` runs after node `first`.
using After = std::pair<int, int>;

// Builds the units (with the `after` constraints as edges); returns false (units.topo partial) when merging, or a
// constraint, made a cycle.
bool build_units(const Graph& g, const std::vector<Bucket>& buckets, Units& u, const std::vector<After>& after = {}) {
  const int n = static_cast<int>(g.nodes.size());
  u = Units();
  u.unit_of.assign(n, -1);
  u.collective_unit.assign(buckets.size(), -1);
  u.wait_unit.assign(buckets.size(), -1);
  auto add_unit = [&](const std::vector<int>& members) {
    const int id = u.count++;
    for (int v : members) {
      u.unit_of[v] = id;
      u.nodes.push_back(v);
    }
    u.node_offsets.push_back(static_cast<int>(u.nodes.size()));
    return id;
  };
  for (size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& bucket = buckets[b];
    if (!is_multi(bucket)) continue;
    u.collective_unit[b] = add_unit(bucket.members);
    u.wait_unit[b] = add_unit(bucket.waits);
  }
  for (int v = 0; v < n; ++v) {
    if (u.unit_of[v] < 0) add_unit({v});
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (is_multi(buckets[b])) continue;
    u.collective_unit[b] = u.unit_of[buckets[b].members[0]];
    if (buckets[b].waits[0] >= 0) u.wait_unit[b] = u.unit_of[buckets[b].waits[0]];
  }
  u.first_node.assign(u.count, std::numeric_limits<int>::max());
  for (int v = 0; v < n; ++v) u.first_node[u.unit_of[v]] = std::min(u.first_node[u.unit_of[v]], v);

  u.user_offsets.assign(u.count + 1, 0);
  u.in_degree.assign(u.count, 0);
  for (int v = 0; v < n; ++v) {
    for (int input : g.nodes[v].inputs) {
      if (u.unit_of[input] != u.unit_of[v]) ++u.user_offsets[u.unit_of[input] + 1];
    }
  }
  for (const After& a : after) {
    if (u.unit_of[a.first] != u.unit_of[a.second]) ++u.user_offsets[u.unit_of[a.first] + 1];
  }
  for (int i = 0; i < u.count; ++i) u.user_offsets[i + 1] += u.user_offsets[i];
  u.users.resize(u.user_offsets[u.count]);
  std::vector<int> fill(u.user_offsets.begin(), u.user_offsets.end() - 1);
  auto edge = [&](int from_unit, int to_unit) {
    if (from_unit == to_unit) return;
    u.users[fill[from_unit]++] = to_unit;
    ++u.in_degree[to_unit];
  };
  for (int v = 0; v < n; ++v) {
    for (int input : g.nodes[v].inputs) edge(u.unit_of[input], u.unit_of[v]);
  }
  for (const After& a : after) edge(u.unit_of[a.first], u.unit_of[a.second]);
  std::vector<int> degree = u.in_degree;
  u.topo.clear();
  u.topo.reserve(u.count);
  for (int i = 0; i < u.count; ++i) {
    if (degree[i] == 0) u.topo.push_back(i);
  }
  for (size_t k = 0; k < u.topo.size(); ++k) {
    const int x = u.topo[k];
    for (int e = u.user_offsets[x]; e < u.user_offsets[x + 1]; ++e) {
      if (--degree[u.users[e]] == 0) u.topo.push_back(u.users[e]);
    }
  }
  return static_cast<int>(u.topo.size()) == u.count;
}

// Each member of `whole` a bucket of its own (its bytes and block its collective's), in member order.
std::vector<Bucket> split_bucket(const Graph& g, const Bucket& whole) {
  std::vector<Bucket> parts;
  for (size_t k = 0; k < whole.members.size(); ++k) {
    Bucket part = whole;
    part.members = {whole.members[k]};
    part.waits = {whole.waits[k]};
    part.bytes = g.nodes[whole.members[k]].collective->bytes;
    part.block = g.nodes[whole.members[k]].block;
    parts.push_back(std::move(part));
  }
  return parts;
}

// Every member of `buckets` a bucket of its own, in the same order.
std::vector<Bucket> singletons(const Graph& g, const std::vector<Bucket>& buckets) {
  std::vector<Bucket> singles;
  for (const Bucket& b : buckets) {
    for (Bucket& part : split_bucket(g, b)) singles.push_back(std::move(part));
  }
  return singles;
}

// Splits into singletons the first merged bucket that a cycle runs through (units left by Kahn).
void split_a_cyclic_bucket(const Graph& g, std::vector<Bucket>& buckets, const Units& u) {
  std::vector<char> done(u.count, 0);
  for (int x : u.topo) done[x] = 1;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (!is_multi(buckets[b])) continue;
    if (done[u.collective_unit[b]] && done[u.wait_unit[b]]) continue;
    const std::vector<Bucket> parts = split_bucket(g, buckets[b]);
    buckets.erase(buckets.begin() + static_cast<long>(b));
    buckets.insert(buckets.begin() + static_cast<long>(b), parts.begin(), parts.end());
    return;
  }
  throw IrError("planner: a cycle without merged buckets (the graph is not acyclic)");
}

// Block order as the graph runs them: each block's first and last compute or collective node.
struct BlockSpans {
  std::vector<int> sequence;      // block ids by start
  std::vector<int> start, end;    // per position in sequence
  std::vector<int> index_of;      // block id -> position in sequence (-1: none)
};

BlockSpans block_spans(const Graph& g) {
  int max_block = -1;
  for (const Node& node : g.nodes) max_block = std::max(max_block, node.block);
  std::vector<int> first(max_block + 1, -1), last(max_block + 1, -1);
  for (const Node& node : g.nodes) {
    if (node.block < 0 || (node.kind != NodeKind::Compute && node.kind != NodeKind::Collective)) continue;
    if (first[node.block] < 0) first[node.block] = node.id;
    last[node.block] = node.id;
  }
  BlockSpans s;
  s.index_of.assign(max_block + 1, -1);
  for (int b = 0; b <= max_block; ++b) {
    if (first[b] >= 0) s.sequence.push_back(b);
  }
  std::sort(s.sequence.begin(), s.sequence.end(), [&](int a, int b) { return first[a] < first[b]; });
  for (size_t i = 0; i < s.sequence.size(); ++i) {
    s.index_of[s.sequence[i]] = static_cast<int>(i);
    s.start.push_back(first[s.sequence[i]]);
    s.end.push_back(last[s.sequence[i]]);
  }
  return s;
}

// The position an all-gather bucket is issued at with `prefetch` blocks of prefetch: the start of
// the block `prefetch` blocks before the one it serves (-0.5: the graph start, after placeholders).
double prefetch_target(const Bucket& b, const BlockSpans& spans, int prefetch) {
  const int q = b.members.front();
  if (prefetch <= 0 || spans.sequence.empty()) return q;
  int target_index;
  if (b.block >= 0 && b.block < static_cast<int>(spans.index_of.size()) && spans.index_of[b.block] >= 0) {
    target_index = spans.index_of[b.block] - prefetch;
  } else {
    // Outside blocks: inside the span of the last block started before it, or in the gap after it
    // (which counts as one block of its own: the output projection after the last block is
    // prefetched to that block's start).
    const int j = static_cast<int>(std::upper_bound(spans.start.begin(), spans.start.end(), q) - spans.start.begin()) - 1;
    const bool inside = j >= 0 && q <= spans.end[j];
    target_index = inside ? j - prefetch : j - prefetch + 1;
  }
  const double target = target_index >= 0 ? spans.start[target_index] - 0.5 : -0.5;
  return std::min<double>(target, q);
}

struct Scheduler {
  const Graph& g;
  const std::vector<Bucket>& buckets;
  const Units& u;
  BlockSpans spans;
  std::vector<char> sunk;         // per node: sinks to its first user
  // Per node: the latest anchor it is, or depends on through other nodes (-1: none). Anchors are the nodes every rank's
  // graph has in one order: all but views and layout ops (is_layout_op: pads, concatenations, clones), which differ
  // where shards are uneven. A key placed by one of those ordered one group's collectives differently on two ranks
  // (a 2x2 TP mesh with activation checkpointing and an uneven vocabulary: a data-parallel reduce-scatter read a
  // padded concatenation on one rank only, captured after the next GEMM; inductor/agreement.py checks what remains).
  std::vector<int> anchor;

  Scheduler(const Graph& graph, const std::vector<Bucket>& bs, const Units& units)
      : g(graph), buckets(bs), u(units), spans(block_spans(graph)) {
    const int n = static_cast<int>(g.nodes.size());
    sunk.assign(n, 0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (!buckets[b].planned) continue;
      for (int w : buckets[b].waits) {
        if (w >= 0) sunk[w] = 1;
      }
    }
    anchor.assign(n, -1);
    for (int v = 0; v < n; ++v) {  // ids are a topological order (validated IR): inputs are settled first
      const Node& node = g.nodes[v];
      if (node.kind != NodeKind::View && !is_layout_op(node.op)) {
        anchor[v] = v;
        continue;
      }
      for (int input : node.inputs) anchor[v] = std::max(anchor[v], anchor[input]);
    }
    // Ids are a topological order (validated IR), so inputs are settled first.
    for (int v = 0; v < n; ++v) {
      const Node& node = g.nodes[v];
      if (sunk[v] || node.inputs.empty() || node.kind == NodeKind::Collective || node.op == "placeholder" ||
          node.op == "output") {
        continue;
      }
      bool all = true;
      for (int input : node.inputs) all = all && sunk[input];
      sunk[v] = all;
    }
  }

  // bounded[b]: the wait of reduce-scatter bucket b goes right after the next reduce-scatter bucket's issue
  // instead of sinking to its first user (the memory budget: a collective's input lives until its wait).
  std::vector<Key> own_keys(const std::vector<int>& prefetch, bool captured,
                            const std::vector<char>& bounded = {}) const {
    std::vector<Key> key(u.count);
    for (int x = 0; x < u.count; ++x) {
      const int v = u.nodes[u.node_offsets[x]];
      const Node& node = g.nodes[v];
      if (node.op == "placeholder") {
        key[x] = {-kInf, v};
      } else if (node.op == "output") {
        key[x] = {kInf, std::numeric_limits<int>::max()};
      } else if (captured) {
        key[x] = {static_cast<double>(v), v};
      } else if (sunk[v]) {
        key[x] = {kInf, u.first_node[x]};
      } else {
        key[x] = {static_cast<double>(v), v};
      }
    }
    if (captured) return key;
    double previous_all_gather = -kInf;
    for (size_t b = 0; b < buckets.size(); ++b) {  // in order of first member
      const Bucket& bucket = buckets[b];
      if (!bucket.planned) continue;
      const int first = bucket.members.front();
      double primary;
      // A tensor-parallel all-gather gathers an activation its block computes just before: issued as soon as it can
      // be, never prefetched (and not in the chain that keeps the data-parallel all-gathers in order).
      if (bucket.type == CollectiveType::AllGather && bucket.role != CollectiveRole::TensorParallel) {
        primary = std::max(prefetch_target(bucket, spans, prefetch[b]), previous_all_gather);
        previous_all_gather = primary;
      } else {
        // As soon as its inputs are ready: right after the last anchor they depend on in the captured order.
        int last_anchor = -1;
        for (int m : bucket.members) {
          for (int input : g.nodes[m].inputs) last_anchor = std::max(last_anchor, anchor[input]);
        }
        primary = last_anchor >= 0 ? last_anchor + 0.5 : first;
      }
      key[u.collective_unit[b]] = {primary, first};
    }
    // HSDP's all-reduce of a reduce-scatter's result goes out once the next reduce-scatter is issued: by then its
    // input is done, so the compute stream does not wait for the reduce-scatter where the all-reduce is issued.
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (!buckets[b].planned || buckets[b].role != CollectiveRole::Replicate) continue;
      const int source = reduce_scatter_feeding(b);
      const int next = source >= 0 ? next_reduce_scatter(static_cast<size_t>(source)) : -1;
      if (next < 0) continue;
      const Key issue = key[u.collective_unit[next]];
      key[u.collective_unit[b]] = {issue.primary + 0.3, issue.secondary};
    }
    for (size_t b = 0; b < bounded.size(); ++b) {
      if (!bounded[b] || u.wait_unit[b] < 0) continue;
      const int next = next_reduce_scatter(b);
      if (next < 0) continue;
      const Key issue = key[u.collective_unit[next]];
      key[u.wait_unit[b]] = {issue.primary + 0.25, issue.secondary};
    }
    return key;
  }

  // The planned data-parallel reduce-scatter bucket whose waits feed bucket b's collectives (HSDP: the reduce-scatter
  // before a replica all-reduce), or -1.
  int reduce_scatter_feeding(size_t b) const {
    for (int m : buckets[b].members) {
      for (int input : g.nodes[m].inputs) {
        const int c = waited_collective(g, input);
        if (c < 0) continue;
        for (size_t r = 0; r < buckets.size(); ++r) {
          if (buckets[r].type == CollectiveType::ReduceScatter && buckets[r].role != CollectiveRole::TensorParallel &&
              std::find(buckets[r].members.begin(), buckets[r].members.end(), c) != buckets[r].members.end()) {
            return static_cast<int>(r);
          }
        }
      }
    }
    return -1;
  }

  // The planned data-parallel reduce-scatter bucket issued after bucket b (buckets are in order of first member), or
  // -1. Tensor parallelism's reduce-scatters are not FSDP's two in flight.
  int next_reduce_scatter(size_t b) const {
    for (size_t c = b + 1; c < buckets.size(); ++c) {
      if (buckets[c].planned && buckets[c].type == CollectiveType::ReduceScatter &&
          buckets[c].role != CollectiveRole::TensorParallel) {
        return static_cast<int>(c);
      }
    }
    return -1;
  }

  // Lowers keys to users' keys, then sorts topologically by key.
  std::vector<int> order_for(std::vector<Key> key) const {
    for (auto it = u.topo.rbegin(); it != u.topo.rend(); ++it) {
      const int x = *it;
      for (int e = u.user_offsets[x]; e < u.user_offsets[x + 1]; ++e) {
        if (key[u.users[e]] < key[x]) key[x] = key[u.users[e]];
      }
    }
    using Entry = std::tuple<double, int, int, int>;  // primary, secondary, first node, unit
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> ready;
    std::vector<int> degree = u.in_degree;
    for (int x = 0; x < u.count; ++x) {
      if (degree[x] == 0) ready.emplace(key[x].primary, key[x].secondary, u.first_node[x], x);
    }
    std::vector<int> order;
    order.reserve(g.nodes.size());
    while (!ready.empty()) {
      const int x = std::get<3>(ready.top());
      ready.pop();
      for (int k = u.node_offsets[x]; k < u.node_offsets[x + 1]; ++k) order.push_back(u.nodes[k]);
      for (int e = u.user_offsets[x]; e < u.user_offsets[x + 1]; ++e) {
        const int y = u.users[e];
        if (--degree[y] == 0) ready.emplace(key[y].primary, key[y].secondary, u.first_node[y], y);
      }
    }
    return order;
  }
};

// Whether node `v` depends on any of `sources` (walks v's inputs; ids are a topological order).
bool depends_on(const Graph& g, int v, const std::vector<int>& sources) {
  const int floor = *std::min_element(sources.begin(), sources.end());
  std::vector<char> seen(g.nodes.size(), 0), source(g.nodes.size(), 0);
  for (int x : sources) source[x] = 1;
  std::vector<int> stack{v};
  seen[v] = 1;
  while (!stack.empty()) {
    const int x = stack.back();
    stack.pop_back();
    if (source[x]) return true;
    for (int input : g.nodes[x].inputs) {
      if (input >= floor && !seen[input]) {
        seen[input] = 1;
        stack.push_back(input);
      }
    }
  }
  return false;
}

// The scheduler's constraints for tensor parallelism, from a first `order`: a data-parallel bucket (planned, not
// tensor-parallel) whose first collective is followed by a tensor-parallel collective before any compute with FLOPs
// (a GEMM, attention) runs after that collective's wait (the last such collective's, when several come together). In
// `notes`, per bucket so constrained, why.
std::vector<After> tp_aware_after(const Graph& g, const std::vector<Bucket>& buckets, const std::vector<int>& order,
                                  std::vector<std::string>& notes) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> tp_wait(n, -1);  // a tensor-parallel bucket's collective -> its wait
  bool any = false;
  for (const Bucket& b : buckets) {
    if (b.role != CollectiveRole::TensorParallel) continue;
    for (size_t k = 0; k < b.members.size(); ++k) tp_wait[b.members[k]] = b.waits[k];
    any = true;
  }
  std::vector<After> after;
  if (!any) return after;
  std::vector<int> pos(n);
  for (int i = 0; i < n; ++i) pos[order[i]] = i;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& bucket = buckets[b];
    if (!bucket.planned || bucket.role == CollectiveRole::TensorParallel) continue;
    int issue = n;
    for (int m : bucket.members) issue = std::min(issue, pos[m]);
    int last_wait = -1;
    for (int i = issue + 1; i < n; ++i) {
      const Node& node = g.nodes[order[i]];
      if (node.kind == NodeKind::Compute && node.flops > 0) break;
      if (node.kind == NodeKind::Collective && tp_wait[node.id] >= 0) last_wait = tp_wait[node.id];
    }
    // Not where the tensor-parallel collective needs the bucket (the embedding's gathered table feeds its lookup's
    // reduce-scatter): that order would be a cycle.
    if (last_wait < 0 || depends_on(g, last_wait, bucket.members)) continue;
    after.emplace_back(last_wait, bucket.members.front());
    notes[b] = "issued after tensor-parallel " + g.nodes[waited_collective(g, last_wait)].name +
               " completes (it would share its NVLink)";
  }
  return after;
}

struct BucketedItems {
  detail::LivenessItems items;
  std::vector<int> position_of_item;  // position in the order of the node behind each item
  std::vector<int> node_of_item;
};

BucketedItems bucketed_items(const Graph& g, const std::vector<Bucket>& buckets, const std::vector<int>& order) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> bucket_of(n, -1);
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (!is_multi(buckets[b])) continue;
    for (int m : buckets[b].members) bucket_of[m] = static_cast<int>(b);
  }
  std::vector<int> first_item_of_bucket(buckets.size(), -1), copy_in_of_bucket(buckets.size(), -1);
  std::vector<int> item_of(n, -1);
  BucketedItems out;
  detail::LivenessItems& it = out.items;
  auto push = [&](int64_t alloc, int owner, int position, int node) {
    it.alloc_bytes.push_back(alloc);
    it.owner.push_back(owner);
    it.is_output.push_back(0);
    out.position_of_item.push_back(position);
    out.node_of_item.push_back(node);
    return static_cast<int>(it.alloc_bytes.size()) - 1;
  };
  auto close_inputs = [&] { it.input_offsets.push_back(static_cast<int>(it.inputs.size())); };
  for (int i = 0; i < n; ++i) {
    const int v = order[i];
    const Node& node = g.nodes[v];
    const int b = bucket_of[v];
    if (b >= 0) {
      const Bucket& bucket = buckets[b];
      if (first_item_of_bucket[b] < 0) {
        // Copy-in: every member's inputs flattened into one buffer of the bucket's bytes.
        const int copy_in = push(bucket.bytes, -1, i, v);
        it.owner[copy_in] = copy_in;
        copy_in_of_bucket[b] = copy_in;
        for (int m : bucket.members) {
          for (int input : g.nodes[m].inputs) {
            if (item_of[input] < 0) throw IrError("order: an input of bucket member " + node.name + " runs after it");
            it.inputs.push_back(item_of[input]);
          }
        }
        close_inputs();
        int64_t out_bytes = 0;
        for (int m : bucket.members) out_bytes += g.nodes[m].output_bytes();
        const int first = push(out_bytes, -1, i, v);
        it.owner[first] = first;
        it.inputs.push_back(copy_in);
        close_inputs();
        first_item_of_bucket[b] = first;
        item_of[v] = first;
      } else {
        item_of[v] = push(0, first_item_of_bucket[b], i, v);  // lives in the bucket's output buffer
        close_inputs();
      }
      continue;
    }
    const bool alias = (node.kind == NodeKind::View || node.kind == NodeKind::Wait) && !node.inputs.empty();
    const bool output = node.op == "output";
    const int64_t alloc = (alias || output || node.op == "placeholder") ? 0 : node.output_bytes();
    const int x = push(alloc, -1, i, v);
    it.owner[x] = alias ? it.owner[item_of[node.inputs[0]]] : x;
    it.is_output[x] = output;
    for (int input : node.inputs) it.inputs.push_back(item_of[input]);
    // The wait also holds what its collective reads (peak_memory says why): a bucket's copy-in buffer, or the
    // collective's own inputs.
    const int waited = node.kind == NodeKind::Wait ? waited_collective(g, v) : -1;
    if (waited >= 0 && bucket_of[waited] >= 0) {
      it.inputs.push_back(copy_in_of_bucket[bucket_of[waited]]);
    } else if (waited >= 0) {
      for (int input : g.nodes[waited].inputs) it.inputs.push_back(item_of[input]);
    }
    close_inputs();
    item_of[v] = x;
  }
  return out;
}

struct Peak {
  int64_t bytes = 0;
  int position = -1;  // in the order
};

Peak bucketed_peak(const Graph& g, const std::vector<Bucket>& buckets, const std::vector<int>& order) {
  const BucketedItems items = bucketed_items(g, buckets, order);
  MemoryEstimate m;
  detail::liveness_peak(items.items, m);
  Peak p;
  p.bytes = m.peak_bytes;
  p.position = m.peak_node >= 0 ? items.position_of_item[m.peak_node] : -1;
  return p;
}

std::string bytes_text(int64_t bytes) {  // "4 GiB", "150 MiB", as the cost model's reasons write sizes
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double x = static_cast<double>(bytes);
  int u = 0;
  while (x >= 1024 && u < 5) {
    x /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 || x >= 100 ? "%.0f" : "%.1f", x);
  std::string s = buf;
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  return s + " " + units[u];
}

std::string prefetch_note(int from, int to, int64_t budget) {
  auto blocks = [](int k) { return std::to_string(k) + (k == 1 ? " block" : " blocks"); };
  return "prefetch cut from " + blocks(from) + " to " + std::to_string(to) + " to stay within the " +
         bytes_text(budget) + " memory budget";
}

}  // namespace

MemoryEstimate bucketed_peak_memory(const Graph& g, const std::vector<Bucket>& buckets, const std::vector<int>& order) {
  check_order(g, order);
  const BucketedItems items = bucketed_items(g, buckets, order);
  MemoryEstimate m;
  for (const Node& node : g.nodes) {
    if (node.op == "placeholder") m.input_bytes += node.output_bytes();
  }
  detail::liveness_peak(items.items, m);
  // Report per position in the order (a copy-in and its first member share one position).
  std::vector<int64_t> live(order.size(), 0);
  for (size_t k = 0; k < items.position_of_item.size(); ++k) live[items.position_of_item[k]] = m.live_bytes_after[k];
  if (m.peak_node >= 0) m.peak_node = items.node_of_item[m.peak_node];
  m.live_bytes_after = std::move(live);
  return m;
}

Schedule schedule_graph(const Graph& g, std::vector<Bucket> buckets, const PlanConfig& config) {
  const int n = static_cast<int>(g.nodes.size());
  if (config.keep_order) buckets = singletons(g, buckets);
  Units units;
  while (!build_units(g, buckets, units)) split_a_cyclic_bucket(g, buckets, units);

  std::vector<int> identity(n);
  std::iota(identity.begin(), identity.end(), 0);
  Schedule s;
  s.peak_bytes_before = peak_memory(g, identity).peak_bytes;
  s.notes.assign(buckets.size(), "");
  s.prefetch.assign(buckets.size(), 0);
  auto positions_of = [&](const std::vector<int>& order) {
    std::vector<int> pos(n);
    for (int i = 0; i < n; ++i) pos[order[i]] = i;
    return pos;
  };
  if (config.keep_order) {  // every collective where it was captured, on its own: nothing to schedule
    s.order = identity;
    s.peak_bytes_after = s.peak_bytes_before;
    s.kept_captured_order = true;
    s.notes.assign(buckets.size(), "captured order kept (config.keep_order)");
  } else {
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (buckets[b].planned && buckets[b].type == CollectiveType::AllGather &&
          buckets[b].role != CollectiveRole::TensorParallel) {
        s.prefetch[b] = config.prefetch_blocks;
      }
    }
    const std::vector<int> wanted = s.prefetch;
    // Data-parallel buckets that would start just before a tensor-parallel collective (no GEMM between) start after
    // its wait instead: they would share its NVLink while it holds up its block (tp_aware_after).
    {
      Scheduler first(g, buckets, units);
      const std::vector<int> order = first.order_for(first.own_keys(s.prefetch, false));
      std::vector<std::string> tp_notes(buckets.size());
      const std::vector<After> after = tp_aware_after(g, buckets, order, tp_notes);
      if (!after.empty()) {
        Units constrained;
        if (build_units(g, buckets, constrained, after)) {
          units = std::move(constrained);
          for (size_t b = 0; b < buckets.size(); ++b) {
            if (!tp_notes[b].empty()) s.notes[b] = tp_notes[b];
          }
        } else {
          build_units(g, buckets, units);  // a constraint made a cycle: none of them
        }
      }
    }
    Scheduler scheduler(g, buckets, units);
    std::vector<char> bounded(buckets.size(), 0);
    while (true) {
      s.order = scheduler.order_for(scheduler.own_keys(s.prefetch, false, bounded));
      const Peak peak = bucketed_peak(g, buckets, s.order);
      s.peak_bytes_after = peak.bytes;
      if (peak.bytes - s.peak_bytes_before <= config.memory_budget_bytes) break;
      const std::vector<int> pos = positions_of(s.order);
      // First, reduce-scatters whose sunk wait holds their inputs across the peak: each waits once the next one is
      // issued (at most two in flight, as FSDP does), which costs no overlap while a block's backward outlasts one.
      bool bound_some = false;
      for (size_t b = 0; b < buckets.size(); ++b) {
        if (bounded[b] || !buckets[b].planned || buckets[b].type != CollectiveType::ReduceScatter ||
            buckets[b].role == CollectiveRole::TensorParallel || units.wait_unit[b] < 0 ||
            scheduler.next_reduce_scatter(b) < 0) {
          continue;
        }
        const int issue = pos[buckets[b].members.front()];
        const int wait = pos[buckets[b].waits.front()];
        if (issue <= peak.position && wait > peak.position) {
          bounded[b] = 1;
          bound_some = true;
          s.notes[b] = "wait bounded to the next reduce-scatter's issue to stay within the " +
                       bytes_text(config.memory_budget_bytes) + " memory budget";
        }
      }
      if (bound_some) continue;
      // Then all-gather buckets held across the peak (or allocated at it) only because they were issued early.
      int victim = -1, victim_wait = -1;
      for (size_t b = 0; b < buckets.size(); ++b) {
        if (s.prefetch[b] <= 0 || units.wait_unit[b] < 0) continue;
        const int issue = pos[buckets[b].members.front()];
        const int wait = pos[buckets[b].waits.front()];
        if (issue <= peak.position && wait > peak.position && wait > victim_wait) {
          victim = static_cast<int>(b);
          victim_wait = wait;
        }
      }
      if (victim < 0) {
        // Prefetch is not what holds the peak: keep the captured order, every collective on its own.
        buckets = singletons(g, buckets);
        build_units(g, buckets, units);
        Scheduler captured(g, buckets, units);
        s.order = captured.order_for(captured.own_keys(std::vector<int>(buckets.size(), 0), true));
        s.peak_bytes_after = bucketed_peak(g, buckets, s.order).bytes;
        if (s.peak_bytes_after - s.peak_bytes_before > config.memory_budget_bytes) s.order = identity;
        s.peak_bytes_after = bucketed_peak(g, buckets, s.order).bytes;
        s.kept_captured_order = true;
        s.prefetch.assign(buckets.size(), 0);
        s.notes.assign(buckets.size(), "captured order kept, unbucketed: the plan exceeded the " +
                                           bytes_text(config.memory_budget_bytes) + " memory budget");
        break;
      }
      --s.prefetch[victim];
      s.notes[victim] = prefetch_note(wanted[victim], s.prefetch[victim], config.memory_budget_bytes);
    }
  }

  check_order(g, s.order);
  const std::vector<int> pos = positions_of(s.order);
  s.issue_position.assign(buckets.size(), -1);
  s.wait_position.assign(buckets.size(), -1);
  for (size_t b = 0; b < buckets.size(); ++b) {
    int issue = n, wait = n;
    for (int m : buckets[b].members) issue = std::min(issue, pos[m]);
    for (int w : buckets[b].waits) {
      if (w >= 0) wait = std::min(wait, pos[w]);
    }
    s.issue_position[b] = issue;
    s.wait_position[b] = wait < n ? wait : -1;
  }
  s.buckets = std::move(buckets);
  return s;
}

}  // namespace ce_overlap
