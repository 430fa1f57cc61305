// pdserve-chaos: steady load on two prefill and two decode workers behind a
// router while one worker at a time is killed (SIGKILL, or SIGTERM and a
// drain, which moves the decode worker's running sequences to the other
// one) and started again. Every request is checked against the same
// request on the undisturbed cluster; the run passes only if none was lost,
// none streamed a token twice or a different token, and no KV block is
// still held once the load stops.
//
//   pdserve-chaos --duration_s 600 --clients 8 --seed 7
//
// SIGINT or SIGTERM ends the chaos phase early; the checks and the summary
// still run. Exit status: 0 pass, 1 a check failed, 2 the cluster or the
// reference pass could not be set up.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "base/server_util.h"
#include "base/tls.h"
#include "tests/chaos/fleet.h"
#include "tests/chaos/verdict.h"
#include "tests/support/http_get.h"

ABSL_FLAG(double, duration_s, 60, "length of the chaos phase (seconds)");
ABSL_FLAG(int, clients, 4, "concurrent client threads");
ABSL_FLAG(double, kill_period_s, 5,
          "mean pause between a restarted worker being ready and the next kill (jittered 0.5x..1.5x)");
ABSL_FLAG(double, sigterm_fraction, 0.3, "share of kills that are SIGTERM (a drain); the rest are SIGKILL");
ABSL_FLAG(double, drain_grace_s, 2, "the workers' --drain_grace_s");
ABSL_FLAG(bool, decode_only, false,
          "kill only decode workers (with --sigterm_fraction 1: every kill a drain, whose running sequences move)");
ABSL_FLAG(int, min_moves, 0,
          "fail unless the router moved at least this many running sequences between decode workers (a drain's "
          "live moves; pdserve_decode_moves_total outcome moved)");
ABSL_FLAG(uint64_t, seed, 0, "seeds the kills and the clients' choices (0: from the clock, printed)");
ABSL_FLAG(std::string, dir, "", "ready files and server logs (default: a new /tmp/pdserve-chaos-XXXXXX)");
ABSL_FLAG(int, min_tokens, 16, "smallest max_tokens among the requests");
ABSL_FLAG(int, max_tokens, 96, "largest max_tokens among the requests");
ABSL_FLAG(double, request_deadline_s, 60, "each request's gRPC deadline");
ABSL_FLAG(double, settle_s, 15, "after the load: how long workers get to be healthy with no KV block used");
ABSL_FLAG(std::vector<std::string>, worker_flags, {},
          "extra flags for every worker, comma-separated (e.g. --worker_flags=--kv_lease_s=2)");
ABSL_FLAG(std::vector<std::string>, router_flags, {},
          "extra flags for the router, comma-separated (e.g. --router_flags=--prefill_policy=round_robin: prompts "
          "land where their prefix is not, and prefixes are pulled between prefill workers)");
ABSL_FLAG(bool, long_prompts, false,
          "every prompt starts with the same long preamble (several full KV blocks): prefix-cache hits, and with "
          "--kv_tier2 reads from the second tier after each restart");
ABSL_FLAG(bool, kv_tier2, false,
          "every worker keeps a prefix cache second tier (--kv_tier2_dir) in a directory of its own, reopened "
          "when it restarts");
ABSL_FLAG(bool, tls, true, "mutual TLS between the processes and TLS to the router (deploy/make_certs.sh certificates)");
ABSL_FLAG(int, log_tail_bytes, 2500, "on failure: bytes printed from the end of each server log");

namespace pdserve::chaos {
namespace {

constexpr int kReportedFailures = 8;  // Lost or wrong requests printed in full.
constexpr absl::Duration kProgressPeriod = absl::Seconds(10);

const absl::Time kProgramStart = absl::Now();

// One line on stdout, stamped with the seconds since the program started
// and the UTC time of day (the servers' logs use UTC).
void Say(const std::string& line) {
  static absl::Mutex mu(absl::kConstInit);
  absl::MutexLock lock(&mu);
  const absl::Time now = absl::Now();
  absl::PrintF("[%7.2fs %s] %s\n", absl::ToDoubleSeconds(now - kProgramStart),
               absl::FormatTime("%H:%M:%E3S", now, absl::UTCTimeZone()), line);
  std::fflush(stdout);
}

double Since(absl::Time t) { return absl::ToDoubleSeconds(t - kProgramStart); }

// The fixed request set: King James-like prompts, half greedy and half
// seeded sampling, max_tokens spread over [min_tokens, max_tokens], and
// every third one ignoring EOS so some streams run to their full length.
std::vector<v1::GenerateRequest> RequestSet(int min_tokens, int max_tokens, bool long_prompts) {
  static const char kPreamble[] =
      "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
      "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
      "said, Let there be light: and there was light. ";
  static const char* const kPrompts[] = {
      "In the beginning God created the heaven and the earth.",
      "And God said, Let there be light:",
      "The LORD is my shepherd; I shall not want.",
      "Blessed are the meek:",
      "And the earth was without form, and void;",
      "For God so loved the world,",
      "In the beginning was the Word,",
      "And it came to pass in those days,",
      "Now the serpent was more subtil than any beast of the field",
      "Thou shalt love the Lord thy God with all thine heart,",
      "Let not your heart be troubled:",
      "And Moses said unto the LORD,",
      "Vanity of vanities, saith the Preacher;",
      "O give thanks unto the LORD; for he is good:",
      "Then answered Jesus and said unto them,",
      "And he opened his mouth, and taught them, saying,",
  };
  constexpr int kCount = sizeof(kPrompts) / sizeof(kPrompts[0]);
  std::vector<v1::GenerateRequest> out;
  for (int i = 0; i < kCount; ++i) {
    v1::GenerateRequest r;
    r.set_text(long_prompts ? std::string(kPreamble) + kPrompts[i] : std::string(kPrompts[i]));
    // i * 7 mod 16 visits every step once, so long and short requests mix.
    r.set_max_tokens(min_tokens + (max_tokens - min_tokens) * ((i * 7) % kCount) / (kCount - 1));
    if (i % 2 == 0) {
      r.mutable_sampling()->set_temperature(0);
    } else {
      r.mutable_sampling()->set_temperature(0.8f);
      r.mutable_sampling()->set_seed(1000 + i);
    }
    r.set_ignore_eos(i % 3 == 0);
    out.push_back(std::move(r));
  }
  return out;
}

Observed Generate(v1::Generation::Stub& stub, const v1::GenerateRequest& req, absl::Duration deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, req);
  Observed out;
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    if (m.has_chunk()) {
      out.tokens.insert(out.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      out.text += m.chunk().text();
    } else if (m.has_final()) {
      out.has_final = true;
      out.final = m.final();
    }
  }
  out.status = reader->Finish();
  return out;
}

// Series (name plus labels, as exposed) → value, for names starting with `prefix`.
std::map<std::string, double> Series(const std::string& exposition, const std::string& prefix) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space != absl::string_view::npos && absl::SimpleAtod(line.substr(space + 1), &v)) {
      out[std::string(line.substr(0, space))] = v;
    }
  }
  return out;
}

struct Kill {
  int number = 0;
  std::string worker;
  Role role = Role::kPrefill;
  int sig = SIGKILL;
  absl::Time at;
  absl::Time back = absl::InfiniteFuture();  // Ready again.
  std::string log;                           // The killed incarnation's.
};

// A request that was not completed, with the kills its life overlapped.
struct Failure {
  std::string request_id;
  absl::Time start, end;
  Verdict verdict;
  std::string kills;
  std::vector<std::string> kill_logs;  // Of the incarnations those kills ended.
};

// Everything the clients and the killer record.
//
// Thread safety: all methods are thread-safe.
class Ledger {
 public:
  void Sent() {
    absl::MutexLock lock(&mu_);
    ++sent_;
  }

  void Finished(const std::string& request_id, absl::Time start, const Verdict& v) {
    const absl::Time end = absl::Now();
    absl::MutexLock lock(&mu_);
    ++finished_;
    completed_ += v.completed();
    lost_ += v.lost;
    mismatched_ += v.mismatched;
    duplicated_tokens_ += v.duplicated_tokens;
    if (v.completed()) {
      latencies_.push_back(end - start);
      return;
    }
    Failure f;
    f.request_id = request_id;
    f.start = start;
    f.end = end;
    f.verdict = v;
    for (const Kill& k : kills_) {
      if (k.at < end && k.back > start) {
        absl::StrAppend(&f.kills, f.kills.empty() ? "" : ", ", "#", k.number, " ",
                        k.sig == SIGKILL ? "SIGKILL " : "SIGTERM ", k.worker, " at ",
                        absl::StrFormat("%.2fs", Since(k.at)));
        f.kill_logs.push_back(k.log);
      }
    }
    const bool reported = v.lost ? lost_ <= kReportedFailures : wrong_reported_++ < kReportedFailures;
    if (reported) {
      Say(absl::StrCat(v.lost ? "LOST " : "WRONG ", request_id, " (started ", absl::StrFormat("%.2fs", Since(start)),
                       "): ", v.detail, f.kills.empty() ? "" : "; during kill ", f.kills));
      failures_.push_back(std::move(f));
    }
  }

  int KillStarted(const std::string& worker, Role role, int sig, const std::string& log) {
    absl::MutexLock lock(&mu_);
    Kill k;
    k.number = static_cast<int>(kills_.size()) + 1;
    k.worker = worker;
    k.role = role;
    k.sig = sig;
    k.log = log;
    k.at = absl::Now();
    kills_.push_back(k);
    return k.number;
  }

  void WorkerBack(int kill_number) {
    absl::MutexLock lock(&mu_);
    kills_[kill_number - 1].back = absl::Now();
  }

  // A SIGTERMed worker must drain and exit 0; anything else (a crash on
  // the way out) is recorded here.
  void UncleanExit(std::string what) {
    absl::MutexLock lock(&mu_);
    unclean_.push_back(std::move(what));
  }

  struct Totals {
    int64_t sent = 0, finished = 0, completed = 0, lost = 0, mismatched = 0, duplicated_tokens = 0;
    int64_t kills = 0;
    std::map<std::string, int> kills_by_kind;  // "SIGKILL prefill" → count.
    std::vector<absl::Duration> latencies;     // Of completed requests, sorted.
    std::vector<Failure> failures;             // The first few.
    std::vector<std::string> unclean_exits;    // SIGTERMed workers that did not exit 0.
  };

  Totals totals() const {
    absl::MutexLock lock(&mu_);
    Totals t;
    t.sent = sent_;
    t.finished = finished_;
    t.completed = completed_;
    t.lost = lost_;
    t.mismatched = mismatched_;
    t.duplicated_tokens = duplicated_tokens_;
    t.kills = static_cast<int64_t>(kills_.size());
    for (const Kill& k : kills_) {
      ++t.kills_by_kind[absl::StrCat(k.sig == SIGKILL ? "SIGKILL " : "SIGTERM ",
                                     k.role == Role::kPrefill ? "prefill" : "decode")];
    }
    t.latencies = latencies_;
    std::sort(t.latencies.begin(), t.latencies.end());
    t.failures = failures_;
    t.unclean_exits = unclean_;
    return t;
  }

 private:
  mutable absl::Mutex mu_;
  int64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> unclean_ ABSL_GUARDED_BY(mu_);
  int64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lost_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t mismatched_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t duplicated_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int wrong_reported_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::Duration> latencies_ ABSL_GUARDED_BY(mu_);
  std::vector<Failure> failures_ ABSL_GUARDED_BY(mu_);
  std::vector<Kill> kills_ ABSL_GUARDED_BY(mu_);
};

absl::Duration Percentile(const std::vector<absl::Duration>& sorted, double q) {
  if (sorted.empty()) return absl::ZeroDuration();
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
}

// Sends requests from the set, chosen at random, until `stop`.
void ClientLoop(int client, uint64_t seed, v1::Generation::Stub& stub, const std::vector<v1::GenerateRequest>& requests,
                const std::vector<Reference>& references, absl::Duration deadline, const absl::Notification& stop,
                Ledger& ledger) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, requests.size() - 1);
  for (int n = 0; !stop.HasBeenNotified(); ++n) {
    const size_t i = pick(rng);
    v1::GenerateRequest req = requests[i];
    req.set_request_id(absl::StrCat("chaos-c", client, "-", n, "-r", i));
    ledger.Sent();
    const absl::Time start = absl::Now();
    const Observed got = Generate(stub, req, deadline);
    ledger.Finished(req.request_id(), start, Judge(got, references[i]));
  }
}

// Kills one random worker at a time and starts it again, until `stop`; a
// restart under way when `stop` comes is finished first. A worker that
// cannot be restarted ends the killing and is reported in `*error`.
void KillerLoop(uint64_t seed, Fleet& fleet, double kill_period_s, double sigterm_fraction, bool decode_only,
                const absl::Notification& stop, Ledger& ledger, std::string* error) {
  std::mt19937_64 rng(seed);
  std::vector<int> victims;
  for (int w = 0; w < fleet.num_workers(); ++w) {
    if (!decode_only || fleet.role(w) == Role::kDecode) victims.push_back(w);
  }
  std::uniform_int_distribution<size_t> victim(0, victims.size() - 1);
  std::uniform_real_distribution<double> unit(0, 1);
  while (!stop.WaitForNotificationWithTimeout(absl::Seconds(kill_period_s * (0.5 + unit(rng))))) {
    const int w = victims[victim(rng)];
    const int sig = unit(rng) < sigterm_fraction ? SIGTERM : SIGKILL;
    const std::string log = fleet.current_log(w);
    const int number = ledger.KillStarted(fleet.name(w), fleet.role(w), sig, log);
    Say(absl::StrCat("kill #", number, ": ", sig == SIGKILL ? "SIGKILL " : "SIGTERM ", fleet.name(w), " (port ",
                     fleet.grpc_port(w), ")"));
    const StopResult stopped = fleet.Stop(w, sig);
    const absl::Time restart_at = absl::Now();
    const absl::Status s = fleet.Restart(w);
    if (!s.ok()) {
      *error = absl::StrCat("kill #", number, ": restarting ", fleet.name(w), " failed: ", s.message());
      Say(*error);
      return;
    }
    ledger.WorkerBack(number);
    if (sig == SIGTERM && !stopped.escalated && stopped.exit_status != 0) {
      ledger.UncleanExit(absl::StrCat("kill #", number, ": ", fleet.name(w), " exited with status ",
                                      stopped.exit_status, " (log: ", log, ")"));
    }
    Say(absl::StrFormat("kill #%d: %s exited with status %d after %.2fs%s; ready again on its port after %.2fs", number,
                        fleet.name(w), stopped.exit_status, absl::ToDoubleSeconds(stopped.took),
                        stopped.escalated ? " (drain overran: SIGKILLed)" : "",
                        absl::ToDoubleSeconds(absl::Now() - restart_at)));
  }
}

// The reference output of every request, one at a time on the calm cluster.
absl::StatusOr<std::vector<Reference>> ReferencePass(v1::Generation::Stub& stub,
                                                     const std::vector<v1::GenerateRequest>& requests,
                                                     absl::Duration deadline) {
  std::vector<Reference> out;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Observed got = Generate(stub, requests[i], deadline);
    const v1::FinishReason finish = got.final.finish_reason();
    if (!got.status.ok() || !got.has_final ||
        (finish != v1::FINISH_REASON_STOP && finish != v1::FINISH_REASON_LENGTH)) {
      return absl::InternalError(absl::StrCat("reference request ", i, " failed: ", got.status.error_message(), " ",
                                              got.final.ShortDebugString()));
    }
    out.push_back({got.tokens, got.text, finish});
  }
  return out;
}

struct Settled {
  int64_t kv_blocks_used = -1;  // Summed over every worker; -1: no status.
  std::string unhealthy;        // Workers not healthy at the end.
  std::string per_worker;       // name=used, for the summary.
  int64_t router_in_flight = -1;
};

// Polls the router's ClusterStatus until every worker is healthy and no KV
// block is in use, or `wait` passes; the last answer.
Settled Settle(v1::Generation::Stub& stub, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  Settled s;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ClusterStatusResponse st;
    if (stub.ClusterStatus(&ctx, {}, &st).ok()) {
      s = Settled{0, "", "", st.requests_in_flight()};
      auto add = [&s](const v1::WorkerStatus& w) {
        s.kv_blocks_used += w.kv_blocks_used();
        absl::StrAppend(&s.per_worker, s.per_worker.empty() ? "" : " ", w.role(), "@", w.address(), "=",
                        w.kv_blocks_used());
        if (!w.healthy()) absl::StrAppend(&s.unhealthy, s.unhealthy.empty() ? "" : " ", w.role(), "@", w.address());
      };
      for (const v1::WorkerStatus& w : st.prefill()) add(w);
      for (const v1::WorkerStatus& w : st.decode()) add(w);
      if (s.kv_blocks_used == 0 && s.unhealthy.empty()) return s;
    }
    if (absl::Now() > deadline) return s;
    absl::SleepFor(absl::Milliseconds(200));  // Polling a remote state; there is no event to wait on.
  }
}

std::string ProgressLine(const Ledger::Totals& t) {
  return absl::StrCat("sent ", t.sent, ", completed ", t.completed, ", lost ", t.lost, ", duplicated tokens ",
                      t.duplicated_tokens, ", mismatched ", t.mismatched, ", in flight ", t.sent - t.finished,
                      ", kills ", t.kills);
}

// SIGINT / SIGTERM (blocked in every thread) end the chaos phase early.
void WatchSignals(absl::Notification* interrupted) {
  const int sig = WaitForShutdownSignal();
  Say(absl::StrCat("signal ", sig, ": ending the chaos phase"));
  interrupted->Notify();
}

int Run() {
  BlockShutdownSignals();
  absl::Notification interrupted;
  std::thread(WatchSignals, &interrupted).detach();

  uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed == 0) seed = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) % 1000000 + 1;
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) {
    char tmpl[] = "/tmp/pdserve-chaos-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      Say("cannot create a directory under /tmp");
      return 2;
    }
    dir = tmpl;
  }
  const double duration_s = absl::GetFlag(FLAGS_duration_s);
  const int clients = absl::GetFlag(FLAGS_clients);
  const absl::Duration deadline = absl::Seconds(absl::GetFlag(FLAGS_request_deadline_s));
  const int min_tokens = absl::GetFlag(FLAGS_min_tokens), max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (clients < 1 || min_tokens < 1 || max_tokens < min_tokens || duration_s <= 0) {
    Say("need --clients >= 1, 1 <= --min_tokens <= --max_tokens and --duration_s > 0");
    return 2;
  }
  Say(absl::StrFormat("pdserve-chaos: seed %d, %gs, %d clients, kill every ~%gs, %g%% SIGTERM, logs in %s", seed,
                      duration_s, clients, absl::GetFlag(FLAGS_kill_period_s),
                      100 * absl::GetFlag(FLAGS_sigterm_fraction), dir));

  // One matrix path for the whole fleet, chosen here as each server's probe
  // would (unless the caller set one): the verdict needs every restarted
  // worker to run the same arithmetic as the reference pass, and a short
  // start-up probe under this test's load must not split identical workers
  // between paths (operators pin --matrix_path across a fleet for the same
  // reason).
  if (const char* pinned = std::getenv("PDSERVE_MATRIX_PATH"); pinned == nullptr || *pinned == '\0') {
    absl::StatusOr<std::unique_ptr<pdserve::kernels::cpu::CpuBackend>> probe =
        pdserve::kernels::cpu::CpuBackend::Create({.choose_matrix_path = true});
    if (!probe.ok()) {
      Say(absl::StrCat("matrix path probe: ", probe.status().message()));
      return 2;
    }
    setenv("PDSERVE_MATRIX_PATH", std::string(pdserve::kernels::cpu::MatrixPathName((*probe)->matrix_path())).c_str(), 1);
  }
  Say(absl::StrCat("matrix path for every server: ", std::getenv("PDSERVE_MATRIX_PATH")));

  FleetOptions fo;
  fo.bin_dir = PDSERVE_BINARY_DIR;
  fo.model_dir = std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny";
  fo.dir = dir;
  fo.drain_grace_s = absl::GetFlag(FLAGS_drain_grace_s);
  fo.extra_worker_flags = absl::GetFlag(FLAGS_worker_flags);
  fo.extra_router_flags = absl::GetFlag(FLAGS_router_flags);
  fo.kv_tier2 = absl::GetFlag(FLAGS_kv_tier2);
  if (absl::GetFlag(FLAGS_tls)) {
    fo.certs_dir = dir + "/certs";
    const std::string make = absl::StrCat("'", PDSERVE_SOURCE_DIR, "/deploy/make_certs.sh' '", fo.certs_dir, "' > /dev/null");
    if (std::system(make.c_str()) != 0) {
      Say("deploy/make_certs.sh failed");
      return 2;
    }
  }
  Fleet fleet(fo);
  if (absl::Status s = fleet.Start(); !s.ok()) {
    Say(absl::StrCat("the cluster did not start: ", s.message()));
    return 2;
  }
  std::string layout;
  for (int w = 0; w < fleet.num_workers(); ++w) absl::StrAppend(&layout, " ", fleet.name(w), ":", fleet.grpc_port(w));
  Say(absl::StrCat("cluster ready: router ", fleet.router_address(), ";", layout));

  std::shared_ptr<grpc::Channel> channel;
  if (fo.certs_dir.empty()) {
    channel = grpc::CreateChannel(fleet.router_address(), grpc::InsecureChannelCredentials());
  } else {
    TlsFiles ca;
    ca.ca = fo.certs_dir + "/ca.pem";
    grpc::ChannelArguments args;
    channel = grpc::CreateCustomChannel(fleet.router_address(), ChannelTlsCredentials(ca, "", &args), args);
  }
  const std::unique_ptr<v1::Generation::Stub> stub = v1::Generation::NewStub(channel);
  const std::vector<v1::GenerateRequest> requests = RequestSet(min_tokens, max_tokens, absl::GetFlag(FLAGS_long_prompts));
  absl::StatusOr<std::vector<Reference>> references = ReferencePass(*stub, requests, deadline);
  if (!references.ok()) {
    Say(std::string(references.status().message()));
    const size_t bytes = absl::GetFlag(FLAGS_log_tail_bytes);
    absl::PrintF("==== %s\n%s\n", fleet.router_log(), Fleet::Tail(fleet.router_log(), bytes));
    for (int w = 0; w < fleet.num_workers(); ++w) {
      absl::PrintF("==== %s\n%s\n", fleet.current_log(w), Fleet::Tail(fleet.current_log(w), bytes));
    }
    return 2;
  }
  int64_t reference_tokens = 0;
  for (const Reference& r : *references) reference_tokens += static_cast<int64_t>(r.tokens.size());
  Say(absl::StrCat("reference pass: ", references->size(), " requests, ", reference_tokens, " tokens"));

  // The chaos phase.
  Ledger ledger;
  absl::Notification stop;
  std::string killer_error;
  const absl::Time chaos_start = absl::Now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back(ClientLoop, c, seed * 1000 + c + 1, std::ref(*stub), std::cref(requests),
                         std::cref(*references), deadline, std::cref(stop), std::ref(ledger));
  }
  std::thread killer(KillerLoop, seed, std::ref(fleet), absl::GetFlag(FLAGS_kill_period_s),
                     absl::GetFlag(FLAGS_sigterm_fraction), absl::GetFlag(FLAGS_decode_only), std::cref(stop),
                     std::ref(ledger), &killer_error);
  const absl::Time chaos_end = chaos_start + absl::Seconds(duration_s);
  while (absl::Now() < chaos_end &&
         !interrupted.WaitForNotificationWithTimeout(std::min(kProgressPeriod, chaos_end - absl::Now()))) {
    Say(ProgressLine(ledger.totals()));
  }
  const absl::Duration chaos_length = absl::Now() - chaos_start;
  Say("chaos phase over: no new kills or requests; waiting for the restart and the requests under way");
  stop.Notify();
  killer.join();
  for (std::thread& t : threads) t.join();
  Say(absl::StrCat("load stopped after ", absl::FormatDuration(absl::Now() - chaos_start)));

  const Settled settled = Settle(*stub, absl::Seconds(absl::GetFlag(FLAGS_settle_s)));
  const std::string metrics = testing_support::HttpGet(fleet.router_metrics_port(), "/metrics");
  const Ledger::Totals t = ledger.totals();

  absl::PrintF("\n==== pdserve-chaos summary (seed %d)\n", seed);
  absl::PrintF("duration            %.1fs, %d clients\n", absl::ToDoubleSeconds(chaos_length), clients);
  absl::PrintF("requests sent       %d\n", t.sent);
  absl::PrintF("completed           %d\n", t.completed);
  absl::PrintF("lost                %d\n", t.lost);
  absl::PrintF("duplicated tokens   %d\n", t.duplicated_tokens);
  absl::PrintF("mismatched          %d\n", t.mismatched);
  absl::PrintF("leaked KV blocks    %d (%s)\n", settled.kv_blocks_used,
               settled.per_worker.empty() ? "no ClusterStatus answer" : settled.per_worker);
  if (!settled.unhealthy.empty()) absl::PrintF("unhealthy at end    %s\n", settled.unhealthy);
  if (settled.router_in_flight > 0) absl::PrintF("router in flight    %d at the end\n", settled.router_in_flight);
  std::string kinds;
  for (const auto& [kind, n] : t.kills_by_kind) absl::StrAppend(&kinds, kinds.empty() ? "" : ", ", kind, " ", n);
  absl::PrintF("kills               %d (%s)\n", t.kills, kinds.empty() ? "none" : kinds);
  absl::PrintF("unclean exits       %d%s\n", t.unclean_exits.size(),
               t.unclean_exits.empty() ? "" : absl::StrCat(": ", absl::StrJoin(t.unclean_exits, "; ")));
  int64_t moved = 0;  // Running sequences moved with their KV.
  if (metrics.empty()) {
    absl::PrintF("router metrics      unavailable\n");
  } else {
    for (const auto& [series, v] : Series(metrics, "pdserve_migrations_total")) absl::PrintF("%-50s %g\n", series, v);
    for (const auto& [series, v] : Series(metrics, "pdserve_prefill_retries_total")) {
      absl::PrintF("%-50s %g\n", series, v);
    }
    for (const auto& [series, v] : Series(metrics, "pdserve_requests_total")) absl::PrintF("%-50s %g\n", series, v);
    for (const auto& [series, v] : Series(metrics, "pdserve_decode_moves_total")) {
      if (v > 0) absl::PrintF("%-50s %g\n", series, v);
      if (absl::StrContains(series, "outcome=\"moved\"")) moved += static_cast<int64_t>(v);
    }
    for (const auto& [series, v] : Series(metrics, "pdserve_prefix_pulls_total")) {
      if (v > 0) absl::PrintF("%-50s %g\n", series, v);
    }
  }
  absl::PrintF("latency (completed) p50 %.3fs, p99 %.3fs\n", absl::ToDoubleSeconds(Percentile(t.latencies, 0.5)),
               absl::ToDoubleSeconds(Percentile(t.latencies, 0.99)));

  // No request may have been ended by a worker's bound on its life: the
  // bound is for requests nobody waits for, never for a chaos run's.
  const std::string expired = fleet.Grep("\"event\":\"request_expired\"");
  absl::PrintF("expired requests    %d\n", static_cast<int>(std::count(expired.begin(), expired.end(), '\n')));

  std::vector<std::string> failed;
  if (!expired.empty()) failed.push_back("requests ended by their life bound:\n" + expired);
  if (t.lost > 0) failed.push_back("requests lost");
  if (t.duplicated_tokens > 0) failed.push_back("tokens duplicated");
  if (t.mismatched > 0) failed.push_back("tokens mismatched");
  if (settled.kv_blocks_used != 0) failed.push_back("KV blocks leaked");
  if (!settled.unhealthy.empty()) failed.push_back("workers unhealthy at the end");
  if (t.completed == 0) failed.push_back("nothing completed");
  if (!killer_error.empty()) failed.push_back(killer_error);
  if (!t.unclean_exits.empty()) failed.push_back("SIGTERMed workers that did not exit 0");
  if (moved < absl::GetFlag(FLAGS_min_moves)) {
    failed.push_back(absl::StrCat("sequences moved ", moved, ", fewer than --min_moves ", absl::GetFlag(FLAGS_min_moves)));
  }
  if (failed.empty()) {
    absl::PrintF("PASS\n");
    return 0;
  }
  absl::PrintF("FAIL: %s\n", absl::StrJoin(failed, "; "));
  // The evidence: what the servers logged about each failed request, then
  // the end of the logs of the router and of every incarnation killed under it.
  const size_t bytes = absl::GetFlag(FLAGS_log_tail_bytes);
  std::set<std::string> involved;
  for (const Failure& f : t.failures) {
    absl::PrintF("\n  %s %s [%.2fs..%.2fs]: %s%s%s\n", f.verdict.lost ? "lost" : "wrong", f.request_id, Since(f.start),
                 Since(f.end), f.verdict.detail, f.kills.empty() ? "" : "; overlapping kills: ", f.kills);
    const std::string lines = fleet.Grep(f.request_id + "-");
    absl::PrintF("%s", lines.empty() ? "    (no server logged this request)\n" : lines);
    involved.insert(f.kill_logs.begin(), f.kill_logs.end());
  }
  absl::PrintF("\n==== %s\n%s\n", fleet.router_log(), Fleet::Tail(fleet.router_log(), bytes));
  for (const std::string& log : involved) absl::PrintF("==== %s\n%s\n", log, Fleet::Tail(log, bytes));
  absl::PrintF("(all logs in %s)\n", dir);
  return 1;
}

}  // namespace
}  // namespace pdserve::chaos

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::chaos::Run();
}
