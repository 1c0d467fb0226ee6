// Status and Result<T>: how every fallible call in ml4 reports failure.
//
// A failure carries a message a user can act on ("tensor layers.3.attention.wkv_b.weight:
// expected [16384, 512] bf16, found [16384, 256]"). No exceptions cross module
// boundaries; user input never aborts the process (STYLE.md rule 6).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace ml4 {

enum class StatusCode {
  kOk,
  kInvalidArgument,  // bad user input: a request, a flag, a file
  kNotFound,         // a file, tensor or model that is not there
  kOutOfRange,       // an index or a length past its bound
  kResourceExhausted,  // no KV blocks, a full queue
  kUnimplemented,    // a feature a backend does not declare
  kInternal,         // a bug in ml4
  kIo,               // the OS said no
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // Prefixes context: Status("bad shape").with_context("tensor x") -> "tensor x: bad shape".
  Status with_context(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// The success value: `return ok_status();`. (No static Status::ok(): called through an
// instance, `st.ok()` compiled and returned a fresh success, so `EXPECT_FALSE(st.ok())` failed
// and `if (!st.ok())` never fired; now ok() is the member, as on Result.)
inline Status ok_status() { return {}; }

template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status not_found(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kNotFound, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status out_of_range(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kOutOfRange, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status resource_exhausted(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kResourceExhausted, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status unimplemented(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kUnimplemented, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status internal_error(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kInternal, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status io_error(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kIo, fmt::format(f, std::forward<Args>(args)...));
}

// A value or a failure. Access value() only after checking ok().
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT
  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ml4

#define ML4_CONCAT_INNER(a, b) a##b
#define ML4_CONCAT(a, b) ML4_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if `expr` failed.
#define ML4_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::ml4::Status ml4_status_ = (expr);        \
    if (!ml4_status_.ok()) return ml4_status_; \
  } while (0)

// ML4_ASSIGN_OR_RETURN(auto x, make_x()): unwraps a Result or returns its Status.
#define ML4_ASSIGN_OR_RETURN(lhs, rexpr) \
  ML4_ASSIGN_OR_RETURN_IMPL(ML4_CONCAT(ml4_result_, __LINE__), lhs, rexpr)
#define ML4_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                              \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
