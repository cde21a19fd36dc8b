# `cmake --install <build> [--prefix P]`: the public headers, the static libraries, the `epcomm` binary, a CMake
# package (find_package(epcomm): targets epcomm::epcomm and epcomm::mpi, dependencies found again with
# find_dependency) and a pkg-config file epcomm.pc. Every destination is relative to the prefix.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(EPCOMM_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/epcomm)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/epcomm DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev
  FILES_MATCHING PATTERN "*.h")

# The layers are three archives; users link epcomm::epcomm, which brings the other two.
set_target_properties(epcomm_base PROPERTIES EXPORT_NAME base)
set_target_properties(epcomm_quant PROPERTIES EXPORT_NAME quant)
set(epcomm_installed_libs epcomm_base epcomm_quant epcomm)
if(TARGET epcomm_mpi)
  set_target_properties(epcomm_mpi PROPERTIES EXPORT_NAME mpi)
  list(APPEND epcomm_installed_libs epcomm_mpi)
endif()
install(TARGETS ${epcomm_installed_libs} EXPORT epcommTargets COMPONENT dev
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT epcommTargets NAMESPACE epcomm:: DESTINATION ${EPCOMM_CMAKE_INSTALL_DIR} COMPONENT dev)
if(TARGET epcomm_cli)
  install(TARGETS epcomm_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT bin)
endif()

# What the config must find again: the archives carry their private dependencies as link-only entries.
if(EPCOMM_WITH_UCX AND UCX_FOUND)
  set(EPCOMM_PACKAGE_UCX ON)
  set(EPCOMM_PC_REQUIRES "ucx")
else()
  set(EPCOMM_PACKAGE_UCX OFF)
  set(EPCOMM_PC_REQUIRES "")
endif()
if(TARGET epcomm_mpi)
  set(EPCOMM_PACKAGE_MPI ON)
else()
  set(EPCOMM_PACKAGE_MPI OFF)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/epcommConfig.cmake.in
  ${PROJECT_BINARY_DIR}/epcommConfig.cmake INSTALL_DESTINATION ${EPCOMM_CMAKE_INSTALL_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/epcommConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/epcommConfig.cmake ${PROJECT_BINARY_DIR}/epcommConfigVersion.cmake
  DESTINATION ${EPCOMM_CMAKE_INSTALL_DIR} COMPONENT dev)

# pkg-config: ${pcfiledir} keeps the file relocatable, whatever prefix it was installed under.
file(RELATIVE_PATH EPCOMM_PC_TO_PREFIX ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
configure_file(${PROJECT_SOURCE_DIR}/cmake/epcomm.pc.in ${PROJECT_BINARY_DIR}/epcomm.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/epcomm.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)
