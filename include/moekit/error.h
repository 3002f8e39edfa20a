// moekit::Error — the one exception type every public call raises on bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace moekit {

// Names the function, the offending argument, what was expected and what was given,
// so a caller can fix the call without reading moekit's source.
class Error : public std::runtime_error {
 public:
  Error(std::string function, std::string argument, std::string expected, std::string actual);

  const std::string& function() const noexcept { return function_; }
  const std::string& argument() const noexcept { return argument_; }
  const std::string& expected() const noexcept { return expected_; }
  const std::string& actual() const noexcept { return actual_; }

 private:
  std::string function_, argument_, expected_, actual_;
};

}  // namespace moekit
