# Script mode: install dtrain into a scratch prefix, build torch_shim/example (docs/torch.md's
# LibTorch example) against it as a user's project would, run it under dtrun at world 2, and
# import the installed Python package.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

include(${CMAKE_CURRENT_LIST_DIR}/../install/run_step.cmake)

run_step("install" ${CMAKE_COMMAND} --install ${DTRAIN_BUILD_DIR} --prefix ${prefix})
run_step("configure the example" ${CMAKE_COMMAND} -S ${EXAMPLE_SOURCE_DIR} -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=${CMAKE_CUDA_COMPILER})
run_step("build the example" ${CMAKE_COMMAND} --build ${WORK_DIR}/build -j 2)
run_step("run the example under dtrun" ${DTRUN} --nproc 2 ${WORK_DIR}/build/torch_allreduce)
foreach(rank 0 1)
  if(NOT "${last_output}${last_error}" MATCHES "rank ${rank}/2: parameters agree after 10 steps")
    message(FATAL_ERROR "the example's rank ${rank} did not report agreement; it printed:\n${last_output}${last_error}")
  endif()
endforeach()
# (Statements on lines of their own: a ';' would split CMake's argument.)
run_step("import the installed dtrain_torch" ${CMAKE_COMMAND} -E env PYTHONPATH=${prefix}/${PYTHON_INSTALL_DIR}
  ${PYTHON} -c "import dtrain_torch, torch.distributed as d\nassert d.Backend.DTRAIN == 'DTRAIN'\nprint('dtrain_torch', dtrain_torch.__file__)")
if(NOT last_output MATCHES "${prefix}")
  message(FATAL_ERROR "python imported dtrain_torch from elsewhere: ${last_output}${last_error}")
endif()
