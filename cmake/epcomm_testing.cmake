# Test registration helpers.
include(GoogleTest)

# epcomm_add_unit_test(<file.cc> [LIBS ...]): one gtest executable per file, each TEST a ctest entry
# labelled `unit` and named `<file>.<Suite>.<Test>`, so `ctest -R <file>` selects one file's tests.
function(epcomm_add_unit_test file)
  cmake_parse_arguments(ARG "" "" "LIBS" ${ARGN})
  get_filename_component(name ${file} NAME_WE)
  add_executable(${name} ${file})
  target_link_libraries(${name} PRIVATE epcomm epcomm_testsupport GTest::gtest_main ${ARG_LIBS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  gtest_discover_tests(${name} TEST_PREFIX "${name}." PROPERTIES LABELS unit DISCOVERY_TIMEOUT 60)
  # `epcomm_unit_tests` builds every unit test program (what the `unit` label runs) and nothing else.
  if(NOT TARGET epcomm_unit_tests)
    add_custom_target(epcomm_unit_tests)
  endif()
  add_dependencies(epcomm_unit_tests ${name})
endfunction()

# epcomm_add_multirank_test(<case> LAUNCHERS thread fork NP 1 2 4 [TIMEOUT s] [LABELS extra...]
#                           [ENVIRONMENT VAR=value...] [SUFFIX s]):
# registers <case>.<launcher>.np<N><s> running the `multirank_tests` driver. Exit code 77 means skipped.
# Every test is labelled `multirank` (threads) or `multiproc` (forked ranks), plus the extra LABELS.
function(epcomm_add_multirank_test case)
  cmake_parse_arguments(ARG "" "TIMEOUT;SUFFIX" "LAUNCHERS;NP;LABELS;ENVIRONMENT" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  foreach(launcher ${ARG_LAUNCHERS})
    foreach(np ${ARG_NP})
      set(test_name ${case}.${launcher}.np${np}${ARG_SUFFIX})
      add_test(NAME ${test_name} COMMAND multirank_tests --case ${case} --launcher ${launcher} --np ${np})
      if(launcher STREQUAL "fork")
        set(label multiproc)
      else()
        set(label multirank)
      endif()
      set(labels ${label} ${ARG_LABELS})
      set_tests_properties(${test_name} PROPERTIES LABELS "${labels}" TIMEOUT ${ARG_TIMEOUT}
                           SKIP_RETURN_CODE 77 PROCESSORS 1)
      if(ARG_ENVIRONMENT)
        set_tests_properties(${test_name} PROPERTIES ENVIRONMENT "${ARG_ENVIRONMENT}")
      endif()
    endforeach()
  endforeach()
endfunction()

# epcomm_scale_test_timeouts(): in sanitized builds (cmake/epcomm_sanitize.cmake), multiplies the TIMEOUT of
# every test registered so far in the calling directory by EPCOMM_TEST_TIMEOUT_SCALE (instrumented code runs
# slower). Call it at the end of each directory that registers tests (set_tests_properties only reaches
# tests of its own directory).
function(epcomm_scale_test_timeouts)
  if(NOT EPCOMM_TEST_TIMEOUT_SCALE)
    return()
  endif()
  get_property(names DIRECTORY PROPERTY TESTS)
  foreach(name IN LISTS names)
    get_test_property(${name} TIMEOUT limit)
    if(limit)
      math(EXPR limit "${limit} * ${EPCOMM_TEST_TIMEOUT_SCALE}")
      set_tests_properties(${name} PROPERTIES TIMEOUT ${limit})
    endif()
  endforeach()
endfunction()

# epcomm_unwind_mpi_tests_fully(): in AddressSanitizer builds, every test labelled `mpi` in the calling
# directory runs with ASAN_OPTIONS += fast_unwind_on_malloc=0. Open MPI keeps what MPI_Init and its progress
# thread allocate until the process exits; tools/sanitizers/lsan.supp names those callers, but the fast
# unwinder stops in Open MPI's plugins (no frame pointers, and unloaded before the report) and never reaches
# them. Full unwinding costs time on every allocation, so only these tests pay it.
function(epcomm_unwind_mpi_tests_fully)
  if(NOT EPCOMM_SANITIZE STREQUAL "address")
    return()
  endif()
  get_property(names DIRECTORY PROPERTY TESTS)
  foreach(name IN LISTS names)
    get_test_property(${name} LABELS labels)
    if("mpi" IN_LIST labels)
      set_property(TEST ${name} APPEND PROPERTY ENVIRONMENT_MODIFICATION
                   "ASAN_OPTIONS=string_append::fast_unwind_on_malloc=0")
    endif()
  endforeach()
endfunction()
