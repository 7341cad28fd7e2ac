# Each case configures dtrain with switches that cannot be honoured and expects
# configure to fail with a message that says why.
function(expect_configure_failure name expected)
  file(REMOVE_RECURSE ${WORK_DIR}/${name})
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/${name} ${ARGN}
      -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${name}: configure succeeded but should have failed")
  endif()
  if(NOT "${out}${err}" MATCHES "${expected}")
    message(FATAL_ERROR "${name}: configure failed without saying '${expected}':\n${err}")
  endif()
  message(STATUS "${name}: failed as expected")
endfunction()

expect_configure_failure(nccl_without_cuda "DT_USE_NCCL=ON needs CUDA" -DDT_USE_CUDA=OFF -DDT_USE_NCCL=ON)
expect_configure_failure(bad_value "DT_USE_GLOO=maybe is not valid" -DDT_USE_GLOO=maybe)
expect_configure_failure(gloo_missing "DT_USE_GLOO=ON but Gloo was not found"
  -DDT_USE_CUDA=OFF -DDT_USE_GLOO=ON -DGloo_DIR=/nonexistent -DCMAKE_DISABLE_FIND_PACKAGE_Gloo=ON)
expect_configure_failure(etcd_missing "DT_USE_ETCD=ON but libcurl"
  -DDT_USE_CUDA=OFF -DDT_USE_ETCD=ON -DCMAKE_DISABLE_FIND_PACKAGE_CURL=ON)
expect_configure_failure(onednn_missing "DT_USE_ONEDNN=ON but oneDNN was not found.*scripts/setup.sh"
  -DDT_USE_CUDA=OFF -DDT_USE_ONEDNN=ON -DDT_ONEDNN_INCLUDE_DIR=/nonexistent)
expect_configure_failure(torch_missing "DT_BUILD_TORCH=ON but Torch's CMake config.*scripts/setup.sh"
  -DDT_USE_CUDA=OFF -DDT_BUILD_TORCH=ON -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON)
expect_configure_failure(torch_bad_value "DT_BUILD_TORCH=maybe is not valid" -DDT_USE_CUDA=OFF -DDT_BUILD_TORCH=maybe)
file(REMOVE_RECURSE ${WORK_DIR})
