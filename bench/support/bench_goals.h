// The update benchmark's verdicts: each goal against what was measured, the integrity checks'
// "default on" decision, and the defaults the knob sweep suggests, each by a rule written here.
#pragma once

#include <string>
#include <vector>

#include "bench_options.h"
#include "bench_results.h"

namespace shadowsync::bench {

struct Goal {
  std::string name, target, measured, verdict;  // verdict: "met", "missed", "not measured"
};
struct Recommendation {
  std::string knob, value, evidence;
};

// The result of the model named `name`; null if it was not run.
const ModelResult* find_result(const Results& r, const std::string& name);

// Every goal, in the order the report shows them; "not measured" where a figure is missing.
std::vector<Goal> evaluate_goals(const Results& r, const Options& o);

// The "< 5 % -> default on" decision of the integrity checks, as one line per check.
std::vector<std::string> integrity_verdicts(const Results& r, const Options& o);

// Picks from the sweep by a written rule; the evidence is the sweep table.
std::vector<Recommendation> recommend(const Results& r);

}  // namespace shadowsync::bench
