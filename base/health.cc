#include "base/health.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve {

std::string HealthJudge::Judge(const HealthInputs& in, absl::Time now) {
  if (in.idle && in.kv_blocks_used > 0) {
    if (!idle_with_blocks_since_.has_value()) idle_with_blocks_since_ = now;
  } else {
    idle_with_blocks_since_.reset();
  }
  if (in.draining) return "draining";
  if (!in.transport_error.empty()) return in.transport_error;
  if (now - in.transport_beat > options_.wedge_after) {
    return absl::StrFormat("KV transport wedged: its event loop has not run for %.1f s",
                           absl::ToDoubleSeconds(now - in.transport_beat));
  }
  if (idle_with_blocks_since_.has_value() && now - *idle_with_blocks_since_ >= options_.leak_grace) {
    return absl::StrCat("KV pool leak: ", in.kv_blocks_used, " blocks in use with no request holding them for ",
                        absl::FormatDuration(now - *idle_with_blocks_since_));
  }
  return "";
}

}  // namespace pdserve
