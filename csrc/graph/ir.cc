// Enum names, dtype sizes and the semantic rules of docs/ir.md. The loader and in-memory documents
// both go through validate(), so a document is judged the same way however it was built.
#include "ir.h"

#include <cmath>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include "analysis.h"
#include "graph_internal.h"

namespace ce_overlap {
namespace {

constexpr int64_t kMaxBytes = int64_t{1} << 50;     // 1 PiB: beyond it a size is a bug, not a tensor
constexpr int64_t kMaxFlops = 1000000000000000000;  // 1e18
constexpr int kMaxGroupSize = 65536;

struct DtypeEntry {
  const char* name;
  int64_t itemsize_bytes;
};
constexpr DtypeEntry kDtypes[] = {
    {"float64", 8},     {"float32", 4},      {"float16", 2}, {"bfloat16", 2},
    {"float8_e4m3fn", 1}, {"float8_e5m2", 1}, {"int64", 8},   {"int32", 4},
    {"int16", 2},       {"int8", 1},         {"uint8", 1},   {"bool", 1},
    {"complex64", 8},   {"complex128", 16},
    // Unsigned and fnuz types appear in real graphs too: flash attention's RNG seed/offset are uint64.
    {"uint16", 2},      {"uint32", 4},       {"uint64", 8},  {"float8_e4m3fnuz", 1}, {"float8_e5m2fnuz", 1},
    {"complex32", 4},
};

constexpr const char* kKindNames[] = {"compute", "collective", "wait", "view", "other"};
constexpr const char* kCollectiveNames[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                                            "broadcast",  "send",           "recv"};
constexpr const char* kReduceOps[] = {"sum", "avg", "max", "min", "product"};

template <size_t N>
std::string join_names(const char* const (&names)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i) out += ", ";
    out += names[i];
  }
  return out;
}

// Well-formed UTF-8 (Unicode Table 3-7): the saver copies strings verbatim, so bad bytes would
// produce a file that no JSON parser accepts.
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // Names are nearly always ASCII: clear 8 bytes per step while no high bit is set.
    while (n - i >= 8) {
      uint64_t chunk;
      std::memcpy(&chunk, p + i, 8);
      if (chunk & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    const size_t len = detail::utf8_sequence_length(p + i, n - i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string quoted(const std::string& s) {
  constexpr size_t kMaxShown = 60;
  if (s.size() <= kMaxShown) return "\"" + s + "\"";
  size_t cut = kMaxShown;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not mid-character
  return "\"" + s.substr(0, cut) + "...\"";
}

using detail::fail_at;
using detail::JsonPath;

void check_string(const JsonPath& path, const std::string& s, bool non_empty) {
  if (non_empty && s.empty()) fail_at(path, "expected a non-empty string");
  if (!valid_utf8(s)) fail_at(path, "string is not valid UTF-8");
}

void check_range(const JsonPath& path, int64_t value, int64_t max, const char* max_text) {
  if (value < 0) fail_at(path, "expected a non-negative integer, got " + std::to_string(value));
  if (value > max) {
    fail_at(path, std::string("expected at most ") + max_text + " = " + std::to_string(max) + ", got " +
                      std::to_string(value));
  }
}

void validate_meta(const JsonPath& path, const nlohmann::json& meta) {
  if (!meta.is_object()) fail_at(path, std::string("expected an object, got ") + meta.type_name());
  for (const auto& [key, value] : meta.items()) {
    if (!valid_utf8(key)) fail_at(path, "a key is not valid UTF-8");
    const JsonPath value_path(path, key.c_str());
    if (value.is_string()) {
      check_string(value_path, value.get_ref<const std::string&>(), false);
    } else if (value.is_number_float()) {
      if (!std::isfinite(value.get<double>())) fail_at(value_path, "expected a finite number");
    } else if (!value.is_number() && !value.is_boolean()) {
      fail_at(value_path, std::string("expected a string, number or boolean, got ") + value.type_name());
    }
  }
}

void validate_collective(const JsonPath& path, const CollectiveInfo& c) {
  const char* type_name = nullptr;
  try {
    type_name = to_string(c.type);  // an out-of-range enum can only come from code, not JSON
  } catch (const IrError& e) {
    fail_at(JsonPath(path, "type"), e.what());
  }
  check_string(JsonPath(path, "group"), c.group, true);
  if (c.group_size < 1 || c.group_size > kMaxGroupSize) {
    fail_at(JsonPath(path, "group_size"),
            "expected an integer in 1..65536, got " + std::to_string(c.group_size));
  }
  if (c.nodes < 0 || c.nodes > c.group_size) {  // 0: not known (absent)
    fail_at(JsonPath(path, "nodes"), "expected an integer in 1.." + std::to_string(c.group_size) +
                                         " (the group's nodes, at most its ranks), got " + std::to_string(c.nodes));
  }
  const JsonPath reduce_op_path(path, "reduce_op");
  const bool reduces = c.type == CollectiveType::ReduceScatter || c.type == CollectiveType::AllReduce;
  if (reduces) {
    if (!c.reduce_op) {
      fail_at(reduce_op_path, std::string("required for ") + type_name + " (accepted: " +
                                  join_names(kReduceOps) + "), got null");
    }
    bool known = false;
    for (const char* op : kReduceOps) known = known || *c.reduce_op == op;
    if (!known) {
      fail_at(reduce_op_path, "unknown reduce_op " + quoted(*c.reduce_op) + " (accepted: " +
                                  join_names(kReduceOps) + ")");
    }
  } else if (c.reduce_op) {
    fail_at(reduce_op_path, std::string("must be null for ") + type_name + ", got " + quoted(*c.reduce_op));
  }
  check_range(JsonPath(path, "bytes"), c.bytes, kMaxBytes, "2^50");
}

void validate_tensor(const JsonPath& path, const TensorInfo& t) {
  int64_t itemsize_bytes = 0;
  try {
    itemsize_bytes = dtype_itemsize(t.dtype);
  } catch (const IrError& e) {
    fail_at(JsonPath(path, "dtype"), e.what());
  }
  const JsonPath shape_path(path, "shape");
  bool has_zero_dim = false;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 0) {
      fail_at(JsonPath(shape_path, d), "expected a non-negative integer, got " + std::to_string(t.shape[d]));
    }
    has_zero_dim = has_zero_dim || t.shape[d] == 0;
  }
  const JsonPath bytes_path(path, "bytes");
  check_range(bytes_path, t.bytes, kMaxBytes, "2^50");
  // Multiply under a cap so that absurd shapes cannot overflow int64 before being rejected.
  int64_t expected_bytes = has_zero_dim ? 0 : itemsize_bytes;
  for (int64_t dim : t.shape) {
    if (has_zero_dim) break;
    if (expected_bytes > kMaxBytes / dim) fail_at(shape_path, "numel x itemsize exceeds 2^50 bytes");
    expected_bytes *= dim;
  }
  if (expected_bytes > kMaxBytes) fail_at(shape_path, "numel x itemsize exceeds 2^50 bytes");
  if (expected_bytes != t.bytes) {
    fail_at(bytes_path, "expected bytes = numel x itemsize = " + std::to_string(expected_bytes) + ", got " +
                            std::to_string(t.bytes));
  }
}

void validate_node(const JsonPath& path, const Graph& g, size_t index, size_t num_blocks) {
  const Node& node = g.nodes[index];
  const int num_nodes = static_cast<int>(g.nodes.size());
  if (node.id != static_cast<int>(index)) {
    fail_at(JsonPath(path, "id"), "expected " + std::to_string(index) + " (ids equal the position), got " +
                                      std::to_string(node.id));
  }
  check_string(JsonPath(path, "name"), node.name, true);
  const char* kind_name = nullptr;
  try {
    kind_name = to_string(node.kind);
  } catch (const IrError& e) {
    fail_at(JsonPath(path, "kind"), e.what());
  }
  check_string(JsonPath(path, "op"), node.op, true);
  const JsonPath inputs_path(path, "inputs");
  for (size_t k = 0; k < node.inputs.size(); ++k) {
    const int input = node.inputs[k];
    if (input < 0 || input >= num_nodes) {
      fail_at(JsonPath(inputs_path, k), "node id " + std::to_string(input) + " out of range [0, " +
                                            std::to_string(num_nodes) + ")");
    }
    if (input == node.id) {
      fail_at(JsonPath(inputs_path, k), "a node cannot be its own input (" + std::to_string(input) + ")");
    }
  }
  if (node.kind == NodeKind::View && node.inputs.empty()) {
    fail_at(inputs_path, "a view needs an input (its output aliases the first input)");
  }
  if (node.kind == NodeKind::Wait && node.inputs.size() != 1) {
    fail_at(inputs_path, "a wait takes exactly one input, got " + std::to_string(node.inputs.size()));
  }
  const JsonPath outputs_path(path, "outputs");
  for (size_t k = 0; k < node.outputs.size(); ++k) validate_tensor(JsonPath(outputs_path, k), node.outputs[k]);
  check_range(JsonPath(path, "flops"), node.flops, kMaxFlops, "10^18");
  check_range(JsonPath(path, "bytes_accessed"), node.bytes_accessed, kMaxBytes, "2^50");
  const JsonPath stack_path(path, "module_stack");
  for (size_t k = 0; k < node.module_stack.size(); ++k) {
    const JsonPath entry_path(stack_path, k);
    check_string(JsonPath(entry_path, size_t{0}), node.module_stack[k].first, false);
    check_string(JsonPath(entry_path, size_t{1}), node.module_stack[k].second, false);
  }
  if (node.block < -1 || node.block >= static_cast<int64_t>(num_blocks)) {
    fail_at(JsonPath(path, "block"), "expected -1 or a block id in [0, " + std::to_string(num_blocks) +
                                         "), got " + std::to_string(node.block));
  }
  const JsonPath collective_path(path, "collective");
  if (node.kind == NodeKind::Collective) {
    if (!node.collective) fail_at(collective_path, "missing required field (kind is collective)");
    validate_collective(collective_path, *node.collective);
  } else if (node.collective) {
    fail_at(collective_path, std::string("must be absent: only collectives carry one, kind is ") + kind_name);
  }
}

void validate_graph(const JsonPath& path, const Graph& g, size_t num_blocks) {
  check_string(JsonPath(path, "name"), g.name, true);
  const JsonPath nodes_path(path, "nodes");
  std::unordered_map<std::string_view, size_t> first_with_name;
  first_with_name.reserve(g.nodes.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const JsonPath node_path(nodes_path, i);
    validate_node(node_path, g, i, num_blocks);
    auto [it, inserted] = first_with_name.emplace(g.nodes[i].name, i);
    if (!inserted) {
      fail_at(JsonPath(node_path, "name"), "duplicate name " + quoted(g.nodes[i].name) + " (also nodes[" +
                                               std::to_string(it->second) + "])");
    }
  }
  std::vector<int> order, cycle;
  if (!detail::stable_topological_order(g, order, cycle)) {
    fail_at(path, "dependency cycle through nodes " + detail::describe_cycle(g, cycle));
  }
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& node = g.nodes[i];
    if (node.kind != NodeKind::Wait || waited_collective(g, node.id) >= 0) continue;
    int end = node.inputs[0];
    while (g.nodes[end].kind == NodeKind::View) end = g.nodes[end].inputs[0];
    // A graph input: a collective issued by another graph (the forward's all-gather of a tied weight, saved for
    // the backward), waited on again here. No collective of this graph: not bucketed, not counted, no time.
    if (g.nodes[end].op == "placeholder") continue;
    // Name where the chain ends so the capture bug is easy to find.
    fail_at(JsonPath(JsonPath(JsonPath(nodes_path, i), "inputs"), size_t{0}),
            "a wait's input must be a collective, a graph input (placeholder) or a view chain ending at one; "
            "the chain ends at " +
                detail::node_label(g, end) + " of kind " + to_string(g.nodes[end].kind));
  }
}

}  // namespace

const char* to_string(NodeKind kind) {
  const auto i = static_cast<size_t>(kind);
  if (i >= std::size(kKindNames)) throw IrError("invalid NodeKind value " + std::to_string(i));
  return kKindNames[i];
}

const char* to_string(CollectiveType type) {
  const auto i = static_cast<size_t>(type);
  if (i >= std::size(kCollectiveNames)) throw IrError("invalid CollectiveType value " + std::to_string(i));
  return kCollectiveNames[i];
}

NodeKind node_kind_from_string(const std::string& s) {
  for (size_t i = 0; i < std::size(kKindNames); ++i) {
    if (s == kKindNames[i]) return static_cast<NodeKind>(i);
  }
  throw IrError("unknown kind " + quoted(s) + " (accepted: " + join_names(kKindNames) + ")");
}

const char* to_string(CollectiveRole role) {
  switch (role) {
    case CollectiveRole::Unknown: return "";
    case CollectiveRole::DataParallel: return "dp";
    case CollectiveRole::TensorParallel: return "tp";
    case CollectiveRole::Replicate: return "replicate";
  }
  throw IrError("invalid CollectiveRole value " + std::to_string(static_cast<int>(role)));
}

CollectiveRole collective_role_from_string(const std::string& s) {
  if (s == "dp") return CollectiveRole::DataParallel;
  if (s == "tp") return CollectiveRole::TensorParallel;
  if (s == "replicate") return CollectiveRole::Replicate;
  throw IrError("unknown collective role " + quoted(s) + " (accepted: dp, tp, replicate)");
}

CollectiveType collective_type_from_string(const std::string& s) {
  for (size_t i = 0; i < std::size(kCollectiveNames); ++i) {
    if (s == kCollectiveNames[i]) return static_cast<CollectiveType>(i);
  }
  throw IrError("unknown collective type " + quoted(s) + " (accepted: " + join_names(kCollectiveNames) + ")");
}

bool is_attention_op(const std::string& op) {
  return op.find("scaled_dot_product") != std::string::npos || op.find("_flash_attention") != std::string::npos ||
         op.find("_efficient_attention") != std::string::npos || op.find("_cudnn_attention") != std::string::npos ||
         is_flex_attention_op(op);
}

bool is_flex_attention_op(const std::string& op) { return op.find("flex_attention") != std::string::npos; }

bool is_layout_op(const std::string& op) {
  return op.rfind("aten.constant_pad_nd.", 0) == 0 || op.rfind("aten.cat.", 0) == 0 || op.rfind("aten.clone.", 0) == 0;
}

int64_t dtype_itemsize(const std::string& dtype) {
  for (const auto& entry : kDtypes) {
    if (dtype == entry.name) return entry.itemsize_bytes;
  }
  std::string accepted;
  for (const auto& entry : kDtypes) {
    if (!accepted.empty()) accepted += ", ";
    accepted += entry.name;
  }
  throw IrError("unknown dtype " + quoted(dtype) + " (accepted: " + accepted + ")");
}

int64_t Node::output_bytes() const {
  int64_t total_bytes = 0;
  for (const auto& t : outputs) total_bytes += t.bytes;
  return total_bytes;
}

const Graph& find_graph(const Document& doc, const std::string& name) {
  std::string names;
  for (const Graph& g : doc.graphs) {
    if (g.name == name) return g;
    names += (names.empty() ? "" : ", ") + g.name;
  }
  throw IrError("graph: no graph named \"" + name + "\" in the IR (it has: " + names + ")");
}

void validate(const Document& doc) {
  const JsonPath root;
  validate_meta(JsonPath(root, "meta"), doc.meta);
  const JsonPath blocks_path(root, "blocks");
  std::unordered_map<std::string_view, size_t> first_with_path;
  for (size_t i = 0; i < doc.blocks.size(); ++i) {
    const Block& block = doc.blocks[i];
    const JsonPath path(blocks_path, i);
    if (block.id != static_cast<int>(i)) {
      fail_at(JsonPath(path, "id"), "expected " + std::to_string(i) + " (ids equal the position), got " +
                                        std::to_string(block.id));
    }
    check_string(JsonPath(path, "path"), block.path, true);
    check_string(JsonPath(path, "type"), block.type, false);
    auto [it, inserted] = first_with_path.emplace(block.path, i);
    if (!inserted) {
      fail_at(JsonPath(path, "path"), "duplicate path " + quoted(block.path) + " (also blocks[" +
                                          std::to_string(it->second) + "])");
    }
  }
  const JsonPath graphs_path(root, "graphs");
  if (doc.graphs.empty()) fail_at(graphs_path, "expected at least one graph");
  std::unordered_map<std::string_view, size_t> first_with_name;
  for (size_t i = 0; i < doc.graphs.size(); ++i) {
    const JsonPath path(graphs_path, i);
    validate_graph(path, doc.graphs[i], doc.blocks.size());
    auto [it, inserted] = first_with_name.emplace(doc.graphs[i].name, i);
    if (!inserted) {
      fail_at(JsonPath(path, "name"), "duplicate graph name " + quoted(doc.graphs[i].name) + " (also graphs[" +
                                          std::to_string(it->second) + "])");
    }
  }
}

std::string printable_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  std::string out;
  out.reserve(n);
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      out += static_cast<char>(p[i++]);
      continue;
    }
    const size_t len = detail::utf8_sequence_length(p + i, n - i);
    if (len == 0) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[p[i] >> 4];
      out += hex[p[i] & 15];
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

}  // namespace ce_overlap
