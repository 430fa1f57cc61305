// The shipped default model (deploy/models/kjv-tiny) loaded in process on
// the CPU backend, for tests that compare against or drive the engine.
#ifndef PDSERVE_TESTS_SUPPORT_DEFAULT_MODEL_H_
#define PDSERVE_TESTS_SUPPORT_DEFAULT_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve::testing_support {

inline const std::string kDefaultModelDir = std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny";

struct DefaultModel {
  std::unique_ptr<kernels::cpu::CpuBackend> backend;
  std::unique_ptr<Model> model;  // Runs on `backend`.
  std::unique_ptr<tok::Tokenizer> tokenizer;
};

// `choose_matrix_path`: the matrix path the servers would take
// (CpuBackendOptions), else F32.
inline absl::StatusOr<DefaultModel> LoadDefaultModel(int threads, bool choose_matrix_path = false) {
  kernels::cpu::CpuBackendOptions options;
  options.num_threads = threads;
  options.choose_matrix_path = choose_matrix_path;
  DefaultModel m;
  absl::StatusOr<std::unique_ptr<kernels::cpu::CpuBackend>> backend = kernels::cpu::CpuBackend::Create(options);
  if (!backend.ok()) return backend.status();
  m.backend = *std::move(backend);
  absl::StatusOr<std::unique_ptr<Model>> model = Model::Load(kDefaultModelDir, {}, m.backend.get());
  if (!model.ok()) return model.status();
  m.model = *std::move(model);
  absl::StatusOr<std::unique_ptr<tok::Tokenizer>> tokenizer = tok::Tokenizer::Load(kDefaultModelDir);
  if (!tokenizer.ok()) return tokenizer.status();
  m.tokenizer = *std::move(tokenizer);
  return m;
}

}  // namespace pdserve::testing_support

#endif  // PDSERVE_TESTS_SUPPORT_DEFAULT_MODEL_H_
