// Tool calls read out of a generation's text as it streams, in the syntax
// its chat template teaches the model (text/chat_template.h): the Qwen
// (Hermes) syntax of the ChatML families,
//
//   <tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>
//
// or Llama 3.1's, where a call is the whole message:
//
//   {"name": "NAME", "parameters": {...}}
//
// (a Llama 3.1 output that does not begin with "{" is content; what follows
// a call's closing brace is content too). Either key, "arguments" or
// "parameters", is read in both syntaxes.
//
// Text outside calls is content. A call's name is known as soon as its
// header ({"name": "NAME", "arguments": ) has arrived, and its arguments
// are passed on as they come, piece by piece, so a client sees them grow as
// OpenAI streams them. A call whose header comes in another shape (say
// "arguments" first) is held until </tool_call> and read whole; one that is
// not JSON then stays content, as the model wrote it. Text that could be
// the start of "<tool_call>" is held back until it is known not to be.
// Between and after calls, whitespace alone is not content.
//
// The grammar of a required or named call (grammar/json_schema.h,
// CompileToolCalls) writes exactly this syntax, so such calls always parse.
//
// Thread safety: one owner.
#ifndef PDSERVE_ROUTER_TOOL_CALLS_H_
#define PDSERVE_ROUTER_TOOL_CALLS_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::router {

enum class ToolSyntax { kQwen, kLlama31 };

// Whether a request's output is read for tool calls: it has tools and its
// tool_choice is not "none".
bool ParsesToolCalls(const v1::GenerateRequest& request);

class ToolCallParser {
 public:
  // A call begun (`begins`: its id and name come with it) or more of its
  // arguments' text.
  struct CallPiece {
    int index = 0;
    bool begins = false;
    std::string id;
    std::string name;
    std::string arguments;
  };
  struct Delta {
    std::string content;
    std::vector<CallPiece> calls;
    bool empty() const { return content.empty() && calls.empty(); }
  };

  // Calls are named `id_base` + "_" + their index.
  explicit ToolCallParser(std::string id_base, ToolSyntax syntax = ToolSyntax::kQwen);

  Delta Feed(absl::string_view text);
  // The output ended: text held back is content, and so is a call that
  // never got its header; a call cut short keeps the arguments it has.
  Delta Finish();

  // Every call begun so far, its arguments as streamed.
  const std::vector<v1::ToolCall>& calls() const { return calls_; }

 private:
  enum class Mode { kStart, kText, kHeader, kArguments, kAfterArguments, kWhole };
  void Run(Delta& d);
  // Content text, except whitespace alone once a call was seen.
  void Content(Delta& d, absl::string_view text);
  void Begin(Delta& d, std::string name);
  void Arguments(Delta& d, absl::string_view text);
  // A call read whole: true when `body` is one.
  bool WholeCall(Delta& d, const std::string& body);

  const std::string id_base_;
  const ToolSyntax syntax_;
  Mode mode_;
  std::string pending_;    // Text not yet handled.
  std::string call_text_;  // The current call since <tool_call>.
  std::string held_ws_;    // Whitespace after a call, shown only if text follows.
  bool after_call_ = false;  // Since the last call, only whitespace came.
  // The arguments value: nesting and string state.
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
  bool started_ = false;
  std::vector<v1::ToolCall> calls_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_TOOL_CALLS_H_
