#include "verbs/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace hixl::log {
namespace {
Level threshold() {
  static const Level lv = [] {
    const char* e = std::getenv("HIXL_LOG_LEVEL");
    if (!e) return Level::kWarn;
    if (!std::strcmp(e, "debug")) return Level::kDebug;
    if (!std::strcmp(e, "info")) return Level::kInfo;
    if (!std::strcmp(e, "error")) return Level::kError;
    return Level::kWarn;
  }();
  return lv;
}
const char* name(Level lv) {
  switch (lv) {
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarn: return "WARN";
    default: return "ERROR";
  }
}
}  // namespace

bool enabled(Level lv) { return lv >= threshold(); }

void write(Level lv, const std::string& msg) {
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  std::fprintf(stderr, "[hixl %s] %s\n", name(lv), msg.c_str());
}

}  // namespace hixl::log
