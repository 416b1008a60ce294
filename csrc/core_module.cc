// ce_overlap._core: the torch-free C++ core (IR, graph analysis, cost model) for Python.
// Documents cross the boundary as JSON text (validated on the C++ side) or as opaque objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <string>

#include "cost_model/analyze.h"
#include "cost_model/ce_algorithms.h"
#include "cost_model/cost_model.h"
#include "cost_model/planner.h"
#include "cost_model/profile.h"
#include "graph/analysis.h"
#include "graph/ir.h"
#include "graph/plan.h"

namespace py = pybind11;
using namespace ce_overlap;

namespace {

py::list blocks_to_list(const Document& doc) {
  py::list out;
  for (const Block& b : doc.blocks) {
    py::dict d;
    d["id"] = b.id;
    d["path"] = b.path;
    d["type"] = b.type;
    out.append(d);
  }
  return out;
}

// Arguments of the cost-model functions, checked like any other input: IrError naming the argument.
CollectiveInfo collective_arg(const std::string& type, int64_t bytes, int64_t group_size) {
  CollectiveInfo c;
  try {
    c.type = collective_type_from_string(type);
  } catch (const IrError& e) {
    throw IrError(std::string("type: ") + e.what());
  }
  constexpr int64_t kMaxBytes = int64_t{1} << 50;  // the IR's bound (docs/ir.md)
  if (bytes < 0 || bytes > kMaxBytes) {
    throw IrError("bytes: expected an integer in 0..2^50, got " + std::to_string(bytes));
  }
  if (group_size < 1 || group_size > 65536) {
    throw IrError("group_size: expected an integer in 1..65536, got " + std::to_string(group_size));
  }
  c.group = "0";
  c.group_size = static_cast<int>(group_size);
  c.bytes = bytes;
  if (c.type == CollectiveType::ReduceScatter || c.type == CollectiveType::AllReduce) c.reduce_op = "sum";
  return c;
}

double window_arg(double us, const char* name) {
  if (!std::isfinite(us) || us < 0) {
    throw IrError(std::string(name) + ": expected a non-negative number of microseconds, got " + std::to_string(us));
  }
  return us;
}

py::dict cost_to_dict(const BackendCost& b) {
  py::dict d;
  d["cost_us"] = b.cost_us;
  d["comm_us"] = b.comm_us;
  d["slowdown_us"] = b.slowdown_us;
  d["exposed_us"] = b.exposed_us;
  d["compute_bound_slowdown"] = b.slowdown.compute_bound;
  d["memory_bound_slowdown"] = b.slowdown.memory_bound;
  d["algorithm"] = b.estimate.algorithm;
  return d;
}

// A plan's config from Python: None, a dict (through json.dumps) or JSON text; errors name config.<key>.
PlanConfig config_arg(const py::object& config) {
  if (config.is_none()) return PlanConfig();
  std::string text;
  if (py::isinstance<py::str>(config)) {
    text = config.cast<std::string>();
  } else if (py::isinstance<py::dict>(config)) {
    try {
      text = py::module_::import("json").attr("dumps")(config, py::arg("allow_nan") = false).cast<std::string>();
    } catch (const py::error_already_set& e) {
      throw IrError(std::string("config: cannot be written as JSON: ") + e.what());
    }
  } else {
    throw IrError("config: expected a dict, JSON text or None, got " +
                  py::str(py::type::of(config).attr("__name__")).cast<std::string>());
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for huge numbers
    throw IrError(std::string("config: malformed JSON: ") + e.what());
  }
  return plan_config_from_json(j);
}

// An IR argument: an IrDocument, or IR JSON text (loaded and validated).
const Document& ir_arg(const py::object& ir, Document& storage) {
  if (py::isinstance<Document>(ir)) return ir.cast<const Document&>();
  if (py::isinstance<py::str>(ir)) {
    const std::string text = ir.cast<std::string>();
    py::gil_scoped_release release;
    storage = load_ir(text);
    return storage;
  }
  throw IrError("ir: expected an IrDocument or IR JSON text, got " +
                py::str(py::type::of(ir).attr("__name__")).cast<std::string>());
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "ce_overlap native core: IR, graph analysis and cost model (no torch)";
  // Bad input surfaces as the package's one documented exception type.
  py::object base = py::module_::import("ce_overlap.errors").attr("CeOverlapError");
  auto& ir_error = py::register_exception<IrError>(m, "IrError", base);
  // A broken Plan rule is an IrError that also carries `rule` and `node` (docs/plan.md "Rules"). Translators run
  // newest first, so this one sees a PlanRuleError before IrError's does.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> plan_rule_error;
  plan_rule_error.call_once_and_store_result(
      [&]() { return py::object(py::exception<PlanRuleError>(m, "PlanRuleError", ir_error.ptr())); });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PlanRuleError& e) {
      const py::object& type = plan_rule_error.get_stored();
      py::object error = type(py::str(e.what()));
      error.attr("rule") = py::str(e.rule());
      error.attr("node") = e.node() ? py::object(py::str(*e.node())) : py::object(py::none());
      py::set_error(type, error);
    }
  });

  m.attr("IR_SCHEMA") = kIrSchema;
  m.attr("PROFILE_SCHEMA") = kProfileSchema;
  m.attr("ANALYSIS_SCHEMA") = kAnalysisSchema;
  m.attr("PLAN_SCHEMA") = kPlanSchema;
  // The push broadcast's relay order starts at this size (ce_algorithms.h): the runtime's GPU tests draw cases above it.
  m.attr("BROADCAST_RELAY_MIN_BYTES") = kRelayMinBytes;

  // The planner's config (plan.h owns its keys, defaults, choices and checks; PassConfig and the CLI read them here).
  m.def(
      "plan_config_defaults", []() { return plan_config_to_json(PlanConfig()).dump(); },
      "The planner config's defaults (docs/plan.md), as JSON text of an object with every key.");
  m.def(
      "plan_config_choices",
      []() {
        nlohmann::json choices;
        for (CeMode mode : {CeMode::Auto, CeMode::On, CeMode::Off}) choices["ce"].push_back(to_string(mode));
        for (CeReduction where : {CeReduction::Consumer, CeReduction::Kernel}) {
          choices["ce_reduction"].push_back(to_string(where));
        }
        for (CollectiveType type : kCeCollectiveTypes) choices["ce_collectives"].push_back(to_string(type));
        return choices.dump();
      },
      "The accepted values of the config keys that take names, as JSON text: {key: [names]}.");
  m.def(
      "normalize_plan_config", [](const py::object& config) { return plan_config_to_json(config_arg(config)).dump(); },
      py::arg("config"),
      "A planner config (dict, JSON text or None) checked like the planner checks it, with every key filled in "
      "(JSON text); a bad value raises IrError naming config.<key>.");

  py::class_<Document>(m, "IrDocument")
      .def_static("from_json", &load_ir, py::arg("text"), "Parse and validate IR JSON text.",
                  py::call_guard<py::gil_scoped_release>())
      .def("to_json", &save_ir, "Canonical IR JSON text.", py::call_guard<py::gil_scoped_release>())
      .def("detect_blocks", &detect_blocks, "Assign block ids from module stacks (docs/ir.md).")
      .def_property_readonly("blocks", &blocks_to_list)
      .def_property_readonly("meta_json", [](const Document& d) { return d.meta.dump(); })
      .def_property_readonly("graph_names", [](const Document& d) {
        std::vector<std::string> names;
        for (const Graph& g : d.graphs) names.push_back(g.name);
        return names;
      })
      .def("num_nodes", [](const Document& d, const std::string& graph) -> size_t {
        return find_graph(d, graph).nodes.size();
      });

  py::class_<Profile>(m, "Profile")
      .def_static("from_json", &load_profile, py::arg("text"), "Parse and validate profile JSON text.")
      .def("to_json", [](const Profile& p) { return profile_to_json(p).dump(2); })
      .def_property_readonly("name", [](const Profile& p) { return p.name; })
      .def_property_readonly("description", [](const Profile& p) { return p.description; });

  m.def(
      "analyze",
      [](const Document& doc, const Profile& profile) {
        return analyze(doc, CostModel(profile)).dump();
      },
      py::arg("doc"), py::arg("profile"), "The analysis report (docs/analysis.md) as JSON text.",
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "graph_kernels",
      [](const py::object& ir, const std::string& graph, const Profile& profile) {
        Document storage;
        const Document& doc = ir_arg(ir, storage);
        py::gil_scoped_release release;
        return graph_kernels(doc, graph, CostModel(profile)).dump();
      },
      py::arg("ir"), py::arg("graph"), py::arg("profile"),
      "The kernels the model runs for one graph, as JSON text: per fusion group and per compute node outside one, "
      "its node ids, op names, bytes and time in us (graph_kernels in csrc/cost_model/analyze.h). ir: an IrDocument "
      "or IR JSON text.");

  m.def(
      "plan",
      [](const py::object& ir, const std::string& graph, const Profile& profile, const py::object& config) {
        const PlanConfig cfg = config_arg(config);
        Document storage;
        const Document& doc = ir_arg(ir, storage);
        py::gil_scoped_release release;
        return save_plan(make_plan(doc, graph, CostModel(profile), cfg));
      },
      py::arg("ir"), py::arg("graph"), py::arg("profile"), py::arg("config") = py::none(),
      "The Plan (docs/plan.md) of one graph as canonical JSON text. ir: an IrDocument or IR JSON text; "
      "graph: its name (forward, backward); profile: a loaded Profile; config: a dict with any of "
      "bucket_cap_bytes, memory_budget_bytes, ce (auto|on|off), min_ce_bytes, prefetch_blocks, "
      "bucket_patterns (None: the defaults). Bad input raises IrError naming the field.");

  m.def(
      "load_plan",
      [](const std::string& text) { return save_plan(load_plan(text)); },
      py::arg("text"), "Parse and validate Plan JSON text (the rules that need no graph); returns it canonical.",
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "check_plan",
      [](const py::object& ir, const std::string& text) {
        Document storage;
        const Document& doc = ir_arg(ir, storage);
        py::gil_scoped_release release;
        check_plan(doc, parse_plan(text));
      },
      py::arg("ir"), py::arg("plan"),
      "Check Plan JSON text against its graph in `ir` (every rule of docs/plan.md, in one fixed order); raises "
      "PlanRuleError (an IrError) with `rule` (its name in docs/plan.md), `node` (the node or bucket, or None) and "
      "the field's JSON path in the message.");

  m.def(
      "estimate_collective",
      [](const Profile& profile, const std::string& type, int64_t bytes, int64_t group_size,
         const std::string& backend) {
        Backend b;
        try {
          b = backend_from_string(backend);
        } catch (const IrError& e) {
          throw IrError(std::string("backend: ") + e.what());
        }
        return CostModel(profile).estimate(collective_arg(type, bytes, group_size), b).us;
      },
      py::arg("profile"), py::arg("type"), py::arg("bytes"), py::arg("group_size"), py::arg("backend") = "nccl",
      "Predicted time in us of one collective alone (docs/cost_model.md). type: an IR collective type "
      "(all_gather, ...); bytes as in the IR (all-gather: the shard; reduce-scatter: the full input); "
      "backend: nccl, ce or hier. Raises IrError when the backend cannot serve the group (CE: spans nodes, no "
      "P2P; hier: on one node, not as many ranks on each).");

  m.def(
      "decide",
      [](const Profile& profile, const std::string& type, int64_t bytes, int64_t group_size,
         double window_compute_bound_us, double window_memory_bound_us) {
        const CollectiveInfo c = collective_arg(type, bytes, group_size);
        const OverlapWindow w{window_arg(window_compute_bound_us, "window_compute_bound_us"),
                              window_arg(window_memory_bound_us, "window_memory_bound_us")};
        const Decision d = CostModel(profile).decide(c, w);
        py::dict out;
        out["choice"] = to_string(d.choice);
        out["nccl_us"] = d.nccl.cost_us;
        out["ce_us"] = d.ce ? py::cast(d.ce->cost_us) : py::none();
        out["reason"] = d.reason;
        out["nccl"] = cost_to_dict(d.nccl);
        out["ce"] = d.ce ? py::object(cost_to_dict(*d.ce)) : py::none();
        out["hier_us"] = d.hier ? py::cast(d.hier->cost_us) : py::none();
        out["hier"] = d.hier ? py::object(cost_to_dict(*d.hier)) : py::none();
        return out;
      },
      py::arg("profile"), py::arg("type"), py::arg("bytes"), py::arg("group_size"),
      py::arg("window_compute_bound_us") = 0.0, py::arg("window_memory_bound_us") = 0.0,
      "NCCL, CE or hierarchical for one collective with `window` compute beside it: dict(choice, nccl_us, ce_us, "
      "hier_us, reason, nccl, ce, hier). nccl_us / ce_us / hier_us: what the collective adds to the step (exposed "
      "time + slowdown of the window); ce_us is None when CE cannot serve the group, hier_us unless the group spans "
      "nodes with as many ranks on each (its nodes placed in order). docs/cost_model.md.");

  m.def(
      "check_topology",
      [](const std::string& text) {
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(text);
        } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for huge numbers
          throw IrError(std::string("malformed JSON: ") + e.what());
        }
        return topology_to_json(topology_from_json(j)).dump();
      },
      py::arg("text"), "Validate a profile's topology object (JSON text); returns it in canonical form.");

  m.def(
      "time_load_and_analyze",
      [](const std::string& ir_text, const Profile& profile) {
        // Wall time of the C++ work alone (parse + validate + analysis), for the planning-speed figure.
        auto t0 = std::chrono::steady_clock::now();
        Document doc = load_ir(ir_text);
        auto t1 = std::chrono::steady_clock::now();
        nlohmann::json report = analyze(doc, CostModel(profile));
        auto t2 = std::chrono::steady_clock::now();
        py::gil_scoped_acquire gil;
        py::dict out;
        out["load_s"] = std::chrono::duration<double>(t1 - t0).count();
        out["analyze_s"] = std::chrono::duration<double>(t2 - t1).count();
        out["nodes"] = [&] {
          size_t n = 0;
          for (const Graph& g : doc.graphs) n += g.nodes.size();
          return n;
        }();
        return out;
      },
      py::arg("ir_text"), py::arg("profile"), py::call_guard<py::gil_scoped_release>());
}
