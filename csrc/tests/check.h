// Tiny assertion helpers for the ctest executables (no test framework dependency).
#pragma once

#include <cstdio>
#include <exception>
#include <string>

inline int g_failures = 0;

#define CHECK(cond)                                                               \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                               \
    }                                                                             \
  } while (0)

#define CHECK_EQ(a, b) CHECK((a) == (b))

// Expects `expr` to throw an exception whose message contains `needle`.
#define CHECK_THROWS_WITH(expr, needle)                                                        \
  do {                                                                                         \
    bool thrown_ = false;                                                                      \
    try {                                                                                      \
      (void)(expr);                                                                            \
    } catch (const std::exception& e_) {                                                       \
      thrown_ = true;                                                                          \
      if (std::string(e_.what()).find(needle) == std::string::npos) {                          \
        std::fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, e_.what(), needle); \
        ++g_failures;                                                                          \
      }                                                                                        \
    }                                                                                          \
    if (!thrown_) {                                                                            \
      std::fprintf(stderr, "%s:%d: expected %s to throw\n", __FILE__, __LINE__, #expr);        \
      ++g_failures;                                                                            \
    }                                                                                          \
  } while (0)

inline int report(const char* name) {
  if (g_failures) std::fprintf(stderr, "%s: %d check(s) failed\n", name, g_failures);
  else std::printf("%s: all checks passed\n", name);
  return g_failures ? 1 : 0;
}
