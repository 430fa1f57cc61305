# DESIGN.md's layout: tools/ (the pdctl CLI) is the top floor; nothing in
# the servers, the engine, the transport or the kernels includes it.
# Run as: cmake -DSOURCE_DIR=<repo> -P tools_is_the_top_floor.cmake
set(offenders "")
foreach(dir common kernels kv_transfer prefill_worker decode_worker router proto)
  file(GLOB_RECURSE sources "${SOURCE_DIR}/${dir}/*.h" "${SOURCE_DIR}/${dir}/*.cc" "${SOURCE_DIR}/${dir}/*.cu"
       "${SOURCE_DIR}/${dir}/*.cuh" "${SOURCE_DIR}/${dir}/CMakeLists.txt")
  foreach(f ${sources})
    file(STRINGS "${f}" hits REGEX "#include \"tools/|pdserve_pdctl|tools/pdctl")
    if(hits)
      file(RELATIVE_PATH rel "${SOURCE_DIR}" "${f}")
      list(APPEND offenders "${rel}: ${hits}")
    endif()
  endforeach()
endforeach()
if(offenders)
  list(JOIN offenders "\n  " text)
  message(FATAL_ERROR "these files reach into tools/ (the CLI sits above the servers):\n  ${text}")
endif()
message(STATUS "no file outside tools/ includes or links tools/")
