#include "tools/pdctl/cluster_commands.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "base/grpc_status.h"
#include "base/health_check.h"
#include "base/tls.h"
#include "base/tls_flags.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, api_key, "", "generate / status / bench --router: the router's API key (default: $PDSERVE_API_KEY)");

namespace pdserve::pdctl {
namespace {

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  const absl::Status st = FromGrpcStatus(s);
  return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
}

const char* FinishName(v1::FinishReason f) {
  switch (f) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case v1::FINISH_REASON_ERROR:
      return "error";
    default:
      return "unspecified";
  }
}

}  // namespace

std::shared_ptr<grpc::Channel> RouterChannel(const std::string& router) {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  if (ca.empty()) return grpc::CreateChannel(router, grpc::InsecureChannelCredentials());
  TlsFiles files;
  files.ca = ca;
  grpc::ChannelArguments args;
  return grpc::CreateCustomChannel(router, ChannelTlsCredentials(files, "", &args), args);
}

void AddApiKey(grpc::ClientContext& ctx) {
  std::string key = absl::GetFlag(FLAGS_api_key);
  if (key.empty()) {
    const char* env = std::getenv("PDSERVE_API_KEY");
    if (env != nullptr) key = env;
  }
  if (!key.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", key));
}

absl::Status RemoteGenerate(const std::string& router, const v1::GenerateRequest& request, bool print_ids,
                            double timeout_seconds) {
  auto stub = v1::Generation::NewStub(RouterChannel(router));
  grpc::ClientContext ctx;
  AddApiKey(ctx);
  if (timeout_seconds > 0) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1e3)));
  }
  auto reader = stub->Generate(&ctx, request);
  v1::GenerateResponse m;
  std::vector<int32_t> ids;
  v1::GenerateFinal final;
  while (reader->Read(&m)) {
    if (m.has_chunk()) {
      ids.insert(ids.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      if (!print_ids) {
        std::fwrite(m.chunk().text().data(), 1, m.chunk().text().size(), stdout);
        std::fflush(stdout);
      }
    } else if (m.has_final()) {
      final = m.final();
    }
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) return FromGrpc(st, absl::StrCat("router ", router));
  if (print_ids) {
    std::printf("%s\n", absl::StrJoin(ids, ",").c_str());
  } else {
    std::printf("\n");
  }
  std::fflush(stdout);
  const v1::Timings& t = final.timings();
  std::fprintf(stderr,
               "seed=%llu finish=%s prompt_tokens=%d completion_tokens=%d%s%s\n"
               "ttft=%.1fms queue=%.1fms prefill=%.1fms handoff=%.1fms first_gap=%.2fms itl_mean=%.2fms "
               "itl_max=%.2fms total=%.1fms "
               "cached_prompt_tokens=%d%s\n",
               static_cast<unsigned long long>(final.seed()), FinishName(final.finish_reason()),
               final.usage().prompt_tokens(), final.usage().completion_tokens(), final.error().empty() ? "" : " error=",
               final.error().c_str(), 1e3 * t.ttft(), 1e3 * t.queue(), 1e3 * t.prefill(), 1e3 * t.handoff(),
               1e3 * t.first_gap(), 1e3 * t.mean_itl(), 1e3 * t.max_itl(), 1e3 * t.total(), t.cached_prompt_tokens(),
               t.colocated()       ? " (colocated)"
               : t.local_prefill() ? " (prefilled on the decode worker)"
                                   : "");
  if (final.finish_reason() == v1::FINISH_REASON_ERROR) return absl::InternalError(final.error());
  return absl::OkStatus();
}

absl::Status RemoteStatus(const std::string& router, bool json) {
  auto stub = v1::Generation::NewStub(RouterChannel(router));
  grpc::ClientContext ctx;
  AddApiKey(ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ClusterStatusResponse out;
  const grpc::Status st = stub->ClusterStatus(&ctx, {}, &out);
  if (!st.ok()) return FromGrpc(st, absl::StrCat("router ", router));
  if (json) {
    std::string text;
    google::protobuf::util::JsonPrintOptions o;
    o.add_whitespace = true;
    o.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(out, &text, o);
    std::printf("%s\n", text.c_str());
    return absl::OkStatus();
  }
  std::printf("requests in flight: %lld\n", static_cast<long long>(out.requests_in_flight()));
  if (const v1::QueueStatus& q = out.queue(); q.enabled()) {
    std::printf(
        "queue for decode KV room: %lld waiting (max %lld), longest wait now %.2f s (max %.0f s); %lld placed, %lld "
        "after waiting %.3f s on average; refused: %lld full, %lld waited too long\n",
        static_cast<long long>(q.waiting()), static_cast<long long>(q.max_queued()), q.oldest_wait_seconds(),
        q.max_wait_seconds(), static_cast<long long>(q.placed()), static_cast<long long>(q.placed_waited()),
        q.placed_waited() > 0 ? q.waited_seconds() / static_cast<double>(q.placed_waited()) : 0.0,
        static_cast<long long>(q.refused_full()), static_cast<long long>(q.refused_wait()));
  } else {
    std::printf("queue for decode KV room: off\n");
  }
  std::printf("%-8s %-22s %-8s %8s %7s %14s %16s %8s %9s %15s %9s\n", "pool", "address", "health", "running", "queued",
              "queued tokens", "KV blocks used", "preempt", "step ms", "cached/indexed", "oldest s");
  // cached/indexed: blocks in the worker's prefix cache, and in the
  // router's index of it (they agree once the worker's events are in).
  auto row = [](const v1::WorkerStatus& w) {
    std::printf("%-8s %-22s %-8s %8d %7d %14lld %9d/%-6d %8lld %9.2f %7lld/%-7lld %9.2f\n", w.role().c_str(),
                w.address().c_str(), w.healthy() ? "serving" : "DOWN", w.running(), w.queued(),
                static_cast<long long>(w.queued_prefill_tokens()), w.kv_blocks_used(), w.kv_blocks_total(),
                static_cast<long long>(w.preemptions()), 1e3 * w.step_seconds(),
                static_cast<long long>(w.kv_cached_blocks()), static_cast<long long>(w.prefix_index_blocks()),
                w.oldest_request_seconds());
    if (!w.kernels().empty()) {
      std::printf("         kernels: %s, tp %d (KV %lld B per position per rank)\n", w.kernels().c_str(),
                  std::max(1, w.tp()), static_cast<long long>(w.kv_bytes_per_position_per_rank()));
    }
    if (w.rank_rows_size() > 0) {
      int32_t most = 0, total = 0;
      std::string rows;
      for (int32_t r : w.rank_rows()) {
        most = std::max(most, r);
        total += r;
        absl::StrAppend(&rows, rows.empty() ? "" : "/", r);
      }
      const double mean = static_cast<double>(total) / w.rank_rows_size();
      std::printf("         request-sharded KV: rows per rank %s, imbalance %.2f (max/mean)\n", rows.c_str(),
                  mean > 0 ? most / mean : 1.0);
    }
    if (w.role() == "decode" && (w.router_placed_positions() > 0 || w.router_free_positions() > 0)) {
      std::printf("         router's KV ledger: %lld positions placed, room for %lld more\n",
                  static_cast<long long>(w.router_placed_positions()), static_cast<long long>(w.router_free_positions()));
    }
    {
      // The prefix cache by tier: blocks found in the pool and read back
      // from the second tier since the worker started, and the tier's use.
      std::string tiers = absl::StrCat("         prefix cache: ", w.kv_prefix_hit_blocks(), " blocks hit in the pool");
      if (w.kv_tier2_capacity_bytes() > 0) {
        absl::StrAppend(&tiers, ", ", w.kv_tier2_restored_blocks(), " read back from tier 2; tier 2 holds ",
                        w.kv_tier2_blocks(), " blocks, ",
                        absl::StrFormat("%.1f of %.1f GiB", static_cast<double>(w.kv_tier2_bytes()) / (1 << 30),
                                        static_cast<double>(w.kv_tier2_capacity_bytes()) / (1 << 30)));
      }
      if (w.kv_pulled_blocks() > 0) {
        absl::StrAppend(&tiers, "; ", w.kv_pulled_blocks(), " pulled from other prefill workers");
      }
      if (w.kv_checksum_failures() > 0) absl::StrAppend(&tiers, "; KV CHECKS FAILED: ", w.kv_checksum_failures());
      std::printf("%s\n", tiers.c_str());
    }
    if (w.requests_expired() > 0) {
      std::printf("         requests ended by their life bound: %lld\n", static_cast<long long>(w.requests_expired()));
    }
    if (!w.healthy() && !w.unhealthy_reason().empty()) {
      std::printf("         not serving: %s\n", w.unhealthy_reason().c_str());
    }
  };
  for (const auto& w : out.prefill()) row(w);
  for (const auto& w : out.decode()) row(w);
  if (!out.measured_report().empty()) std::printf("\nmeasured by the router:\n%s", out.measured_report().c_str());
  return absl::OkStatus();
}

absl::Status Probe(const std::string& address, const std::string& service, double timeout_seconds) {
  static constexpr const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  absl::StatusOr<HealthStatus> s =
      CheckHealth(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()),
                  absl::Seconds(timeout_seconds > 0 ? timeout_seconds : 1), service);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat(address, ": ", s.status().message()));
  if (*s != HealthStatus::kServing) {
    return absl::FailedPreconditionError(absl::StrCat(address, ": ", kNames[static_cast<int>(*s)]));
  }
  std::printf("%s: SERVING\n", address.c_str());
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
