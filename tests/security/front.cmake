# The router front's and the deployment's attacks.

# Invalid UTF-8 in log lines: LogEvent itself, and a real router fed it
# through its API key file and its clients' strings.
pdserve_test(front_log_test SOURCES front_log_test.cc
  LIBS pdserve_server_util nlohmann_json::nlohmann_json absl::strings LABELS security)
pdserve_test(front_log_cluster_test SOURCES front_log_cluster_test.cc ../support/subprocess.cc ../support/http_get.cc
  ../support/http_client.cc
  LIBS pdserve_tls pdserve_health_check pdserve_api_keys pdserve_proto nlohmann_json::nlohmann_json absl::time
  absl::strings OpenSSL::SSL LABELS security)
target_compile_definitions(front_log_cluster_test PRIVATE PDSERVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(front_log_cluster_test pdserve-router pdserve-decode-worker)

# deploy/make_certs.sh's directory and keys, and .dockerignore keeping the
# overlays' certificates out of image layers. Python; 77: skipped.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND)
  foreach(check fresh_dir_is_private refuses_foreign_dir dockerignore_excludes_certs)
    add_test(NAME Security.Deploy.${check}
      COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/front_deploy_test.py ${PROJECT_SOURCE_DIR} ${check})
    set_tests_properties(Security.Deploy.${check} PROPERTIES LABELS security SKIP_RETURN_CODE 77)
  endforeach()
endif()

# Forged chat turns: special-token text in a message's content and unknown
# roles, against a real router serving a Llama 3 model (random weights).
pdserve_test(front_chat_test SOURCES front_chat_test.cc ../support/subprocess.cc ../support/http_get.cc
  ../support/http_client.cc
  LIBS pdserve_tls pdserve_health_check pdserve_synthetic_model pdserve_tokenizer pdserve_proto
  nlohmann_json::nlohmann_json absl::time absl::strings OpenSSL::SSL LABELS security)
target_compile_definitions(front_chat_test PRIVATE PDSERVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(front_chat_test pdserve-router pdserve-decode-worker)
