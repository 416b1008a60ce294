// Issue 57: would nlohmann's SAX parser load an IR within 1.2x of csrc/graph/json_lexer.cc's time? Times, on one IR
// file: load_ir (our pull lexer straight into a Document, validated), nlohmann::json::sax_parse with a handler that
// builds nothing (the least any SAX-based loader pays before it builds a node), and nlohmann::json::parse (the DOM).
// Built and run as README.md says; prints the median of --repeats runs of each.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graph/ir.h"

namespace {

// Accepts every event and keeps nothing: a lower bound on a SAX loader.
struct NoopSax : nlohmann::json::json_sax_t {
  size_t events = 0;
  bool null() override { return ++events; }
  bool boolean(bool) override { return ++events; }
  bool number_integer(number_integer_t) override { return ++events; }
  bool number_unsigned(number_unsigned_t) override { return ++events; }
  bool number_float(number_float_t, const string_t&) override { return ++events; }
  bool string(string_t&) override { return ++events; }
  bool binary(binary_t&) override { return ++events; }
  bool start_object(std::size_t) override { return ++events; }
  bool key(string_t&) override { return ++events; }
  bool end_object() override { return ++events; }
  bool start_array(std::size_t) override { return ++events; }
  bool end_array() override { return ++events; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

template <typename F>
double median_ms(int repeats, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s IR.json [repeats]\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 20;
  size_t nodes = 0;
  const double ours = median_ms(repeats, [&] {
    const ce_overlap::Document d = ce_overlap::load_ir(text);
    nodes = 0;
    for (const auto& g : d.graphs) nodes += g.nodes.size();
  });
  NoopSax sax;
  const double sax_ms = median_ms(repeats, [&] { nlohmann::json::sax_parse(text, &sax); });
  const double dom = median_ms(repeats, [&] { volatile auto j = nlohmann::json::parse(text).size(); (void)j; });
  std::printf("IR %s: %zu nodes, %.1f MiB\n", argv[1], nodes, text.size() / 1048576.0);
  std::printf("load_ir (json_lexer.cc -> Document, validated)  %8.2f ms\n", ours);
  std::printf("nlohmann sax_parse, a handler that builds nothing %8.2f ms  (%.2fx load_ir)\n", sax_ms, sax_ms / ours);
  std::printf("nlohmann json::parse (the DOM)                  %8.2f ms  (%.2fx load_ir)\n", dom, dom / ours);
  return 0;
}
