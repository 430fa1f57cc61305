# Clang's thread-safety analysis over every translation unit of the build
# under one source directory: the ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED
# annotations are checked, and a finding fails (compile only: -fsyntax-only,
# nothing is built). The commands come from the build's compile_commands.json
# (the GCC build's flags, which clang takes).
#
#   cmake -DSOURCE_DIR=<repo> -DBUILD_DIR=<build> -DDIR=<subdir> -DCLANGXX=<clang++> -P thread_safety.cmake
cmake_minimum_required(VERSION 3.19)  # string(JSON)
if(NOT CLANGXX)
  message(FATAL_ERROR "clang++ was not found when the build was configured (deploy/bootstrap.sh installs clang)")
endif()
file(READ "${BUILD_DIR}/compile_commands.json" db)
string(JSON n LENGTH "${db}")
math(EXPR last "${n} - 1")
set(checked 0)
set(failures "")
foreach(i RANGE ${last})
  string(JSON file GET "${db}" ${i} file)
  if(NOT file MATCHES "^${SOURCE_DIR}/${DIR}/" OR NOT file MATCHES "\\.cc$")
    continue()
  endif()
  # clang 14 does not know __builtin_cpu_supports("avx512bf16"); this file
  # holds no lock.
  if(file MATCHES "kernels/cpu/matrix_probes\\.cc$")
    continue()
  endif()
  string(JSON dir GET "${db}" ${i} directory)
  string(JSON command GET "${db}" ${i} command)
  separate_arguments(args UNIX_COMMAND "${command}")
  list(POP_FRONT args)  # The compiler.
  set(keep "")
  set(skip FALSE)
  foreach(a IN LISTS args)
    if(skip)
      set(skip FALSE)
      continue()
    endif()
    if(a STREQUAL "-o" OR a STREQUAL "-MF" OR a STREQUAL "-MT")
      set(skip TRUE)
      continue()
    endif()
    if(a STREQUAL "-c" OR a STREQUAL "-MD" OR a STREQUAL "${file}")
      continue()
    endif()
    # GCC-only optimisation flags clang does not know (and syntax checks
    # do not need).
    if(a STREQUAL "-fno-tree-loop-distribute-patterns")
      continue()
    endif()
    list(APPEND keep "${a}")
  endforeach()
  execute_process(
    COMMAND "${CLANGXX}" ${keep} -fsyntax-only -Wno-everything -Wthread-safety -Werror=thread-safety "${file}"
    WORKING_DIRECTORY "${dir}"
    RESULT_VARIABLE rc
    ERROR_VARIABLE err
    OUTPUT_QUIET)
  math(EXPR checked "${checked} + 1")
  if(NOT rc EQUAL 0)
    string(APPEND failures "\n${err}")
  endif()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "no translation unit under ${DIR}/ in ${BUILD_DIR}/compile_commands.json")
endif()
if(failures)
  message(FATAL_ERROR "clang's thread-safety analysis found problems under ${DIR}/:${failures}")
endif()
message(STATUS "${checked} translation units under ${DIR}/ pass clang -Wthread-safety")
