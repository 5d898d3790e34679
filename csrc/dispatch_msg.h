// Error messages of the lazarus dispatcher ops, built with std::to_string and string
// concatenation and handed to TORCH_CHECK as ONE std::string (which c10 passes through
// untouched). Never through c10::str's iostream formatting of numbers: with an extension
// compiled by a newer libstdc++ than the one torch was built against (the system g++
// 13.3 against torch 2.11's gcc-toolset-13, seen on an H200 machine), `ostream << long`
// inside the extension crashed the process (SIGSEGV) instead of raising the error.
// Host code only (dispatch.cpp, dispatch_cuda.cpp).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace lazarus_dispatch {

inline std::string msg_part(const char* s) { return std::string(s); }
inline std::string msg_part(const std::string& s) { return s; }
inline std::string msg_part(c10::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}
template <typename T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
inline std::string msg_part(T value) {
  return std::to_string(value);
}

template <typename... Parts>
std::string msg(const Parts&... parts) {
  std::string out;
  int expand[] = {0, (out += msg_part(parts), 0)...};
  (void)expand;
  return out;
}

}  // namespace lazarus_dispatch
