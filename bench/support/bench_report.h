// The update benchmark's artefacts: the results as JSON (schema "shadowsync-bench-updates/1",
// bench_json.cpp) and as Markdown (bench_markdown.cpp). Both label CPU runs "CPU smoke, not GPU
// figures". Pure functions of the results and the options.
#pragma once

#include <string>

#include "bench_common.h"
#include "bench_options.h"
#include "bench_results.h"

namespace shadowsync::bench {

// The JSON forms of the scenario results that appear in more than one place.
Json to_json(const MemoryFigure& m);
Json to_json(const RawResult& r);
Json to_json(const DecodeResult& d);

Json results_json(const Results& r, const Options& o);
std::string results_markdown(const Results& r, const Options& o);

}  // namespace shadowsync::bench
