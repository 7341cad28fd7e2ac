# Script mode: install, configure the consumer against the install, build, run.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)

run_step("install" ${CMAKE_COMMAND} --install ${DTRAIN_BUILD_DIR} --prefix ${prefix})
run_step("configure consumer" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run_step("build consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build -j 2)
run_step("run consumer" ${WORK_DIR}/build/consumer)
if(NOT last_output MATCHES "consumer ok")
  message(FATAL_ERROR "consumer printed: ${last_output}")
endif()
run_step("run consumer_mean_test" ${WORK_DIR}/build/consumer_mean_test)
if(NOT last_output MATCHES "PASSED.*4 tests")
  message(FATAL_ERROR "consumer_mean_test printed: ${last_output}")
endif()
