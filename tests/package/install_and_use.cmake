# tests/package/install_and_use.cmake (cmake -P): installs BUILD_DIR into WORK_DIR/prefix, checks the files a
# user looks for, builds examples/consumer with find_package(epcomm) and with pkg-config and runs both (2
# forked ranks, one dispatch and combine), builds and runs its MPI program under MPIEXEC (when epcomm::mpi
# exists), and imports the installed Python package with PYTHON (when given).
foreach(v BUILD_DIR SOURCE_DIR WORK_DIR CXX)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_and_use.cmake needs -D${v}=...")
  endif()
endforeach()
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " shown "${ARGN}")
    message(FATAL_ERROR "${what}: '${shown}' exited with ${rc}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
  set(run_out "${out}" PARENT_SCOPE)
endfunction()

function(expect_two_ranks what text)
  string(REGEX MATCHALL "rank [01]: [^\n]*combine correct" hits "${text}")
  list(LENGTH hits n)
  if(NOT n EQUAL 2)
    message(FATAL_ERROR "${what}: expected both ranks to report 'combine correct', got:\n${text}")
  endif()
endfunction()

run("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(f include/epcomm/buffer.h include/epcomm/bootstrap_mpi.h include/epcomm/moe/distribute_v2.h
          lib/cmake/epcomm/epcommConfig.cmake lib/cmake/epcomm/epcommConfigVersion.cmake
          lib/cmake/epcomm/epcommTargets.cmake lib/pkgconfig/epcomm.pc lib/libepcomm.a bin/epcomm)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "cmake --install --prefix ${prefix} did not create ${f}")
  endif()
endforeach()

# find_package(epcomm), exactly as a user's project does it.
set(consumer ${WORK_DIR}/consumer-build)
run("configure the consumer" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/consumer -B ${consumer} -G Ninja
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release)
run("build the consumer" ${CMAKE_COMMAND} --build ${consumer})
run("run the consumer" ${consumer}/consumer)
expect_two_ranks("find_package consumer" "${run_out}")
if(EXISTS ${consumer}/consumer_mpi)
  if(NOT MPIEXEC)
    message(FATAL_ERROR "epcomm::mpi was found but no MPIEXEC was given to run consumer_mpi")
  endif()
  run("run the MPI consumer" ${MPIEXEC} --allow-run-as-root --oversubscribe --mca btl self,vader -n 2 ${consumer}/consumer_mpi)
  expect_two_ranks("MPI consumer" "${run_out}")
endif()

# pkg-config, from the flags the installed epcomm.pc gives.
find_program(PKG_CONFIG pkg-config REQUIRED)
set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig)
run("pkg-config" ${PKG_CONFIG} --cflags --libs epcomm)
string(STRIP "${run_out}" flags)
separate_arguments(flags UNIX_COMMAND "${flags}")
run("compile with pkg-config flags" ${CXX} ${SOURCE_DIR}/examples/consumer/main.cc ${flags} -o ${WORK_DIR}/pc_consumer)
run("run the pkg-config consumer" ${WORK_DIR}/pc_consumer)
expect_two_ranks("pkg-config consumer" "${run_out}")

# The Python package lands under the prefix, where that prefix's Python looks.
if(PYTHON)
  file(GLOB site ${prefix}/lib/python3*/site-packages)
  if(NOT site)
    message(FATAL_ERROR "no lib/python3*/site-packages under ${prefix}")
  endif()
  set(ENV{PYTHONPATH} ${site})
  run("import the installed package" ${PYTHON} -c
      "import epcomm, deep_ep, sys; f = epcomm._C.__file__; assert f.startswith(sys.argv[1]), f; print(f)" ${prefix})
endif()
message(STATUS "installed into ${prefix}; find_package, pkg-config and Python consumers ran")
