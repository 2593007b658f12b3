// Minimal leveled logging to stderr. HIXL_LOG_LEVEL=debug|info|warn|error (default warn).
#pragma once

#include <string>

namespace hixl::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

bool enabled(Level lv);
void write(Level lv, const std::string& msg);

inline void debug(const std::string& m) { if (enabled(Level::kDebug)) write(Level::kDebug, m); }
inline void info(const std::string& m) { if (enabled(Level::kInfo)) write(Level::kInfo, m); }
inline void warn(const std::string& m) { if (enabled(Level::kWarn)) write(Level::kWarn, m); }
inline void error(const std::string& m) { if (enabled(Level::kError)) write(Level::kError, m); }

}  // namespace hixl::log
