// ce_overlap._core: the torch-free C++ core (IR, graph analysis, cost model) for Python.
// Documents cross the boundary as JSON text (validated on the C++ side) or as opaque objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>

#include "cost_model/analyze.h"
#include "cost_model/cost_model.h"
#include "cost_model/profile.h"
#include "graph/analysis.h"
#include "graph/ir.h"

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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "ce_overlap native core: IR, graph analysis and cost model (no torch)";
  // Bad input surfaces as the package's one documented exception type.
  py::object base = py::module_::import("ce_overlap.errors").attr("CeOverlapError");
  py::register_exception<IrError>(m, "IrError", base);

  m.attr("IR_SCHEMA") = kIrSchema;
  m.attr("PROFILE_SCHEMA") = kProfileSchema;
  m.attr("ANALYSIS_SCHEMA") = kAnalysisSchema;

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
        for (const Graph& g : d.graphs)
          if (g.name == graph) return g.nodes.size();
        throw IrError("no graph named \"" + graph + "\"");
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
