// The IR: one DAG of nodes per captured graph (forward, backward), free of torch.
// Schema and rules: docs/ir.md. Loading validates everything and throws IrError naming the field.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ce_overlap {

inline constexpr const char* kIrSchema = "ce_overlap.ir/1";

// `s` with every byte that is not part of a valid UTF-8 sequence written as \xNN.
std::string printable_utf8(const std::string& s);

// Every rejected input (IR, profile, plan, order) throws this; what() names the field or node. Messages
// quote the input, so they are made valid UTF-8 (printable_utf8) and every binding can show them.
class IrError : public std::runtime_error {
 public:
  explicit IrError(const std::string& message) : std::runtime_error(printable_utf8(message)) {}
};

enum class NodeKind { Compute, Collective, Wait, View, Other };
enum class CollectiveType { AllGather, ReduceScatter, AllReduce, AllToAll, Broadcast, Send, Recv };
// What a collective's group does in the parallelism of the step (optional in the IR: "role" of a collective).
// DataParallel: FSDP's parameter all-gathers and gradient reduce-scatters (the planner buckets, prefetches and may move
// them to copy engines); TensorParallel: tensor parallelism's activation collectives, on the critical path of every
// block (each stays where it was captured, on NCCL); Replicate: HSDP's gradient all-reduces across replicas (nodes),
// which follow the data-parallel reduce-scatters; Unknown: a group the capture could not name (planned as
// data-parallel, as before roles existed).
enum class CollectiveRole { Unknown, DataParallel, TensorParallel, Replicate };

const char* to_string(NodeKind kind);
const char* to_string(CollectiveType type);
const char* to_string(CollectiveRole role);  // "dp", "tp", "replicate" ("" for Unknown: not written)
CollectiveRole collective_role_from_string(const std::string& s);  // throws IrError listing the names
NodeKind node_kind_from_string(const std::string& s);            // throws IrError listing the accepted names
CollectiveType collective_type_from_string(const std::string& s);  // throws IrError listing the accepted names
// Bytes per element of a dtype name from docs/ir.md; throws IrError listing the accepted names.
int64_t dtype_itemsize(const std::string& dtype);
// An attention kernel (scaled-dot-product attention, any backend, or flex attention; forward or backward), by its op
// name: "aten._scaled_dot_product_flash_attention.default",
// "aten._scaled_dot_product_cudnn_attention_backward.default", "higher_order.flex_attention".
bool is_attention_op(const std::string& op);
// Flex attention's higher-order ops ("higher_order.flex_attention", "higher_order.flex_attention_backward"): Inductor
// lowers them to Triton templates of its own, slower than the SDPA backends' kernels.
bool is_flex_attention_op(const std::string& op);
// A layout op that pads or re-chunks a tensor ("aten.constant_pad_nd.default", "aten.cat.default",
// "aten.clone.default"): where shards are uneven, a short rank's graph has some the others lack.
bool is_layout_op(const std::string& op);

struct TensorInfo {
  std::vector<int64_t> shape;
  std::string dtype;
  int64_t bytes = 0;
};

struct CollectiveInfo {
  CollectiveType type = CollectiveType::AllGather;
  std::string group;
  int group_size = 1;
  std::optional<std::string> reduce_op;
  int64_t bytes = 0;  // bytes this rank contributes (all-gather: its shard; reduce-scatter: its full input)
  CollectiveRole role = CollectiveRole::Unknown;
  // How many nodes (machines) the group's ranks are on; 0: not known, the cost model places the group on consecutive
  // GPUs (nodes filled in order). Optional in the IR ("nodes"), at most group_size.
  int nodes = 0;
};

struct Node {
  int id = 0;
  std::string name;
  NodeKind kind = NodeKind::Other;
  std::string op;
  std::vector<int> inputs;
  std::vector<TensorInfo> outputs;
  int64_t flops = 0;
  int64_t bytes_accessed = 0;
  std::vector<std::pair<std::string, std::string>> module_stack;  // (path, type), outermost first
  int block = -1;
  std::optional<CollectiveInfo> collective;

  int64_t output_bytes() const;
};

struct Graph {
  std::string name;
  std::vector<Node> nodes;
};

struct Block {
  int id = 0;
  std::string path;
  std::string type;
};

struct Document {
  nlohmann::json meta = nlohmann::json::object();
  std::vector<Block> blocks;
  std::vector<Graph> graphs;
};

// Parse and validate; throws IrError("graphs[0].nodes[3].outputs[0].bytes: ...") on the first problem.
Document load_ir(const std::string& json_text);
Document ir_from_json(const nlohmann::json& j);
// Canonical text: load_ir(save_ir(d)) == d and save_ir(load_ir(s)) == s for any s that save_ir wrote.
std::string save_ir(const Document& doc);
nlohmann::json ir_to_json(const Document& doc);
// Re-checks a document built in memory (same rules as the loader); throws IrError.
void validate(const Document& doc);
// The graph named `name`; throws IrError("graph: no graph named ... (it has: ...)") naming the graphs there are.
const Graph& find_graph(const Document& doc, const std::string& name);

}  // namespace ce_overlap
