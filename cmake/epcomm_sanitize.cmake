# Sanitized builds (docs/install.md, "Sanitizers"). EPCOMM_SANITIZE=address builds every target of the project
# with AddressSanitizer and UndefinedBehaviorSanitizer, EPCOMM_SANITIZE=thread with ThreadSanitizer; empty (the
# default) builds neither. ./scripts/test --sanitize=... configures such a build in its own directory and runs it
# with the suppressions of tools/sanitizers/ (third-party code only).
set(EPCOMM_SANITIZE "" CACHE STRING "Sanitizers for every target: address (ASan + UBSan), thread (TSan) or empty")
set_property(CACHE EPCOMM_SANITIZE PROPERTY STRINGS "" address thread)

if(NOT EPCOMM_SANITIZE)  # "", OFF
  return()
endif()
if(EPCOMM_SANITIZE STREQUAL "address")
  # float-divide-by-zero stays off (GCC's -fsanitize=undefined leaves it out): the formats define Inf and NaN.
  # -fno-sanitize-recover: an undefined-behaviour finding ends the process, so that the test fails.
  set(epcomm_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=all)
elseif(EPCOMM_SANITIZE STREQUAL "thread")
  set(epcomm_sanitize_flags -fsanitize=thread)
  # GCC target_clones dispatch through ifunc resolvers, which the dynamic loader runs before the TSan runtime
  # is initialised; instrumented, they crash at start-up. common/target_clones.h compiles such functions once.
else()
  message(FATAL_ERROR "EPCOMM_SANITIZE: expected address, thread or empty, got '${EPCOMM_SANITIZE}'")
endif()
# -O1 keeps the sanitized build and its runs affordable (a third of the -O3 compile time) and the stacks
# readable; frame pointers give the runtime's fast unwinder whole stacks.
set(EPCOMM_SANITIZE_OPT -O1 CACHE STRING "Optimization of sanitized builds")
set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "${EPCOMM_SANITIZE_OPT} -g -DNDEBUG")
set(EPCOMM_KERNEL_OPT_FLAG ${EPCOMM_SANITIZE_OPT})
add_compile_definitions(EPCOMM_NO_TARGET_CLONES)
add_compile_options(${epcomm_sanitize_flags} -fno-omit-frame-pointer)
add_link_options(${epcomm_sanitize_flags})
# Instrumented code runs 2-3x (ASan) to 5-15x (TSan) slower: tests registered below get longer limits.
if(EPCOMM_SANITIZE STREQUAL "thread")
  set(EPCOMM_TEST_TIMEOUT_SCALE 4)
else()
  set(EPCOMM_TEST_TIMEOUT_SCALE 2)
endif()
