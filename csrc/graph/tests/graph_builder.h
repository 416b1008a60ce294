// Test helper: builds small, valid IR graphs in code so each test states only what it is about.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "graph/ir.h"

namespace ce_overlap::testing {

inline TensorInfo tensor(std::vector<int64_t> shape, const std::string& dtype = "float32") {
  TensorInfo t;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.bytes = numel * dtype_itemsize(dtype);
  return t;
}

// A 1-D uint8 tensor of exactly `bytes` bytes, for memory tests that count bytes.
inline TensorInfo bytes_tensor(int64_t bytes) { return tensor({bytes}, "uint8"); }

class GraphBuilder {
 public:
  explicit GraphBuilder(std::string name = "forward") { graph_.name = std::move(name); }

  int add(const std::string& name, NodeKind kind, const std::string& op, std::vector<int> inputs,
          std::vector<TensorInfo> outputs) {
    Node node;
    node.id = static_cast<int>(graph_.nodes.size());
    node.name = name;
    node.kind = kind;
    node.op = op;
    node.inputs = std::move(inputs);
    node.outputs = std::move(outputs);
    graph_.nodes.push_back(std::move(node));
    return graph_.nodes.back().id;
  }

  int placeholder(const std::string& name, TensorInfo out = tensor({4, 4})) {
    return add(name, NodeKind::Other, "placeholder", {}, {std::move(out)});
  }
  int compute(const std::string& name, std::vector<int> inputs, TensorInfo out = tensor({4, 4}),
              int64_t flops = 0) {
    const int id = add(name, NodeKind::Compute, "aten.mm.default", std::move(inputs), {std::move(out)});
    graph_.nodes[id].flops = flops;
    return id;
  }
  int view(const std::string& name, int input, TensorInfo out = tensor({4, 4})) {
    return add(name, NodeKind::View, "aten.view.default", {input}, {std::move(out)});
  }
  int collective(const std::string& name, std::vector<int> inputs, CollectiveType type = CollectiveType::AllGather,
                 TensorInfo out = tensor({4, 4}), int group_size = 8) {
    const int id = add(name, NodeKind::Collective, "_c10d_functional.collective.default", std::move(inputs),
                       {std::move(out)});
    CollectiveInfo c;
    c.type = type;
    c.group = "0";
    c.group_size = group_size;
    if (type == CollectiveType::ReduceScatter || type == CollectiveType::AllReduce) c.reduce_op = "sum";
    c.bytes = graph_.nodes[id].outputs[0].bytes;
    graph_.nodes[id].collective = c;
    return id;
  }
  int wait(const std::string& name, int input, TensorInfo out = tensor({4, 4})) {
    return add(name, NodeKind::Wait, "_c10d_functional.wait_tensor.default", {input}, {std::move(out)});
  }
  int output(std::vector<int> inputs) { return add("output", NodeKind::Other, "output", std::move(inputs), {}); }

  Node& node(int id) { return graph_.nodes[id]; }
  const Graph& graph() const { return graph_; }

 private:
  Graph graph_;
};

inline Document make_doc(std::vector<Graph> graphs) {
  Document doc;
  doc.meta = {{"model", "test"}, {"world_size", 8}};
  doc.graphs = std::move(graphs);
  return doc;
}

}  // namespace ce_overlap::testing
