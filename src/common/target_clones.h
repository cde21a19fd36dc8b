// common/target_clones.h — EPCOMM_TARGET_CLONES(isa, ...): compile a function once per listed ISA and let the
// loader pick one (GCC target_clones) on x86-64; expands to nothing elsewhere and in ThreadSanitizer builds.
#pragma once

// The clones dispatch through ifunc resolvers that the dynamic loader runs before the TSan runtime is
// initialised; instrumented, they crash at start-up. cmake/epcomm_sanitize.cmake defines
// EPCOMM_NO_TARGET_CLONES for EPCOMM_SANITIZE=thread, which then builds each function once, for the
// compiler's target. The results are the same bits either way.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(EPCOMM_NO_TARGET_CLONES)
#define EPCOMM_TARGET_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#else
#define EPCOMM_TARGET_CLONES(...)
#endif
