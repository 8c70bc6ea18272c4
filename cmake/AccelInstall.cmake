# install + export: find_package(accel) works from an install prefix.
include(CMakePackageConfigHelpers)
set(ACCEL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/accel)
install(TARGETS accel EXPORT accelTargets)
install(DIRECTORY ${_accel_include_dir}/accel DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT accelTargets NAMESPACE accel:: DESTINATION ${ACCEL_CMAKE_DIR})
export(EXPORT accelTargets NAMESPACE accel:: FILE ${CMAKE_CURRENT_BINARY_DIR}/accelTargets.cmake)
configure_package_config_file(cmake/accelConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/accelConfig.cmake INSTALL_DESTINATION ${ACCEL_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/accelConfigVersion.cmake
  COMPATIBILITY SameMajorVersion ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/accelConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/accelConfigVersion.cmake
  cmake/AccelDependencies.cmake
  DESTINATION ${ACCEL_CMAKE_DIR})
