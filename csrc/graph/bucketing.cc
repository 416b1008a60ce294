// Bucketing of one graph's collectives (docs/plan.md): per block or bucket-pattern key, same type,
// group, group size, dtype and reduce op, under the byte cap, in graph order.
#include "bucketing.h"

#include <algorithm>
#include <regex>
#include <unordered_map>

#include "analysis.h"

namespace ce_overlap {
namespace {

std::optional<std::string> collective_dtype(const Graph& g, const Node& c) {
  if (!c.outputs.empty()) return c.outputs[0].dtype;
  for (int input : c.inputs) {
    if (!g.nodes[input].outputs.empty()) return g.nodes[input].outputs[0].dtype;
  }
  return std::nullopt;
}

// Does `target` depend on any node marked with `stamp` in `mark`? Walks target's inputs backwards,
// only through ids above `floor` (a path from a member to target never leaves (member, target)).
class DependencyProbe {
 public:
  explicit DependencyProbe(const Graph& g) : g_(g), visited_(g.nodes.size(), 0) {}

  bool reaches(const std::vector<int>& sources, int target) {
    if (sources.empty()) return false;
    ++stamp_;
    const int source_stamp = stamp_;
    int floor = sources.front();
    for (int s : sources) floor = std::min(floor, s);
    // Sources carry the stamp negated so one array holds both marks.
    for (int s : sources) visited_[s] = -source_stamp;
    stack_.assign(1, target);
    visited_[target] = source_stamp;
    while (!stack_.empty()) {
      const int v = stack_.back();
      stack_.pop_back();
      for (int input : g_.nodes[v].inputs) {
        if (visited_[input] == -source_stamp) return true;
        if (input <= floor || visited_[input] == source_stamp) continue;
        visited_[input] = source_stamp;
        stack_.push_back(input);
      }
    }
    return false;
  }

 private:
  const Graph& g_;
  std::vector<int> visited_;
  std::vector<int> stack_;
  int stamp_ = 0;
};

std::string kept_reason(const Graph& g, const CollectiveUse& use, int collective) {
  if (use.num_waits == 0) return "no wait reads it";
  if (use.num_waits > 1) return "read by " + std::to_string(use.num_waits) + " waits (coalesced)";
  (void)g;
  (void)collective;
  return "its output is read besides its wait";
}

// Whether the FX rewriter can merge this collective with others (docs/plan.md): the plain functional
// all_gather_into_tensor, reduce_scatter_tensor or all_reduce of a tensor of at least one dimension (an in-place
// all_reduce_, as Inductor re-inplaces one, where nothing else reads its input: merged, the input keeps its values);
// a reduce-scatter's dim 0 must split evenly over the group (rank-major copy-in).
bool mergeable(const Graph& g, const Node& node, const std::vector<int>& direct_users) {
  const CollectiveInfo& c = *node.collective;
  const char* name = nullptr;
  switch (c.type) {
    case CollectiveType::AllGather: name = "all_gather_into_tensor"; break;
    case CollectiveType::ReduceScatter: name = "reduce_scatter_tensor"; break;
    case CollectiveType::AllReduce: name = "all_reduce"; break;
    default: return false;
  }
  // op is "<namespace>.<name>[.<overload>]".
  const size_t dot = node.op.find('.');
  if (dot == std::string::npos) return false;
  const size_t end = node.op.find('.', dot + 1);
  const std::string op = node.op.substr(dot + 1, end == std::string::npos ? std::string::npos : end - dot - 1);
  const bool in_place = c.type == CollectiveType::AllReduce && op == "all_reduce_";
  if (op != name && !in_place) return false;
  if (node.inputs.size() != 1 || g.nodes[node.inputs[0]].outputs.empty()) return false;
  if (in_place && direct_users[node.inputs[0]] != 1) return false;
  const std::vector<int64_t>& shape = g.nodes[node.inputs[0]].outputs[0].shape;
  if (shape.empty()) return false;
  return c.type != CollectiveType::ReduceScatter || shape[0] % c.group_size == 0;
}

// The block of the collective whose wait feeds `node` (through views), or -1.
int fed_block(const Graph& g, const Node& node) {
  for (int input : node.inputs) {
    const int c = waited_collective(g, input);
    if (c >= 0) return g.nodes[c].block;
  }
  return -1;
}

}  // namespace

std::vector<CollectiveUse> collective_uses(const Graph& g) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<CollectiveUse> uses(n);
  std::vector<int> direct_users(n, 0);
  for (const Node& node : g.nodes) {
    for (int input : node.inputs) {
      if (input >= 0 && input < n) ++direct_users[input];
    }
  }
  for (const Node& node : g.nodes) {
    if (node.kind != NodeKind::Wait) continue;
    const int c = waited_collective(g, node.id);
    if (c < 0) continue;
    CollectiveUse& use = uses[c];
    ++use.num_waits;
    if (use.wait < 0) use.wait = node.id;
  }
  for (const Node& node : g.nodes) {
    if (node.kind != NodeKind::Collective) continue;
    CollectiveUse& use = uses[node.id];
    use.bucketable = use.num_waits == 1 && direct_users[node.id] == 1 && g.nodes[use.wait].inputs[0] == node.id;
    use.mergeable = use.bucketable && node.collective && mergeable(g, node, direct_users);
  }
  return uses;
}

std::vector<Bucket> bucket_collectives(const Graph& g, const std::vector<Block>& blocks, const PlanConfig& config) {
  std::vector<std::regex> patterns;
  patterns.reserve(config.bucket_patterns.size());
  for (size_t i = 0; i < config.bucket_patterns.size(); ++i) {
    try {
      patterns.emplace_back(config.bucket_patterns[i], std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw IrError("config.bucket_patterns[" + std::to_string(i) + "]: invalid regular expression: " + e.what());
    }
  }
  const std::vector<CollectiveUse> uses = collective_uses(g);
  DependencyProbe probe(g);

  std::vector<Bucket> buckets;
  std::unordered_map<std::string, size_t> open;  // bucket key -> index of its open bucket
  std::vector<std::string> open_outside;          // keys of open Outside buckets
  std::smatch match;
  for (const Node& node : g.nodes) {
    if (node.kind != NodeKind::Collective || !node.collective) continue;
    const CollectiveInfo& c = *node.collective;
    Bucket proto;
    proto.type = c.type;
    proto.group = c.group;
    proto.group_size = c.group_size;
    proto.dtype = collective_dtype(g, node);
    proto.reduce_op = c.reduce_op;
    // HSDP's replica all-reduce runs in no module (autograd made it): it buckets with the block of the reduce-scatter
    // whose result it averages.
    const int block = node.block >= 0 || c.role != CollectiveRole::Replicate ? node.block : fed_block(g, node);
    proto.block = block;
    proto.role = c.role;
    proto.nodes = c.nodes;
    std::string scope_key;
    for (size_t p = 0; p < patterns.size() && proto.scope == BucketScope::Outside; ++p) {
      for (const auto& entry : node.module_stack) {
        if (!std::regex_search(entry.first, match, patterns[p])) continue;
        proto.scope = BucketScope::Pattern;
        proto.key = match.size() > 1 && match[1].matched ? match[1].str() : match[0].str();
        scope_key = "p" + std::to_string(p) + ":" + proto.key;
        break;
      }
    }
    if (proto.scope == BucketScope::Outside && block >= 0) {
      proto.scope = BucketScope::Block;
      proto.key = block < static_cast<int>(blocks.size()) ? blocks[block].path : std::to_string(block);
      scope_key = "b" + std::to_string(block);
    }
    if (proto.scope != BucketScope::Outside) {
      for (const std::string& k : open_outside) open.erase(k);  // outside buckets hold neighbours only
      open_outside.clear();
    }

    const CollectiveUse& use = uses[node.id];
    if (!use.bucketable) {
      proto.planned = false;
      proto.kept_reason = kept_reason(g, use, node.id);
      proto.members = {node.id};
      proto.waits = {use.wait};
      proto.bytes = c.bytes;
      buckets.push_back(std::move(proto));
      continue;
    }

    if (!use.mergeable || c.role == CollectiveRole::TensorParallel) {  // planned, but on its own
      proto.members = {node.id};
      proto.waits = {use.wait};
      proto.bytes = c.bytes;
      buckets.push_back(std::move(proto));
      continue;
    }

    const char sep = '\x1f';
    std::string key = scope_key;
    key += sep;
    key += to_string(c.type);
    key += sep;
    key += c.group;
    key += sep;
    key += std::to_string(c.group_size);
    key += sep;
    key += proto.dtype.value_or("-");
    key += sep;
    key += c.reduce_op.value_or("-");

    auto it = open.find(key);
    if (it != open.end()) {
      Bucket& b = buckets[it->second];
      const bool fits = c.bytes <= config.bucket_cap_bytes - b.bytes;
      if (fits && !probe.reaches(b.members, node.id)) {
        b.members.push_back(node.id);
        b.waits.push_back(use.wait);
        b.bytes += c.bytes;
        if (b.block != node.block) b.block = -1;
        continue;
      }
    }
    proto.members = {node.id};
    proto.waits = {use.wait};
    proto.bytes = c.bytes;
    open[key] = buckets.size();
    if (proto.scope == BucketScope::Outside) open_outside.push_back(key);
    buckets.push_back(std::move(proto));
  }
  return buckets;  // created in order of their first member
}

}  // namespace ce_overlap
