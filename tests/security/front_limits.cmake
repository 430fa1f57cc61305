# The router's HTTP front under clients without a key: bodies refused
# unread, the connection cap, header and request deadlines, the cap on
# generations running, and a load of all of them at once.
pdserve_test(front_limits_test SOURCES front_limits_test.cc ../support/subprocess.cc ../support/http_get.cc
  ../support/http_client.cc
  LIBS pdserve_tls pdserve_health_check pdserve_api_keys pdserve_proto nlohmann_json::nlohmann_json absl::time
  absl::strings OpenSSL::SSL LABELS security)
target_compile_definitions(front_limits_test PRIVATE PDSERVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(front_limits_test pdserve-router pdserve-decode-worker)
