// IR load/validate/save: canonical round trips and one rejection per rule, each naming its JSON path.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "graph/analysis.h"
#include "graph/ir.h"
#include "graph_builder.h"

namespace ce_overlap {
namespace {

using json = nlohmann::json;
using testing::GraphBuilder;
using testing::make_doc;
using testing::tensor;

// x, w -> all_gather(w) -> wait -> mm(x, wait) -> view -> reduce_scatter -> wait -> output
Document base_doc() {
  GraphBuilder b("forward");
  const int x = b.placeholder("x");
  const int w = b.placeholder("w");
  const int ag = b.collective("ag", {w});
  const int ag_wait = b.wait("ag_wait", ag);
  const int mm = b.compute("mm", {x, ag_wait}, tensor({4, 4}), 128);
  const int v = b.view("v", mm);
  const int rs = b.collective("rs", {v}, CollectiveType::ReduceScatter, tensor({1, 4}));
  const int rs_wait = b.wait("rs_wait", rs, tensor({1, 4}));
  b.output({rs_wait});
  return make_doc({b.graph()});
}

json base_json() { return json::parse(save_ir(base_doc())); }

// The message of the IrError that loading `text` throws, or "" if it loads.
std::string load_error(const std::string& text) {
  try {
    load_ir(text);
  } catch (const IrError& e) {
    return e.what();
  }
  return "";
}

std::string mutated_error(const std::function<void(json&)>& mutate) {
  json j = base_json();
  mutate(j);
  return load_error(j.dump());
}

json& node(json& j, int i) { return j["graphs"][0]["nodes"][i]; }

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

#define EXPECT_STARTS_WITH(s, prefix) EXPECT_TRUE(starts_with((s), (prefix))) << "message: " << (s)

TEST(IrRoundTrip, BaseDocLoadsAndSavesByteIdentical) {
  const std::string s1 = save_ir(base_doc());
  const Document d = load_ir(s1);
  const std::string s2 = save_ir(d);
  EXPECT_EQ(s1, s2);
  EXPECT_EQ(save_ir(load_ir(s2)), s2);
  ASSERT_EQ(d.graphs.size(), 1u);
  ASSERT_EQ(d.graphs[0].nodes.size(), 9u);
  EXPECT_EQ(d.graphs[0].nodes[4].flops, 128);
  EXPECT_FALSE(d.graphs[0].nodes[2].collective->reduce_op.has_value());
  EXPECT_EQ(*d.graphs[0].nodes[6].collective->reduce_op, "sum");
  EXPECT_EQ(d.graphs[0].nodes[6].collective->bytes, 16);
}

TEST(IrRoundTrip, EscapesUnicodeMetaAndTwoGraphsSurvive) {
  GraphBuilder fwd("forward");
  const int p = fwd.placeholder("in \"quoted\" \\ back\tslash\x01 caf\xC3\xA9 \xE6\x97\xA5");
  const int c = fwd.compute("mm", {p, p}, tensor({2, 3}, "bfloat16"), 12);
  fwd.node(c).module_stack = {{"layers.0", "TransformerBlock"}, {"layers.0.wq", "Linear"}};
  fwd.node(c).block = 0;
  fwd.node(c).bytes_accessed = 36;
  fwd.output({c});
  GraphBuilder bwd("backward");
  const int g = bwd.placeholder("grad", tensor({0, 7}, "complex128"));  // empty tensor: 0 bytes
  const int ar = bwd.collective("ar", {g}, CollectiveType::AllReduce, tensor({0, 7}, "complex128"));
  bwd.node(ar).collective->reduce_op = "avg";
  bwd.wait("ar_wait", ar, tensor({0, 7}, "complex128"));
  Document doc = make_doc({fwd.graph(), bwd.graph()});
  doc.meta = {{"zeta", "last"}, {"alpha", 0.1}, {"big", 18446744073709551615ull}, {"neg", -3},
              {"flag", true}, {"exp", 1e300}};
  doc.blocks = {{0, "layers.0", "TransformerBlock"}};

  const std::string s1 = save_ir(doc);
  const Document d = load_ir(s1);
  EXPECT_EQ(save_ir(d), s1);
  EXPECT_EQ(d.graphs[0].nodes[0].name, doc.graphs[0].nodes[0].name);
  EXPECT_EQ(d.meta, doc.meta);
  EXPECT_EQ(d.graphs[1].nodes[0].outputs[0].bytes, 0);
  EXPECT_EQ(d.graphs[0].nodes[1].module_stack, doc.graphs[0].nodes[1].module_stack);
  EXPECT_EQ(*d.graphs[1].nodes[1].collective->reduce_op, "avg");
  // Meta keys come out sorted.
  EXPECT_LT(s1.find("\"alpha\""), s1.find("\"zeta\""));
  // ir_to_json is the same document.
  EXPECT_EQ(save_ir(ir_from_json(ir_to_json(doc))), s1);
}

TEST(IrRoundTrip, NonCanonicalInputBecomesCanonicalAndStaysSo) {
  json j = base_json();
  j["meta"] = {{"b", 1}, {"a", "x"}};
  const std::string compact = j.dump();      // no newlines, nlohmann key order
  const std::string indented = j.dump(4);    // another layout of the same document
  const std::string s = save_ir(load_ir(compact));
  EXPECT_EQ(save_ir(load_ir(indented)), s);
  EXPECT_EQ(save_ir(load_ir(s)), s);
}

TEST(IrRoundTrip, CanonicalLayoutIsOneNodePerLine) {
  GraphBuilder b("forward");
  const int x = b.placeholder("x", tensor({2}, "int64"));
  const int ag = b.collective("ag", {x}, CollectiveType::AllGather, tensor({16}, "int64"));
  b.node(ag).collective->bytes = 16;
  Document doc = make_doc({b.graph()});
  doc.meta = {{"world_size", 8}, {"model", "m"}};
  doc.blocks = {{0, "layers.0", "Block"}, {1, "layers.1", "Block"}};
  const std::string expected =
      "{\n"
      "  \"schema\": \"ce_overlap.ir/1\",\n"
      "  \"meta\": {\"model\": \"m\", \"world_size\": 8},\n"
      "  \"blocks\": [\n"
      "    {\"id\": 0, \"path\": \"layers.0\", \"type\": \"Block\"},\n"
      "    {\"id\": 1, \"path\": \"layers.1\", \"type\": \"Block\"}\n"
      "  ],\n"
      "  \"graphs\": [\n"
      "    {\n"
      "      \"name\": \"forward\",\n"
      "      \"nodes\": [\n"
      "        {\"id\": 0, \"name\": \"x\", \"kind\": \"other\", \"op\": \"placeholder\", \"inputs\": [], "
      "\"outputs\": [{\"shape\": [2], \"dtype\": \"int64\", \"bytes\": 16}], \"flops\": 0, \"bytes_accessed\": 0, "
      "\"module_stack\": [], \"block\": -1},\n"
      "        {\"id\": 1, \"name\": \"ag\", \"kind\": \"collective\", \"op\": \"_c10d_functional.collective.default\", "
      "\"inputs\": [0], \"outputs\": [{\"shape\": [16], \"dtype\": \"int64\", \"bytes\": 128}], \"flops\": 0, "
      "\"bytes_accessed\": 0, \"module_stack\": [], \"block\": -1, \"collective\": {\"type\": \"all_gather\", "
      "\"group\": \"0\", \"group_size\": 8, \"reduce_op\": null, \"bytes\": 16}}\n"
      "      ]\n"
      "    }\n"
      "  ]\n"
      "}\n";
  EXPECT_EQ(save_ir(doc), expected);
  EXPECT_EQ(save_ir(load_ir(expected)), expected);
}

TEST(IrRoundTrip, EmptyBlocksAndEmptyGraph) {
  Graph empty;
  empty.name = "empty";
  Document doc = make_doc({empty});
  doc.meta = json::object();
  const std::string s = save_ir(doc);
  EXPECT_EQ(s,
            "{\n  \"schema\": \"ce_overlap.ir/1\",\n  \"meta\": {},\n  \"blocks\": [],\n  \"graphs\": [\n    {\n"
            "      \"name\": \"empty\",\n      \"nodes\": []\n    }\n  ]\n}\n");
  EXPECT_EQ(save_ir(load_ir(s)), s);
}

TEST(IrEnums, NamesAndItemsizes) {
  EXPECT_STREQ(to_string(NodeKind::Wait), "wait");
  EXPECT_STREQ(to_string(CollectiveType::ReduceScatter), "reduce_scatter");
  EXPECT_EQ(node_kind_from_string("view"), NodeKind::View);
  EXPECT_EQ(collective_type_from_string("recv"), CollectiveType::Recv);
  EXPECT_EQ(dtype_itemsize("bfloat16"), 2);
  EXPECT_EQ(dtype_itemsize("float8_e4m3fn"), 1);
  EXPECT_EQ(dtype_itemsize("complex128"), 16);
  EXPECT_EQ(dtype_itemsize("bool"), 1);
  EXPECT_THROW(dtype_itemsize("float128"), IrError);
  try {
    collective_type_from_string("allgather");
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(),
                 "unknown collective type \"allgather\" (accepted: all_gather, reduce_scatter, all_reduce, "
                 "all_to_all, broadcast, send, recv)");
  }
}

TEST(IrReject, Cycle) {
  const std::string e = mutated_error([](json& j) { node(j, 4)["inputs"] = {0, 5}; });
  EXPECT_EQ(e, "graphs[0]: dependency cycle through nodes mm -> v -> mm");
}

TEST(IrReject, LongerCycleNamesItsNodesInDataFlowOrder) {
  // rs_wait(7) -> mm(4) -> v(5) -> rs(6) -> rs_wait(7)
  const std::string e = mutated_error([](json& j) { node(j, 4)["inputs"] = {0, 7}; });
  EXPECT_EQ(e, "graphs[0]: dependency cycle through nodes mm -> v -> rs -> rs_wait -> mm");
}

TEST(IrReject, UnknownKind) {
  const std::string e = mutated_error([](json& j) { node(j, 5)["kind"] = "foo"; });
  EXPECT_EQ(e, "graphs[0].nodes[5].kind: unknown kind \"foo\" (accepted: compute, collective, wait, view, other)");
}

TEST(IrReject, BadSchema) {
  EXPECT_EQ(mutated_error([](json& j) { j["schema"] = "ce_overlap.ir/2"; }),
            "schema: expected \"ce_overlap.ir/1\", got \"ce_overlap.ir/2\"");
  EXPECT_EQ(mutated_error([](json& j) { j.erase("schema"); }), "schema: missing required field");
  EXPECT_EQ(mutated_error([](json& j) { j["schema"] = 1; }), "schema: expected \"ce_overlap.ir/1\", got 1");
}

TEST(IrReject, NegativeSizes) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0]["shape"][0] = -4; }),
            "graphs[0].nodes[4].outputs[0].shape[0]: expected a non-negative integer, got -4");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["flops"] = -1; }),
            "graphs[0].nodes[4].flops: expected a non-negative integer, got -1");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["bytes_accessed"] = -8; }),
            "graphs[0].nodes[4].bytes_accessed: expected a non-negative integer, got -8");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["bytes"] = -1; }),
            "graphs[0].nodes[2].collective.bytes: expected a non-negative integer, got -1");
}

TEST(IrReject, AbsurdSizes) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0]["bytes"] = int64_t{1} << 51; }),
            "graphs[0].nodes[4].outputs[0].bytes: expected at most 2^50 = 1125899906842624, got 2251799813685248");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40}; }),
            "graphs[0].nodes[4].outputs[0].shape: numel x itemsize exceeds 2^50 bytes");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["flops"] = int64_t{2000000000000000000}; }),
            "graphs[0].nodes[4].flops: expected at most 10^18 = 1000000000000000000, got 2000000000000000000");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["bytes_accessed"] = (int64_t{1} << 50) + 1; }),
            "graphs[0].nodes[4].bytes_accessed: expected at most 2^50 = 1125899906842624, got 1125899906842625");
}

TEST(IrReject, BytesMismatch) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0]["bytes"] = 60; }),
            "graphs[0].nodes[4].outputs[0].bytes: expected bytes = numel x itemsize = 64, got 60");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0]["dtype"] = "bfloat16"; }),
            "graphs[0].nodes[4].outputs[0].bytes: expected bytes = numel x itemsize = 32, got 64");
}

TEST(IrReject, MissingField) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4).erase("op"); }), "graphs[0].nodes[4].op: missing required field");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0].erase("dtype"); }),
            "graphs[0].nodes[4].outputs[0].dtype: missing required field");
  EXPECT_EQ(mutated_error([](json& j) { j.erase("blocks"); }), "blocks: missing required field");
  EXPECT_EQ(mutated_error([](json& j) { j["graphs"][0].erase("name"); }), "graphs[0].name: missing required field");
}

TEST(IrReject, UnknownKey) {
  const std::string e = mutated_error([](json& j) { node(j, 2)["flopz"] = 1; });
  EXPECT_STARTS_WITH(e, "graphs[0].nodes[2]: unknown key \"flopz\" (accepted: id, name, kind, op,");
  EXPECT_STARTS_WITH(mutated_error([](json& j) { j["extra"] = 1; }), "document: unknown key \"extra\"");
  EXPECT_STARTS_WITH(mutated_error([](json& j) { node(j, 2)["collective"]["reduceop"] = nullptr; }),
                     "graphs[0].nodes[2].collective: unknown key \"reduceop\"");
}

TEST(IrReject, WrongTypes) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["flops"] = "12"; }),
            "graphs[0].nodes[4].flops: expected an integer, got \"12\"");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["inputs"] = {0, 1.5}; }),
            "graphs[0].nodes[4].inputs[1]: expected an integer, got 1.5");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["outputs"][0]["bytes"] = 64.0; }),
            "graphs[0].nodes[4].outputs[0].bytes: expected an integer, got 64.0");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["name"] = 5; }),
            "graphs[0].nodes[4].name: expected a string, got 5");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["inputs"] = 3; }),
            "graphs[0].nodes[4].inputs: expected an array, got 3");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["block"] = int64_t{1} << 40; }),
            "graphs[0].nodes[4].block: expected an integer within int32, got 1099511627776");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["module_stack"] = json::array({json::array({"layers.0"})}); }),
            "graphs[0].nodes[4].module_stack[0]: expected a [path, type] pair of strings, got an array");
  EXPECT_EQ(mutated_error([](json& j) { j["meta"]["nested"] = {{"a", 1}}; }),
            "meta.nested: expected a string, number or boolean, got object");
  EXPECT_EQ(load_error("[1, 2]"), "document: expected an object, got an array");

  // Beyond int64 (fits uint64) and beyond uint64 (parsed as a float) are both refused.
  std::string text = base_json().dump();
  const std::string flops = "\"flops\":128";
  ASSERT_NE(text.find(flops), std::string::npos);
  std::string big = text;
  big.replace(big.find(flops), flops.size(), "\"flops\":9223372036854775808");
  EXPECT_EQ(load_error(big), "graphs[0].nodes[4].flops: expected an integer within int64, got 9223372036854775808");
  std::string huge = text;
  huge.replace(huge.find(flops), flops.size(), "\"flops\":1e30");
  EXPECT_EQ(load_error(huge), "graphs[0].nodes[4].flops: expected an integer, got 1e+30");
}

TEST(IrReject, BadInputIds) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["inputs"] = {0, 99}; }),
            "graphs[0].nodes[4].inputs[1]: node id 99 out of range [0, 9)");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["inputs"] = {-1}; }),
            "graphs[0].nodes[4].inputs[0]: node id -1 out of range [0, 9)");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["id"] = 7; }),
            "graphs[0].nodes[4].id: expected 4 (ids equal the position), got 7");
}

TEST(IrReject, SelfLoop) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["inputs"] = {4}; }),
            "graphs[0].nodes[4].inputs[0]: a node cannot be its own input (4)");
}

TEST(IrReject, DuplicateInputsAreAllowed) {
  json j = base_json();
  node(j, 4)["inputs"] = {0, 0, 3};
  EXPECT_EQ(load_ir(j.dump()).graphs[0].nodes[4].inputs, (std::vector<int>{0, 0, 3}));
}

TEST(IrReject, WaitWithoutCollective) {
  EXPECT_EQ(mutated_error([](json& j) {
              node(j, 0)["op"] = "get_attr";  // kind other, but no graph input
              node(j, 3)["inputs"] = {0};
            }),
            "graphs[0].nodes[3].inputs[0]: a wait's input must be a collective, a graph input (placeholder) or a "
            "view chain ending at one; the chain ends at node 0 (\"x\") of kind other");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 3)["inputs"] = {2, 0}; }),
            "graphs[0].nodes[3].inputs: a wait takes exactly one input, got 2");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 7)["inputs"] = {5}; }),  // view of a compute
            "graphs[0].nodes[7].inputs[0]: a wait's input must be a collective, a graph input (placeholder) or a "
            "view chain ending at one; the chain ends at node 4 (\"mm\") of kind compute");
}

TEST(IrReject, WaitThroughViewChainIsAccepted) {
  // Coalesced collectives hand out views; a wait on a getitem of one is valid.
  GraphBuilder b;
  const int x = b.placeholder("x");
  const int ag = b.collective("ag_coalesced", {x});
  const int item = b.view("getitem", ag);
  const int item2 = b.view("getitem_view", item);
  b.wait("wait", item2);
  EXPECT_NO_THROW(validate(make_doc({b.graph()})));
}

// A collective issued in one graph and waited on in the next: the forward all-gathers a tied weight (read by
// the embedding and the output projection), waits on it, and hands the collective's output to the backward,
// which waits on it again. The backward's wait reads a graph input. It is valid, has no collective in its
// graph, so it is neither bucketed nor counted, costs no time and keeps its place in a plan.
TEST(IrReject, WaitOnGraphInputIsAccepted) {
  GraphBuilder b("backward");
  const int saved = b.placeholder("all_gather_into_tensor", tensor({8, 4}, "bfloat16"));
  const int grad = b.placeholder("tangents_1", tensor({4, 8}, "bfloat16"));
  const int item = b.view("view", saved, tensor({8, 4}, "bfloat16"));
  const int w = b.wait("wait_tensor_28", item, tensor({8, 4}, "bfloat16"));
  const int mm = b.compute("mm", {grad, w}, tensor({4, 4}, "bfloat16"), 2 * 4 * 8 * 4);
  b.output({mm});
  Document doc = make_doc({b.graph()});
  EXPECT_NO_THROW(validate(doc));
  EXPECT_EQ(waited_collective(doc.graphs[0], w), -1);
  // Survives a JSON round trip.
  EXPECT_EQ(load_ir(save_ir(doc)).graphs[0].nodes[w].inputs, (std::vector<int>{item}));
}

TEST(IrReject, ViewWithoutInput) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 5)["inputs"] = json::array(); }),
            "graphs[0].nodes[5].inputs: a view needs an input (its output aliases the first input)");
}

TEST(IrReject, CollectiveFields) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2).erase("collective"); }),
            "graphs[0].nodes[2].collective: missing required field (kind is collective)");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"].erase("group"); }),
            "graphs[0].nodes[2].collective.group: missing required field");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"].erase("reduce_op"); }),
            "graphs[0].nodes[2].collective.reduce_op: missing required field");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["group"] = ""; }),
            "graphs[0].nodes[2].collective.group: expected a non-empty string");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["group_size"] = 0; }),
            "graphs[0].nodes[2].collective.group_size: expected an integer in 1..65536, got 0");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["group_size"] = 65537; }),
            "graphs[0].nodes[2].collective.group_size: expected an integer in 1..65536, got 65537");
  EXPECT_STARTS_WITH(mutated_error([](json& j) { node(j, 2)["collective"]["type"] = "allgather"; }),
                     "graphs[0].nodes[2].collective.type: unknown collective type \"allgather\"");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["collective"] = node(j, 2)["collective"]; }),
            "graphs[0].nodes[4].collective: must be absent: only collectives carry one, kind is compute");
}

TEST(IrRoundTrip, CollectiveRoleIsOptionalAndRoundTrips) {
  // Absent: unknown (IRs captured before roles); "dp" / "tp" are written back, unknown is not written.
  Document d = load_ir(save_ir(base_doc()));
  EXPECT_EQ(d.graphs[0].nodes[2].collective->role, CollectiveRole::Unknown);
  EXPECT_EQ(save_ir(base_doc()).find("\"role\""), std::string::npos);
  d.graphs[0].nodes[2].collective->role = CollectiveRole::DataParallel;
  d.graphs[0].nodes[6].collective->role = CollectiveRole::TensorParallel;
  const std::string text = save_ir(d);
  EXPECT_NE(text.find("\"role\": \"tp\""), std::string::npos);
  const Document back = load_ir(text);
  EXPECT_EQ(back.graphs[0].nodes[2].collective->role, CollectiveRole::DataParallel);
  EXPECT_EQ(back.graphs[0].nodes[6].collective->role, CollectiveRole::TensorParallel);
  EXPECT_EQ(save_ir(back), text);
  EXPECT_EQ(save_ir(ir_from_json(ir_to_json(back))), text);
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["role"] = "pp"; }),
            "graphs[0].nodes[2].collective.role: unknown collective role \"pp\" (accepted: dp, tp, replicate)");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["role"] = 1; }),
            "graphs[0].nodes[2].collective.role: expected a string, got 1");
}

TEST(IrRoundTrip, CollectiveNodesAreOptionalAndBoundedByTheGroup) {
  Document d = load_ir(save_ir(base_doc()));
  EXPECT_EQ(d.graphs[0].nodes[2].collective->nodes, 0);  // absent: not known
  d.graphs[0].nodes[2].collective->nodes = 2;
  const std::string text = save_ir(d);
  EXPECT_NE(text.find("\"nodes\": 2"), std::string::npos);
  EXPECT_EQ(load_ir(text).graphs[0].nodes[2].collective->nodes, 2);
  EXPECT_EQ(save_ir(ir_from_json(ir_to_json(load_ir(text)))), text);
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["nodes"] = 9; }),
            "graphs[0].nodes[2].collective.nodes: expected an integer in 1..8 (the group's nodes, at most its ranks), "
            "got 9");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["nodes"] = -1; }),
            "graphs[0].nodes[2].collective.nodes: expected an integer in 1..8 (the group's nodes, at most its ranks), "
            "got -1");
}

TEST(IrReject, ReduceOp) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 6)["collective"]["reduce_op"] = nullptr; }),
            "graphs[0].nodes[6].collective.reduce_op: required for reduce_scatter (accepted: sum, avg, max, min, "
            "product), got null");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 6)["collective"]["reduce_op"] = "mean"; }),
            "graphs[0].nodes[6].collective.reduce_op: unknown reduce_op \"mean\" (accepted: sum, avg, max, min, "
            "product)");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 2)["collective"]["reduce_op"] = "sum"; }),
            "graphs[0].nodes[2].collective.reduce_op: must be null for all_gather, got \"sum\"");
}

TEST(IrReject, DuplicateNames) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 5)["name"] = "mm"; }),
            "graphs[0].nodes[5].name: duplicate name \"mm\" (also nodes[4])");
  EXPECT_EQ(mutated_error([](json& j) { j["graphs"].push_back(j["graphs"][0]); }),
            "graphs[1].name: duplicate graph name \"forward\" (also graphs[0])");
  EXPECT_EQ(mutated_error([](json& j) {
              j["blocks"] = {{{"id", 0}, {"path", "layers.0"}, {"type", "B"}},
                             {{"id", 1}, {"path", "layers.0"}, {"type", "B"}}};
            }),
            "blocks[1].path: duplicate path \"layers.0\" (also blocks[0])");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 5)["name"] = ""; }),
            "graphs[0].nodes[5].name: expected a non-empty string");
}

TEST(IrReject, BlocksAndGraphs) {
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["block"] = 5; }),
            "graphs[0].nodes[4].block: expected -1 or a block id in [0, 0), got 5");
  EXPECT_EQ(mutated_error([](json& j) { node(j, 4)["block"] = -2; }),
            "graphs[0].nodes[4].block: expected -1 or a block id in [0, 0), got -2");
  EXPECT_EQ(mutated_error([](json& j) { j["blocks"] = {{{"id", 1}, {"path", "layers.0"}, {"type", "B"}}}; }),
            "blocks[0].id: expected 0 (ids equal the position), got 1");
  EXPECT_EQ(mutated_error([](json& j) { j["blocks"] = {{{"id", 0}, {"path", ""}, {"type", "B"}}}; }),
            "blocks[0].path: expected a non-empty string");
  EXPECT_EQ(mutated_error([](json& j) { j["graphs"] = json::array(); }), "graphs: expected at least one graph");
  EXPECT_STARTS_WITH(mutated_error([](json& j) { node(j, 4)["outputs"][0]["dtype"] = "float128"; }),
                     "graphs[0].nodes[4].outputs[0].dtype: unknown dtype \"float128\" (accepted: float64,");
  // A valid block reference loads.
  json j = base_json();
  j["blocks"] = {{{"id", 0}, {"path", "layers.0"}, {"type", "B"}}};
  node(j, 4)["block"] = 0;
  EXPECT_EQ(load_ir(j.dump()).graphs[0].nodes[4].block, 0);
}

TEST(IrReject, MalformedJson) {
  const std::string e = load_error("{\"schema\": \"ce_overlap.ir/1\", \"meta\": {,}}");
  EXPECT_STARTS_WITH(e, "malformed JSON: parse error at line 1, column 40");
  EXPECT_NE(e.find("(byte 40)"), std::string::npos) << e;
  EXPECT_STARTS_WITH(load_error(""), "malformed JSON: ");
  EXPECT_STARTS_WITH(load_error(save_ir(base_doc()) + "x"), "malformed JSON: ");
  EXPECT_STARTS_WITH(load_error("{\"schema\": \"\xFF\"}"), "malformed JSON: ");  // invalid UTF-8
}

TEST(IrReject, SchemaIsJudgedFirstWhereverItSits) {
  json j = base_json();
  j["schema"] = "ce_overlap.ir/2";
  node(j, 2)["renamed_in_v2"] = 1;
  const std::string sorted = j.dump();  // nlohmann sorts keys: "schema" comes last
  ASSERT_GT(sorted.find("\"schema\""), sorted.find("\"graphs\""));
  EXPECT_EQ(load_error(sorted), "schema: expected \"ce_overlap.ir/1\", got \"ce_overlap.ir/2\"");
}

TEST(IrReject, DuplicateKeys) {
  // A DOM would keep the last value silently; the reader refuses.
  std::string text = base_json().dump();
  const std::string flops = "\"flops\":128";
  text.replace(text.find(flops), flops.size(), "\"flops\":128,\"flops\":7");
  EXPECT_EQ(load_error(text), "graphs[0].nodes[4]: duplicate key \"flops\"");
  EXPECT_EQ(load_error("{\"schema\": \"ce_overlap.ir/1\", \"meta\": {\"a\": 1, \"a\": 2}, \"blocks\": [], "
                       "\"graphs\": []}"),
            "meta: duplicate key \"a\"");
}

TEST(IrRoundTrip, EscapedKeysAndSurrogatePairsDecode) {
  std::string text = save_ir(base_doc());
  const std::string key = "\"bytes_accessed\"";
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
    text.replace(at, key.size(), "\"bytes_\\u0061ccessed\"");  // \u0061 is 'a'
  }
  const std::string name = "\"name\": \"mm\"";
  text.replace(text.find(name), name.size(), "\"name\": \"mm_\\ud83d\\ude00\\/\"");
  const Document d = load_ir(text);
  EXPECT_EQ(d.graphs[0].nodes[4].name, "mm_\xF0\x9F\x98\x80/");
  EXPECT_EQ(d.graphs[0].nodes[4].bytes_accessed, 0);
  // Saved back as raw UTF-8, canonical from then on.
  const std::string s = save_ir(d);
  EXPECT_NE(s.find("\"mm_\xF0\x9F\x98\x80/\""), std::string::npos);
  EXPECT_EQ(save_ir(load_ir(s)), s);
  EXPECT_STARTS_WITH(load_error(std::string(text).replace(text.find("\\ude00"), 6, "\\u0041")), "malformed JSON: ");
}

// Random byte edits and truncations of a valid file: the loader must answer with IrError only,
// and call the text malformed exactly when nlohmann's parser does.
TEST(IrFuzz, MutatedTextOnlyEverThrowsIrErrorAndAgreesWithNlohmannOnSyntax) {
  const std::string valid = save_ir(base_doc());
  const char replacements[] = {'{', '}', '[', ']', '"', ',', ':', '0', '9', '-', '.', 'e', 'n', ' ', '\\', 'x',
                               '\x01', '\xC3', '\xFF'};
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&state](uint64_t bound) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state % bound;
  };
  int malformed = 0, rejected = 0, accepted = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string text = valid;
    const int edits = 1 + static_cast<int>(next(3));
    for (int e = 0; e < edits; ++e) {
      const size_t at = next(text.size());
      switch (next(3)) {
        case 0: text[at] = replacements[next(sizeof(replacements))]; break;
        case 1: text.erase(at, 1 + next(4)); break;
        default: text.resize(at); break;
      }
      if (text.empty()) break;
    }
    const bool nlohmann_ok = json::accept(text);
    std::string error;
    try {
      load_ir(text);
      ++accepted;
    } catch (const IrError& e) {
      error = e.what();
    }  // anything else escapes and fails the test
    if (error.empty()) {
      EXPECT_TRUE(nlohmann_ok) << text;
      continue;
    }
    const bool says_malformed = starts_with(error, "malformed JSON: ");
    if (says_malformed) {
      ++malformed;
      EXPECT_FALSE(nlohmann_ok) << error;
    } else {
      ++rejected;
    }
  }
  EXPECT_GT(malformed, 100);
  EXPECT_GT(rejected, 100);
}

TEST(IrValidate, InMemoryDocumentsGetTheSameRules) {
  Document doc = base_doc();
  doc.graphs[0].nodes[4].outputs[0].bytes = 60;
  try {
    validate(doc);
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "graphs[0].nodes[4].outputs[0].bytes: expected bytes = numel x itemsize = 64, got 60");
  }
  EXPECT_THROW(save_ir(doc), IrError);  // never writes a file that would not load

  Document bad_utf8 = base_doc();
  bad_utf8.graphs[0].nodes[1].name = "w\xC3";
  try {
    validate(bad_utf8);
    FAIL();
  } catch (const IrError& e) {
    EXPECT_STREQ(e.what(), "graphs[0].nodes[1].name: string is not valid UTF-8");
  }

  Document nan_meta = base_doc();
  nan_meta.meta["x"] = std::nan("");
  EXPECT_THROW(validate(nan_meta), IrError);

  Document bad_kind = base_doc();
  bad_kind.graphs[0].nodes[4].kind = static_cast<NodeKind>(42);
  EXPECT_THROW(validate(bad_kind), IrError);
}

TEST(IrErrors, MessagesQuotingInvalidUtf8StayValidUtf8) {
  // nlohmann's parse error quotes the last byte read: here half of a two-byte sequence.
  const std::string message = load_error(std::string("\xc2"));
  EXPECT_STARTS_WITH(message, "malformed JSON");
  EXPECT_NE(message.find("\\xc2"), std::string::npos) << message;
  EXPECT_EQ(printable_utf8("ok \xc3\xa9 \xff\xc3"), "ok \xc3\xa9 \\xff\\xc3");
}

}  // namespace
}  // namespace ce_overlap
