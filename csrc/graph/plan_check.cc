// check_plan: every rule of docs/plan.md against the IR graph a Plan orders, each failure named by its rule and
// the node (PlanRuleError). The one checker of the Plan: the planner runs it on every plan it returns, and the FX
// rewriter (python/ce_overlap/inductor/plan_check.py) on every plan it applies, against the IR of its FX graph.
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "analysis.h"
#include "bucketing.h"
#include "plan.h"
#include "plan_rules.h"

namespace ce_overlap {
namespace {

using namespace plan_rules;

std::string label(const Graph& g, int id) {
  return "node " + std::to_string(id) + " (" + json_quoted(g.nodes[id].name) + ")";
}

const Graph& graph_named(const Document& doc, const std::string& name) {
  std::string names;
  for (const Graph& g : doc.graphs) {
    if (g.name == name) return g;
    names += (names.empty() ? "" : ", ") + g.name;
  }
  fail("plan.graph", std::nullopt, "graph", "no graph named " + json_quoted(name) + " in the IR (it has: " + names + ")");
}

// `order` against the graph: every node once, placeholders first, the output last, every node after its
// inputs. Returns each node's position in `order`.
std::vector<int> check_order(const Graph& g, const Plan& plan, const std::unordered_map<std::string_view, int>& id_of) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> order;
  order.reserve(plan.order.size());
  for (size_t i = 0; i < plan.order.size(); ++i) {
    auto it = id_of.find(plan.order[i]);
    if (it == id_of.end()) {
      fail("order.complete", plan.order[i], at("order", i),
           "no node named " + json_quoted(plan.order[i]) + " in graph " + json_quoted(g.name));
    }
    order.push_back(it->second);
  }
  if (static_cast<int>(order.size()) != n) {  // names are unique (check_order_names) and known: some are missing
    std::vector<char> seen(n, 0);
    for (int v : order) seen[v] = 1;
    int missing = 0;
    while (missing < n && seen[missing]) ++missing;
    fail("order.complete", g.nodes[missing].name, "order",
         "names " + std::to_string(order.size()) + " of the " + std::to_string(n) + " nodes of graph " +
             json_quoted(g.name) + "; missing " + label(g, missing));
  }
  std::vector<int> pos(n);
  for (int i = 0; i < n; ++i) pos[order[i]] = i;
  int first_other = -1;
  for (int i = 0; i < n; ++i) {
    const std::string& op = g.nodes[order[i]].op;
    if (op != "placeholder" && first_other < 0) first_other = i;
    if (op == "placeholder" && first_other >= 0) {
      fail("order.placeholders_first", plan.order[i], at("order", i),
           "placeholder " + json_quoted(plan.order[i]) + " comes after " + json_quoted(plan.order[first_other]) +
               " (placeholders go first)");
    }
  }
  for (int i = 0; i + 1 < n; ++i) {
    if (g.nodes[order[i]].op == "output") {
      fail("order.output_last", plan.order[n - 1], at("order", i),
           "the output " + json_quoted(plan.order[i]) + " must be last; order ends with " +
               json_quoted(plan.order[n - 1]));
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int input : g.nodes[order[i]].inputs) {
      if (pos[input] > i) {
        fail("order.topological", plan.order[i], at("order", i),
             label(g, order[i]) + " runs before its input " + label(g, input) + " at order[" +
                 std::to_string(pos[input]) + "]");
      }
    }
  }
  return pos;
}

// Every node's users, as a CSR: users[offsets[v] .. offsets[v + 1]).
struct Users {
  std::vector<int> offsets, users;
  explicit Users(const Graph& g) : offsets(g.nodes.size() + 1, 0) {
    for (const Node& node : g.nodes) {
      for (int input : node.inputs) ++offsets[input + 1];
    }
    for (size_t v = 0; v < g.nodes.size(); ++v) offsets[v + 1] += offsets[v];
    users.resize(offsets.back());
    std::vector<int> fill(offsets.begin(), offsets.end() - 1);
    for (const Node& node : g.nodes) {
      for (int input : node.inputs) users[fill[input]++] = node.id;
    }
  }
};

std::optional<std::string> collective_dtype(const Graph& g, const Node& node) {
  if (!node.outputs.empty()) return node.outputs[0].dtype;
  for (int input : node.inputs) {
    if (!g.nodes[input].outputs.empty()) return g.nodes[input].outputs[0].dtype;
  }
  return std::nullopt;
}

std::string show(const std::optional<std::string>& s) { return s ? json_quoted(*s) : std::string("null"); }

// One member against its collective: a collective of the graph in no other bucket ("bucket.coverage"), the
// bucket's fields ("bucket.members_match"), its bytes ("bucket.bytes") and its wait ("bucket.wait": the one that
// consumes it; a collective read otherwise stays a singleton on NCCL). Returns the collective's id.
int check_member(const Graph& g, const Plan& plan, size_t index, size_t k,
                 const std::unordered_map<std::string_view, int>& id_of, const std::vector<CollectiveUse>& uses,
                 std::unordered_map<std::string_view, std::string>& owner) {
  const PlanBucket& b = plan.buckets[index];
  const PlanMember& m = b.members[k];
  const std::string path = at("buckets", index);
  const std::string mpath = at(at(path, "members"), k);
  const std::string& name = m.collective;
  auto it = id_of.find(name);
  if (it == id_of.end()) {
    fail("bucket.coverage", name, at(mpath, "collective"),
         "no node named " + json_quoted(name) + " in graph " + json_quoted(g.name));
  }
  const int c = it->second;
  const Node& node = g.nodes[c];
  if (node.kind != NodeKind::Collective || !node.collective) {
    fail("bucket.coverage", name, at(mpath, "collective"),
         label(g, c) + " is not a collective (kind " + to_string(node.kind) + ")");
  }
  auto [claimed, inserted] = owner.emplace(name, at(mpath, "collective"));
  if (!inserted) {
    fail("bucket.coverage", name, at(mpath, "collective"),
         json_quoted(name) + " is listed twice (also " + claimed->second + ")");
  }
  const CollectiveInfo& info = *node.collective;
  auto mismatch = [&](const char* field, const std::string& want, const std::string& got) {
    fail("bucket.members_match", name, at(path, field), "expected " + want + " (as " + label(g, c) + " has), got " + got);
  };
  if (info.type != b.type) mismatch("type", json_quoted(to_string(info.type)), json_quoted(to_string(b.type)));
  if (info.group != b.group) mismatch("group", json_quoted(info.group), json_quoted(b.group));
  if (info.group_size != b.group_size) mismatch("group_size", std::to_string(info.group_size), std::to_string(b.group_size));
  const std::optional<std::string> dtype = collective_dtype(g, node);
  if (dtype != b.dtype) mismatch("dtype", show(dtype), show(b.dtype));
  if (info.reduce_op != b.reduce_op) mismatch("reduce_op", show(info.reduce_op), show(b.reduce_op));
  if (b.role != CollectiveRole::Unknown && info.role != b.role) {  // a Plan without roles (older) names none
    mismatch("role", json_quoted(to_string(info.role)), json_quoted(to_string(b.role)));
  }
  if (info.bytes != m.bytes) {
    fail("bucket.bytes", name, at(mpath, "bytes"),
         "expected " + std::to_string(info.bytes) + " (collective.bytes of " + label(g, c) + "), got " +
             std::to_string(m.bytes));
  }
  const CollectiveUse& use = uses[c];
  const std::optional<std::string> want_wait =
      use.wait >= 0 ? std::optional<std::string>(g.nodes[use.wait].name) : std::nullopt;
  if (m.wait != want_wait) {
    fail("bucket.wait", name, at(mpath, "wait"),
         "expected " + show(want_wait) + " (the wait that consumes " + label(g, c) + "), got " + show(m.wait));
  }
  if (!use.bucketable && (b.members.size() > 1 || b.backend != "nccl")) {
    const std::string how = use.num_waits == 0  ? "no wait reads it"
                            : use.num_waits > 1 ? "it is read by " + std::to_string(use.num_waits) + " waits (coalesced)"
                                                : "its output is read besides its wait";
    fail("bucket.wait", name, b.members.size() > 1 ? at(path, "members") : at(path, "backend"),
         label(g, c) + " cannot be merged or moved to CE (" + how +
             "): it can only be a bucket of its own on \"nccl\"");
  }
  return c;
}

}  // namespace

void check_plan(const Document& doc, const Plan& plan) {
  check_header(plan);
  const Graph& g = graph_named(doc, plan.graph);
  const Positions position = check_order_names(plan);
  std::unordered_map<std::string_view, int> id_of;
  id_of.reserve(g.nodes.size());
  for (const Node& node : g.nodes) id_of.emplace(node.name, node.id);
  const std::vector<int> pos = check_order(g, plan, id_of);

  const std::vector<CollectiveUse> uses = collective_uses(g);
  const Users users(g);
  std::unordered_map<std::string_view, std::string> owner;  // collective -> the member field that lists it
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    const PlanBucket& b = plan.buckets[i];
    const std::string path = at("buckets", i);
    check_bucket_fields(b, i);
    check_bucket_backend(b, i);
    if (b.block && *b.block >= static_cast<int>(doc.blocks.size())) {
      fail("bucket.block", bucket_node(i), at(path, "block"),
           "expected null or a block id in [0, " + std::to_string(doc.blocks.size()) + "), got " +
               std::to_string(*b.block));
    }
    std::vector<int> members;
    for (size_t k = 0; k < b.members.size(); ++k) members.push_back(check_member(g, plan, i, k, id_of, uses, owner));
    check_bucket_reduce_op(b, i);
    check_bucket_predicted(b, i);
    check_bucket_bytes(b, i, plan.config);
    if (members.size() > 1) {
      for (int c : members) {
        if (!uses[c].mergeable) {
          fail("bucket.supported", g.nodes[c].name, at(path, "members"),
               label(g, c) + " (" + g.nodes[c].op +
                   ") cannot be merged: only the functional all_gather_into_tensor, reduce_scatter_tensor and "
                   "all_reduce of a tensor with a dim 0 (divisible by the group size for a reduce-scatter) share "
                   "buckets");
        }
      }
    }
    check_bucket_order(plan, i, position);
    for (size_t k = 0; k < b.overlaps.size(); ++k) {  // collectives of other groups, by name
      const std::string& name = b.overlaps[k].collective;
      const std::string opath = at(at(at(path, "overlaps"), k), "collective");
      auto it = id_of.find(name);
      if (it == id_of.end() || g.nodes[it->second].kind != NodeKind::Collective || !g.nodes[it->second].collective) {
        fail("bucket.overlaps", name, opath, "expected a collective of graph " + json_quoted(g.name) + ", got " +
                                                 json_quoted(name));
      }
      if (g.nodes[it->second].collective->group == b.group) {
        fail("bucket.overlaps", name, opath,
             label(g, it->second) + " is of the bucket's own group " + json_quoted(b.group) +
                 " (its collectives run one after another)");
      }
    }
    // Inputs before the first member collective; users of member waits after the last member wait.
    int first_c = static_cast<int>(g.nodes.size()), last_w = -1;
    for (int c : members) {
      first_c = std::min(first_c, pos[c]);
      if (uses[c].wait >= 0) last_w = std::max(last_w, pos[uses[c].wait]);
    }
    for (size_t k = 0; k < members.size(); ++k) {
      for (int input : g.nodes[members[k]].inputs) {
        if (pos[input] > first_c) {
          fail("order.bucket_inputs_first", g.nodes[input].name, at(at(at(path, "members"), k), "collective"),
               "input " + label(g, input) + " at order[" + std::to_string(pos[input]) +
                   "] comes after the bucket's first collective at order[" + std::to_string(first_c) + "]");
        }
      }
    }
    for (size_t k = 0; k < members.size(); ++k) {
      const int w = uses[members[k]].wait;
      if (w < 0) continue;
      for (int e = users.offsets[w]; e < users.offsets[w + 1]; ++e) {
        const int user = users.users[e];
        if (pos[user] < last_w) {
          fail("order.wait_users_after", g.nodes[user].name, at(at(at(path, "members"), k), "wait"),
               "user " + label(g, user) + " at order[" + std::to_string(pos[user]) +
                   "] comes before the bucket's last wait at order[" + std::to_string(last_w) + "]");
        }
      }
    }
  }
  for (const Node& node : g.nodes) {
    if (node.kind == NodeKind::Collective && !owner.count(node.name)) {
      fail("bucket.coverage", node.name, "buckets", "collective " + label(g, node.id) + " is in no bucket");
    }
  }
  check_summary(plan);
}

}  // namespace ce_overlap
