# Install rules: libraries, headers (under include/dtrain, keeping the module
# folders), dtrun, and a CMake package so that a user's project can do
#   find_package(dtrain REQUIRED)
#   target_link_libraries(app PRIVATE dtrain::dtrain)
include(CMakePackageConfigHelpers)

get_property(_dt_modules GLOBAL PROPERTY DT_MODULE_TARGETS)
install(TARGETS ${_dt_modules} dt_all EXPORT dtrainTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET dtrun)
  install(TARGETS dtrun RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

foreach(_dir common debug tensor data store collectives process_group elastic checkpoint ddp fsdp parallel train launcher testing)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${_dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dtrain/${_dir}
    FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp"
    PATTERN "internal" EXCLUDE)
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/generated/common/config.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dtrain/common)

set(_cfgdir ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain)
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION ${_cfgdir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dtrainConfig.cmake.in
  ${PROJECT_BINARY_DIR}/dtrainConfig.cmake INSTALL_DESTINATION ${_cfgdir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dtrainConfig.cmake ${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake
  DESTINATION ${_cfgdir})
