# The KV plane's attacks (kv_plane_test.cc): a real decode worker (and a
# whole cluster, for the victim's stream) over its KV transport, and the
# receiver driven directly where an attack needs exact timing.
pdserve_test(security_kv_plane_test SOURCES kv_plane_test.cc ../support/subprocess.cc ../support/http_get.cc
  LIBS pdserve_kv_transfer pdserve_kv_manager pdserve_tls pdserve_health_check pdserve_proto nlohmann_json::nlohmann_json
  absl::time absl::strings absl::synchronization
  LABELS security)
target_compile_definitions(security_kv_plane_test PRIVATE PDSERVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(security_kv_plane_test pdserve-decode-worker pdserve-prefill-worker pdserve-router)

# Same host decided from the socket: a peer in a network namespace of the
# test's own (root; skipped otherwise) against one on this host.
pdserve_test(security_kv_same_host_test SOURCES kv_same_host_test.cc ../support/subprocess.cc ../support/http_get.cc
  LIBS pdserve_kv_transfer pdserve_tls pdserve_health_check pdserve_proto nlohmann_json::nlohmann_json
  absl::time absl::strings absl::synchronization
  LABELS security netns RUN_SERIAL)
target_compile_definitions(security_kv_same_host_test PRIVATE PDSERVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(security_kv_same_host_test pdserve-decode-worker)
