// Error type and the three libibverbs return conventions, each encoded once.
//
//   pointer + errno   : ibv_open_device, ibv_alloc_pd, ibv_reg_mr, ibv_create_cq, ibv_create_qp ...
//   return is errno   : ibv_modify_qp, ibv_post_send, ibv_post_recv, ibv_query_port, ibv_req_notify_cq,
//                       ibv_destroy_* (documented as "returns 0 on success, or the value of errno")
//   -1 (or <0) + errno: ibv_poll_cq (<0 on failure), ibv_get_cq_event, ibv_query_gid
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace hixl {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, int err = 0) : std::runtime_error(what), errno_(err) {}
  int err() const noexcept { return errno_; }

 private:
  int errno_;
};

// EOPNOTSUPP / EPROTONOSUPPORT and friends: "not supported", distinct from failure.
class NotSupported : public Error {
 public:
  using Error::Error;
};

inline std::string errno_str(int err) {
  std::ostringstream os;
  os << std::strerror(err) << " (errno " << err << ")";
  return os.str();
}

[[noreturn]] inline void throw_errno(const std::string& call, int err) {
  std::string msg = call + " failed: " + errno_str(err);
  if (err == EOPNOTSUPP || err == ENOTSUP || err == EPROTONOSUPPORT) throw NotSupported(msg, err);
  throw Error(msg, err);
}

// Builds "name(k=v, k=v)" for messages without a printf format per call site.
class CallDesc {
 public:
  explicit CallDesc(const char* name) { os_ << name << "("; }
  template <class T>
  CallDesc& arg(const char* key, const T& v) {
    os_ << (first_ ? "" : ", ") << key << "=" << v;
    first_ = false;
    return *this;
  }
  CallDesc& hex(const char* key, unsigned long long v) {
    os_ << (first_ ? "" : ", ") << key << "=0x" << std::hex << v << std::dec;
    first_ = false;
    return *this;
  }
  std::string str() const { return os_.str() + ")"; }

 private:
  std::ostringstream os_;
  bool first_ = true;
};

}  // namespace hixl

// pointer + errno convention
#define HIXL_CHECK_PTR(expr, desc)                                   \
  ([&]() {                                                           \
    errno = 0;                                                       \
    auto* hixl_p_ = (expr);                                          \
    if (!hixl_p_) ::hixl::throw_errno((desc), errno ? errno : EIO);  \
    return hixl_p_;                                                  \
  }())

// return value is the errno
#define HIXL_CHECK_RET(expr, desc)                   \
  do {                                               \
    int hixl_rc_ = (expr);                           \
    if (hixl_rc_ != 0)                               \
      ::hixl::throw_errno((desc), hixl_rc_ < 0 ? -hixl_rc_ : hixl_rc_); \
  } while (0)

// -1 + errno convention
#define HIXL_CHECK_ERRNO(expr, desc)                              \
  do {                                                            \
    if ((expr) < 0) ::hixl::throw_errno((desc), errno ? errno : EIO); \
  } while (0)
