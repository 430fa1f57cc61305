// A minimal HTTP/1.0 GET against a loopback port, for tests and tools that
// read a server's Prometheus page.
#ifndef PDSERVE_TESTS_SUPPORT_HTTP_GET_H_
#define PDSERVE_TESTS_SUPPORT_HTTP_GET_H_

#include <string>

namespace pdserve::testing_support {

// GET http://127.0.0.1:port/path: the body, or "" on any failure.
std::string HttpGet(int port, const std::string& path);

}  // namespace pdserve::testing_support

#endif  // PDSERVE_TESTS_SUPPORT_HTTP_GET_H_
