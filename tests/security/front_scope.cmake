# What the router's client APIs give a client beyond its own generation:
# whole replies bounded, ClusterStatus behind the API keys, and the prefix
# cache scoped per key.
pdserve_test(front_scope_test SOURCES front_scope_test.cc ../support/subprocess.cc ../support/http_get.cc
  ../support/http_client.cc
  LIBS pdserve_tls pdserve_health_check pdserve_api_keys pdserve_proto nlohmann_json::nlohmann_json absl::time
  absl::strings OpenSSL::SSL LABELS security)
target_compile_definitions(front_scope_test PRIVATE PDSERVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(front_scope_test pdserve-router pdserve-decode-worker pdserve-prefill-worker pdctl)
