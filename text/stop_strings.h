// Stop strings matched on the detokenized stream across token boundaries.
// Text that could still be the start of a stop string is held back; when a
// stop string completes, the text before it is released and the stop string
// itself is never emitted.
//
// Thread safety: one instance per stream; not thread-safe.
#ifndef PDSERVE_TEXT_STOP_STRINGS_H_
#define PDSERVE_TEXT_STOP_STRINGS_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace pdserve::tok {

class StopStringMatcher {
 public:
  // Empty strings are ignored.
  explicit StopStringMatcher(std::vector<std::string> stops);

  struct Result {
    std::string text;     // Safe to emit now.
    bool stopped = false;
    std::string matched;  // The stop string, when stopped.
  };
  // Feeds the next text delta. After a stop, further input is ignored.
  Result Feed(absl::string_view delta);
  // End of stream without a stop: releases the held-back text.
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_STOP_STRINGS_H_
