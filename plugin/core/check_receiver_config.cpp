#include "core/check_receiver_config.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <string>

#include "core/check_root_rank.h"
#include "shadowsync/error.h"

namespace shadowsync {

void check_receiver_config(const ReceiverConfig& config, const Transport* transport,
                           const Backend& backend) {
  const auto positive = [](auto value, const char* name) {
    if (value.count() <= 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("ReceiverConfig::{} must be positive, got {}", name, value.count()));
    }
  };
  positive(config.update_deadline, "update_deadline (ms)");
  positive(config.bucket_deadline, "bucket_deadline (ms)");
  positive(config.poll_interval, "poll_interval (us)");
  positive(config.abort_deadline, "abort_deadline (ms)");
  positive(config.gate_deadline, "gate_deadline (ms)");
  check_root_rank(config.root_rank, transport, "ReceiverConfig::root_rank");
  if (const std::optional<double> budget = config.decode_slowdown_budget;
      budget && !(std::isfinite(*budget) && *budget >= 1.0)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("ReceiverConfig::decode_slowdown_budget is {}; it must be a finite "
                            "number of at least 1.0 (1.05: a decode step may take 5 % longer "
                            "while an update streams in), or unset for no pacing",
                            *budget));
  }
  if (config.engine_uses_cuda_graphs && config.swap_strategy == SwapStrategy::kRebind) {
    throw Error(ErrorCode::kInvalidArgument,
                "ReceiverConfig::swap_strategy is rebind, but ReceiverConfig::"
                "engine_uses_cuda_graphs is true: a captured CUDA graph keeps reading the "
                "addresses it was captured with, which rebind moves away from (stale, then "
                "overwritten weights); use swap_strategy copy_in or remap");
  }
  if (config.swap_strategy == SwapStrategy::kRemap) {
    if (const std::string why = backend.remap_unsupported_reason(); !why.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("ReceiverConfig::swap_strategy is remap, but backend '{}' cannot "
                              "remap: {}; use swap_strategy copy_in (also safe under CUDA graphs, "
                              "at the cost of one device copy per swap)",
                              backend.name(), why));
    }
  }
  if (config.gated_swaps && config.swap_strategy != SwapStrategy::kRemap) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("ReceiverConfig::gated_swaps is set, but ReceiverConfig::swap_strategy "
                            "is {}: only a remap swap waits behind a gate (set swap_strategy remap, "
                            "or leave gated_swaps off)",
                            swap_strategy_name(config.swap_strategy)));
  }
  if ((config.require_checksums || config.reject_nonfinite) && !backend.supports_integrity()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("ReceiverConfig::{} is set, but backend '{}' cannot check received "
                            "bytes (supports_integrity() is false)",
                            config.require_checksums ? "require_checksums" : "reject_nonfinite",
                            backend.name()));
  }
}

}  // namespace shadowsync
