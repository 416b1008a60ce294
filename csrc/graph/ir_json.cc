// JSON <-> Document. Reading goes straight from text to Document through JsonLexer, strict about
// structure (types, keys, integer ranges), then validate(); writing is canonical (fixed key order,
// one node per line) so saved IR diffs well and load -> save is byte-identical.
#include <charconv>
#include <limits>
#include <string_view>

#include "graph_internal.h"
#include "ir.h"
#include "json_lexer.h"

namespace ce_overlap {
namespace detail {

std::string JsonPath::str() const {
  if (!parent_) return "document";
  // Children of the root print bare ("schema"), everything deeper joins with "." or "[i]".
  const std::string base = parent_->parent_ ? parent_->str() : std::string();
  if (key_) return base.empty() ? std::string(key_) : base + "." + key_;
  return (base.empty() ? std::string("document") : base) + "[" + std::to_string(index_) + "]";
}

void fail_at(const JsonPath& path, const std::string& message) { throw IrError(path.str() + ": " + message); }

}  // namespace detail

namespace {

using json = nlohmann::json;
using detail::fail_at;
using detail::JsonPath;

// A value as an error message shows it: scalars verbatim (strings quoted, shortened), containers by type.
std::string describe(const json& v) {
  if (v.is_string()) {
    constexpr size_t kMaxShown = 60;
    const auto& s = v.get_ref<const std::string&>();
    if (s.size() <= kMaxShown) return v.dump();
    size_t cut = kMaxShown;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not mid-character
    return json(s.substr(0, cut) + "...").dump();
  }
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return v.dump();
}

template <size_t N>
std::string join_keys(const std::string_view (&keys)[N]) {
  std::string out;
  for (size_t k = 0; k < N; ++k) {
    if (k) out += ", ";
    out += keys[k];
  }
  return out;
}

constexpr std::string_view kTopKeys[] = {"schema", "meta", "blocks", "graphs"};
enum TopKey { kTopSchema, kTopMeta, kTopBlocks, kTopGraphs };
constexpr std::string_view kBlockKeys[] = {"id", "path", "type"};
enum BlockKey { kBlockId, kBlockPath, kBlockType };
constexpr std::string_view kGraphKeys[] = {"name", "nodes"};
enum GraphKey { kGraphName, kGraphNodes };
constexpr std::string_view kNodeKeys[] = {"id",    "name",           "kind",         "op",    "inputs",    "outputs",
                                          "flops", "bytes_accessed", "module_stack", "block", "collective"};
enum NodeKey { kId, kName, kKind, kOp, kInputs, kOutputs, kFlops, kBytesAccessed, kModuleStack, kBlock, kCollective };
constexpr std::string_view kTensorKeys[] = {"shape", "dtype", "bytes"};
enum TensorKey { kTensorShape, kTensorDtype, kTensorBytes };
constexpr std::string_view kCollectiveKeys[] = {"type", "group", "group_size", "reduce_op", "bytes", "role", "nodes"};
enum CollectiveKey { kCollType, kCollGroup, kCollGroupSize, kCollReduceOp, kCollBytes, kCollRole, kCollNodes };

template <size_t N>
constexpr uint32_t all_keys() {
  return static_cast<uint32_t>((uint64_t{1} << N) - 1);
}

// Reads the IR straight from the text into a Document, checking structure as it goes: types,
// known and unique keys, required keys, integer ranges. Semantic rules are left to validate().
class IrReader {
 public:
  explicit IrReader(std::string_view text) : lx_(text) {}

  Document read() {
    const JsonPath root;
    if (lx_.peek() != '{') fail_type(root, "an object");
    check_schema(root);
    Document doc;
    const uint32_t seen = read_fields(root, kTopKeys, [&](size_t k) {
      switch (k) {
        case kTopSchema: lx_.skip_value(); break;  // checked first, by check_schema
        case kTopMeta: read_meta(JsonPath(root, "meta"), doc.meta); break;
        case kTopBlocks: {
          const JsonPath blocks_path(root, "blocks");
          read_array(blocks_path, [&](size_t i) { doc.blocks.push_back(read_block(JsonPath(blocks_path, i))); });
          break;
        }
        case kTopGraphs: {
          const JsonPath graphs_path(root, "graphs");
          read_array(graphs_path, [&](size_t i) {
            doc.graphs.emplace_back();
            read_graph(JsonPath(graphs_path, i), doc.graphs.back());
          });
          break;
        }
      }
    });
    require(root, kTopKeys, seen, all_keys<4>());
    if (!lx_.at_end()) lx_.fail("unexpected content after the document");
    validate(doc);
    return doc;
  }

 private:
  // The schema is judged before anything else, wherever its key sits: a file of another version
  // should say so rather than trip over a renamed field. Canonical files have it first (no cost).
  void check_schema(const JsonPath& root) {
    const size_t start = lx_.offset();
    const JsonPath path(root, "schema");
    if (!lx_.seek_member("schema")) fail_at(path, "missing required field");
    const json schema = lx_.value();
    if (!schema.is_string() || schema.get_ref<const std::string&>() != kIrSchema) {
      fail_at(path, std::string("expected \"") + kIrSchema + "\", got " + describe(schema));
    }
    lx_.seek(start);
  }

  [[noreturn]] void fail_type(const JsonPath& path, const char* expected) {
    const json v = lx_.value();  // read the offending value so the message can show it
    fail_at(path, std::string("expected ") + expected + ", got " + describe(v));
  }

  // An object whose keys must come from `keys`; on_field(k) reads the value of keys[k]. Returns the
  // set of keys met (bit k). Misspelt keys fail rather than become silent defaults, and repeated
  // keys fail rather than let the last one win unseen.
  template <size_t N, class F>
  uint32_t read_fields(const JsonPath& path, const std::string_view (&keys)[N], F&& on_field) {
    static_assert(N <= 32, "seen-key mask is 32 bits");
    if (lx_.peek() != '{') fail_type(path, "an object");
    uint32_t seen = 0;
    size_t member = 0;
    lx_.object([&](std::string_view key) {
      // Canonical files list keys in schema order, so try the key's expected slot first.
      size_t k = member < N && keys[member] == key ? member : 0;
      while (k < N && keys[k] != key) ++k;
      if (k == N) {
        fail_at(path, "unknown key " + json(std::string(key)).dump() + " (accepted: " + join_keys(keys) + ")");
      }
      if (seen & (1u << k)) fail_at(path, "duplicate key " + json(std::string(key)).dump());
      seen |= 1u << k;
      ++member;
      on_field(k);
    });
    return seen;
  }

  template <size_t N>
  void require(const JsonPath& path, const std::string_view (&keys)[N], uint32_t seen, uint32_t required) {
    for (size_t k = 0; k < N; ++k) {
      if ((required & (1u << k)) && !(seen & (1u << k))) {
        const std::string key(keys[k]);
        fail_at(JsonPath(path, key.c_str()), "missing required field");
      }
    }
  }

  template <class F>
  void read_array(const JsonPath& path, F&& on_element) {
    if (lx_.peek() != '[') fail_type(path, "an array");
    lx_.array(on_element);
  }

  void read_string(const JsonPath& path, std::string& out) {
    if (lx_.peek() != '"') fail_type(path, "a string");
    out.assign(lx_.string(scratch_));
  }

  int64_t read_int64(const JsonPath& path) {
    const char c = lx_.peek();
    if (c == '-' || (c >= '0' && c <= '9')) {
      const detail::JsonNumber n = lx_.number();
      switch (n.type) {
        case detail::JsonNumber::Type::Int: return n.i;
        case detail::JsonNumber::Type::UInt:
          if (n.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            fail_at(path, "expected an integer within int64, got " + std::to_string(n.u));
          }
          return static_cast<int64_t>(n.u);
        case detail::JsonNumber::Type::Float:
          // 1.5, 1.0 and 1e20 all land here: the schema has no fractional counts.
          fail_at(path, "expected an integer, got " + json(n.d).dump());
      }
    }
    fail_type(path, "an integer");
  }

  int read_int32(const JsonPath& path) {
    const int64_t value = read_int64(path);
    if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
      fail_at(path, "expected an integer within int32, got " + std::to_string(value));
    }
    return static_cast<int>(value);
  }

  void read_meta(const JsonPath& path, json& meta) {
    if (lx_.peek() != '{') fail_type(path, "an object");
    meta = json::object();
    lx_.object([&](std::string_view key) {
      std::string k(key);
      if (meta.contains(k)) fail_at(path, "duplicate key " + json(k).dump());
      meta[std::move(k)] = lx_.value();  // value types are validate()'s business
    });
  }

  Block read_block(const JsonPath& path) {
    Block block;
    const uint32_t seen = read_fields(path, kBlockKeys, [&](size_t k) {
      switch (k) {
        case kBlockId: block.id = read_int32(JsonPath(path, "id")); break;
        case kBlockPath: read_string(JsonPath(path, "path"), block.path); break;
        case kBlockType: read_string(JsonPath(path, "type"), block.type); break;
      }
    });
    require(path, kBlockKeys, seen, all_keys<3>());
    return block;
  }

  void read_graph(const JsonPath& path, Graph& graph) {
    const uint32_t seen = read_fields(path, kGraphKeys, [&](size_t k) {
      switch (k) {
        case kGraphName: read_string(JsonPath(path, "name"), graph.name); break;
        case kGraphNodes: {
          const JsonPath nodes_path(path, "nodes");
          read_array(nodes_path, [&](size_t i) {
            graph.nodes.emplace_back();
            read_node(JsonPath(nodes_path, i), graph.nodes.back());
          });
          break;
        }
      }
    });
    require(path, kGraphKeys, seen, all_keys<2>());
  }

  TensorInfo read_tensor(const JsonPath& path) {
    TensorInfo t;
    const uint32_t seen = read_fields(path, kTensorKeys, [&](size_t k) {
      switch (k) {
        case kTensorShape: {
          const JsonPath shape_path(path, "shape");
          read_array(shape_path, [&](size_t d) { t.shape.push_back(read_int64(JsonPath(shape_path, d))); });
          break;
        }
        case kTensorDtype: read_string(JsonPath(path, "dtype"), t.dtype); break;
        case kTensorBytes: t.bytes = read_int64(JsonPath(path, "bytes")); break;
      }
    });
    require(path, kTensorKeys, seen, all_keys<3>());
    return t;
  }

  CollectiveInfo read_collective(const JsonPath& path) {
    CollectiveInfo c;
    const uint32_t seen = read_fields(path, kCollectiveKeys, [&](size_t k) {
      switch (k) {
        case kCollType: {
          const JsonPath type_path(path, "type");
          read_string(type_path, scratch_type_);
          try {
            c.type = collective_type_from_string(scratch_type_);
          } catch (const IrError& e) {
            fail_at(type_path, e.what());
          }
          break;
        }
        case kCollGroup: read_string(JsonPath(path, "group"), c.group); break;
        case kCollGroupSize: c.group_size = read_int32(JsonPath(path, "group_size")); break;
        case kCollReduceOp:
          if (lx_.peek() == 'n') {
            lx_.value();  // null (or a syntax error)
            c.reduce_op.reset();
          } else {
            c.reduce_op.emplace();
            read_string(JsonPath(path, "reduce_op"), *c.reduce_op);
          }
          break;
        case kCollBytes: c.bytes = read_int64(JsonPath(path, "bytes")); break;
        case kCollNodes: c.nodes = read_int32(JsonPath(path, "nodes")); break;
        case kCollRole: {
          const JsonPath role_path(path, "role");
          read_string(role_path, scratch_type_);
          try {
            c.role = collective_role_from_string(scratch_type_);
          } catch (const IrError& e) {
            fail_at(role_path, e.what());
          }
          break;
        }
      }
    });
    // reduce_op is required even when null: absent and null must not mean different things. role is optional.
    require(path, kCollectiveKeys, seen, all_keys<5>());
    return c;
  }

  void read_module_entry(const JsonPath& path, std::pair<std::string, std::string>& entry) {
    const size_t start = lx_.offset();
    bool is_pair = lx_.peek() == '[';
    size_t count = 0;
    if (is_pair) {
      lx_.array([&](size_t i) {
        count = i + 1;
        if (i < 2 && lx_.peek() == '"') {
          (i == 0 ? entry.first : entry.second).assign(lx_.string(scratch_));
        } else {
          is_pair = false;
          lx_.skip_value();
        }
      });
    }
    if (!is_pair || count != 2) {
      lx_.seek(start);
      fail_type(path, "a [path, type] pair of strings");
    }
  }

  void read_node(const JsonPath& path, Node& node) {
    const uint32_t seen = read_fields(path, kNodeKeys, [&](size_t k) {
      switch (k) {
        case kId: node.id = read_int32(JsonPath(path, "id")); break;
        case kName: read_string(JsonPath(path, "name"), node.name); break;
        case kKind: {
          const JsonPath kind_path(path, "kind");
          read_string(kind_path, scratch_type_);
          try {
            node.kind = node_kind_from_string(scratch_type_);
          } catch (const IrError& e) {
            fail_at(kind_path, e.what());
          }
          break;
        }
        case kOp: read_string(JsonPath(path, "op"), node.op); break;
        case kInputs: {
          const JsonPath inputs_path(path, "inputs");
          read_array(inputs_path, [&](size_t i) { node.inputs.push_back(read_int32(JsonPath(inputs_path, i))); });
          break;
        }
        case kOutputs: {
          const JsonPath outputs_path(path, "outputs");
          read_array(outputs_path, [&](size_t i) { node.outputs.push_back(read_tensor(JsonPath(outputs_path, i))); });
          break;
        }
        case kFlops: node.flops = read_int64(JsonPath(path, "flops")); break;
        case kBytesAccessed: node.bytes_accessed = read_int64(JsonPath(path, "bytes_accessed")); break;
        case kModuleStack: {
          const JsonPath stack_path(path, "module_stack");
          read_array(stack_path, [&](size_t i) {
            node.module_stack.emplace_back();
            read_module_entry(JsonPath(stack_path, i), node.module_stack.back());
          });
          break;
        }
        case kBlock: node.block = read_int32(JsonPath(path, "block")); break;
        case kCollective: node.collective = read_collective(JsonPath(path, "collective")); break;
      }
    });
    require(path, kNodeKeys, seen, all_keys<11>() & ~(1u << kCollective));  // collective: only for collectives
  }

  detail::JsonLexer lx_;
  std::string scratch_;
  std::string scratch_type_;
};

// ---- canonical writer ----

void append_int(std::string& out, int64_t value) {
  char buf[24];
  auto result = std::to_chars(buf, buf + sizeof(buf), value);
  out.append(buf, result.ptr);
}

// Same escaping as nlohmann's dump (UTF-8 kept verbatim, control characters escaped), so a file
// written here and one re-dumped by nlohmann agree; validate() has already rejected bad UTF-8.
void append_string(std::string& out, const std::string& s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  size_t run_start = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(s, run_start, i - run_start);
    run_start = i + 1;
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        out += "\\u00";
        out += kHex[c >> 4];
        out += kHex[c & 0xF];
    }
  }
  out.append(s, run_start, std::string::npos);
  out += '"';
}

void append_key(std::string& out, const char* key) {
  out += '"';
  out += key;
  out += "\": ";
}

void append_node(std::string& out, const Node& node) {
  out += '{';
  append_key(out, "id");
  append_int(out, node.id);
  out += ", ";
  append_key(out, "name");
  append_string(out, node.name);
  out += ", ";
  append_key(out, "kind");
  append_string(out, to_string(node.kind));
  out += ", ";
  append_key(out, "op");
  append_string(out, node.op);
  out += ", ";
  append_key(out, "inputs");
  out += '[';
  for (size_t k = 0; k < node.inputs.size(); ++k) {
    if (k) out += ", ";
    append_int(out, node.inputs[k]);
  }
  out += "], ";
  append_key(out, "outputs");
  out += '[';
  for (size_t k = 0; k < node.outputs.size(); ++k) {
    const TensorInfo& t = node.outputs[k];
    if (k) out += ", ";
    out += '{';
    append_key(out, "shape");
    out += '[';
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d) out += ", ";
      append_int(out, t.shape[d]);
    }
    out += "], ";
    append_key(out, "dtype");
    append_string(out, t.dtype);
    out += ", ";
    append_key(out, "bytes");
    append_int(out, t.bytes);
    out += '}';
  }
  out += "], ";
  append_key(out, "flops");
  append_int(out, node.flops);
  out += ", ";
  append_key(out, "bytes_accessed");
  append_int(out, node.bytes_accessed);
  out += ", ";
  append_key(out, "module_stack");
  out += '[';
  for (size_t k = 0; k < node.module_stack.size(); ++k) {
    if (k) out += ", ";
    out += '[';
    append_string(out, node.module_stack[k].first);
    out += ", ";
    append_string(out, node.module_stack[k].second);
    out += ']';
  }
  out += "], ";
  append_key(out, "block");
  append_int(out, node.block);
  if (node.collective) {
    const CollectiveInfo& c = *node.collective;
    out += ", ";
    append_key(out, "collective");
    out += '{';
    append_key(out, "type");
    append_string(out, to_string(c.type));
    out += ", ";
    append_key(out, "group");
    append_string(out, c.group);
    out += ", ";
    append_key(out, "group_size");
    append_int(out, c.group_size);
    out += ", ";
    append_key(out, "reduce_op");
    if (c.reduce_op) {
      append_string(out, *c.reduce_op);
    } else {
      out += "null";
    }
    out += ", ";
    append_key(out, "bytes");
    append_int(out, c.bytes);
    if (c.role != CollectiveRole::Unknown) {
      out += ", ";
      append_key(out, "role");
      append_string(out, to_string(c.role));
    }
    if (c.nodes > 0) {
      out += ", ";
      append_key(out, "nodes");
      append_int(out, c.nodes);
    }
    out += '}';
  }
  out += '}';
}

void append_meta(std::string& out, const json& meta) {
  out += '{';
  bool first = true;
  for (auto it = meta.begin(); it != meta.end(); ++it) {  // nlohmann::json keeps keys sorted
    if (!first) out += ", ";
    first = false;
    append_string(out, it.key());
    out += ": ";
    if (it->is_string()) {
      append_string(out, it->get_ref<const std::string&>());
    } else {
      out += it->dump();  // numbers and booleans, in the parser's own round-tripping format
    }
  }
  out += '}';
}

json tensor_to_json(const TensorInfo& t) {
  return json{{"shape", t.shape}, {"dtype", t.dtype}, {"bytes", t.bytes}};
}

}  // namespace

Document ir_from_json(const json& j) {
  // One reader for both entry points, so a document is judged identically however it arrives.
  std::string text;
  try {
    text = j.dump();
  } catch (const json::exception& e) {
    throw IrError(std::string("document: cannot be written as JSON: ") + e.what());
  }
  return load_ir(text);
}

Document load_ir(const std::string& json_text) {
  try {
    return IrReader(json_text).read();
  } catch (const detail::JsonSyntaxError& e) {
    // Rare path: let nlohmann word the message, as every other JSON consumer here would.
    try {
      const json parsed = json::parse(json_text);
      (void)parsed;
    } catch (const json::parse_error& pe) {
      std::string message = pe.what();
      const auto tag_end = message.find("] ");
      if (message.rfind("[json.exception.", 0) == 0 && tag_end != std::string::npos) message.erase(0, tag_end + 2);
      throw IrError("malformed JSON: " + message + " (byte " + std::to_string(pe.byte) + ")");
    } catch (const json::exception&) {
      // out_of_range (a number beyond a double) and the like: our lexer's own message says where.
    }
    throw IrError("malformed JSON: " + e.message + " (byte " + std::to_string(e.byte + 1) + ")");
  }
}

std::string save_ir(const Document& doc) {
  validate(doc);
  size_t num_nodes = 0;
  for (const Graph& g : doc.graphs) num_nodes += g.nodes.size();
  std::string out;
  out.reserve(256 + 64 * doc.blocks.size() + 320 * num_nodes);

  out += "{\n  \"schema\": ";
  append_string(out, kIrSchema);
  out += ",\n  \"meta\": ";
  append_meta(out, doc.meta);
  out += ",\n  \"blocks\": [";
  for (size_t i = 0; i < doc.blocks.size(); ++i) {
    const Block& b = doc.blocks[i];
    out += i ? ",\n    {" : "\n    {";
    append_key(out, "id");
    append_int(out, b.id);
    out += ", ";
    append_key(out, "path");
    append_string(out, b.path);
    out += ", ";
    append_key(out, "type");
    append_string(out, b.type);
    out += '}';
  }
  out += doc.blocks.empty() ? "],\n" : "\n  ],\n";
  out += "  \"graphs\": [";
  for (size_t i = 0; i < doc.graphs.size(); ++i) {
    const Graph& g = doc.graphs[i];
    out += i ? ",\n    {\n      \"name\": " : "\n    {\n      \"name\": ";
    append_string(out, g.name);
    out += ",\n      \"nodes\": [";
    for (size_t k = 0; k < g.nodes.size(); ++k) {
      out += k ? ",\n        " : "\n        ";
      append_node(out, g.nodes[k]);
    }
    out += g.nodes.empty() ? "]\n    }" : "\n      ]\n    }";
  }
  out += "\n  ]\n}\n";
  return out;
}

json ir_to_json(const Document& doc) {
  validate(doc);
  json j = json::object();
  j["schema"] = kIrSchema;
  j["meta"] = doc.meta;
  json blocks = json::array();
  for (const Block& b : doc.blocks) blocks.push_back(json{{"id", b.id}, {"path", b.path}, {"type", b.type}});
  j["blocks"] = std::move(blocks);
  json graphs = json::array();
  for (const Graph& g : doc.graphs) {
    json nodes = json::array();
    for (const Node& n : g.nodes) {
      json node = json::object();
      node["id"] = n.id;
      node["name"] = n.name;
      node["kind"] = to_string(n.kind);
      node["op"] = n.op;
      node["inputs"] = n.inputs;
      json outputs = json::array();
      for (const TensorInfo& t : n.outputs) outputs.push_back(tensor_to_json(t));
      node["outputs"] = std::move(outputs);
      node["flops"] = n.flops;
      node["bytes_accessed"] = n.bytes_accessed;
      json stack = json::array();
      for (const auto& [path, type] : n.module_stack) stack.push_back(json::array({path, type}));
      node["module_stack"] = std::move(stack);
      node["block"] = n.block;
      if (n.collective) {
        const CollectiveInfo& c = *n.collective;
        node["collective"] = json{{"type", to_string(c.type)},
                                  {"group", c.group},
                                  {"group_size", c.group_size},
                                  {"reduce_op", c.reduce_op ? json(*c.reduce_op) : json(nullptr)},
                                  {"bytes", c.bytes}};
        if (c.role != CollectiveRole::Unknown) node["collective"]["role"] = to_string(c.role);
        if (c.nodes > 0) node["collective"]["nodes"] = c.nodes;
      }
      nodes.push_back(std::move(node));
    }
    graphs.push_back(json{{"name", g.name}, {"nodes", std::move(nodes)}});
  }
  j["graphs"] = std::move(graphs);
  return j;
}

}  // namespace ce_overlap
