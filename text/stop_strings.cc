#include "text/stop_strings.h"

#include <algorithm>

namespace pdserve::tok {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

StopStringMatcher::Result StopStringMatcher::Feed(absl::string_view delta) {
  Result r;
  if (stopped_) return r;
  pending_.append(delta.data(), delta.size());
  // The earliest complete stop string wins (ties: the longest).
  size_t best = std::string::npos;
  const std::string* which = nullptr;
  for (const std::string& s : stops_) {
    const size_t at = pending_.find(s);
    if (at != std::string::npos &&
        (at < best || (at == best && s.size() > which->size()))) {
      best = at;
      which = &s;
    }
  }
  if (which != nullptr) {
    r.text = pending_.substr(0, best);
    r.stopped = true;
    r.matched = *which;
    stopped_ = true;
    pending_.clear();
    return r;
  }
  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  r.text = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return r;
}

std::string StopStringMatcher::Flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace pdserve::tok
