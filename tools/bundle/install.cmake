# `cmake --install build --prefix P` (and `make bundle`): a relocatable tree that runs against the
# torch of any Python with the pinned torch installed, with no root, no apt and no network.
#   P/bin/<tool>              links to libexec/tessel/run.sh (finds LibTorch, then runs the tool)
#   P/libexec/tessel/<tool>   the binaries; RUNPATH $ORIGIN/../../lib/tessel only
#   P/lib/tessel/             their libraries that neither the system's C library nor torch's
#                             wheel provides: yaml-cpp, spdlog, fmt, and the C++ runtime
#   P/share/tessel/           plans, docs, examples/slurm, Python helpers, the GPU suite's
#                             scripts, bench drivers
# No installed file carries a path into this machine's build tree, home or caches (a test checks).
include(GNUInstallDirs)
set(TESSEL_TOOLS tessel-train tessel-launch tessel-data tessel-bench-comm tessel-bench-cp)
if(TARGET tessel-gpu-tests)
  list(APPEND TESSEL_TOOLS tessel-gpu-tests)
endif()
set_target_properties(${TESSEL_TOOLS} PROPERTIES
  INSTALL_RPATH "$ORIGIN/../../lib/tessel"
  INSTALL_RPATH_USE_LINK_PATH OFF
  SKIP_BUILD_RPATH OFF)
install(TARGETS ${TESSEL_TOOLS} RUNTIME DESTINATION libexec/tessel)
# LibTorch's CUDA half's own module (core/device/cuda.h): beside the binaries that load it.
set_target_properties(tessel_cuda PROPERTIES INSTALL_RPATH "$ORIGIN/../../lib/tessel"
  INSTALL_RPATH_USE_LINK_PATH OFF)
install(TARGETS tessel_cuda LIBRARY DESTINATION libexec/tessel)
install(PROGRAMS tools/bundle/run.sh DESTINATION libexec/tessel)
install(FILES ${CMAKE_BINARY_DIR}/TORCH_VERSION DESTINATION share/tessel)
install(CODE "execute_process(COMMAND git -C \"${CMAKE_SOURCE_DIR}\" rev-parse --short HEAD
                OUTPUT_FILE \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/share/tessel/COMMIT\" ERROR_QUIET)")
# What configs/default.yaml trains on (this project's own text), so that it runs from share/tessel.
install(FILES README.md DESTINATION share/tessel)
install(DIRECTORY docs DESTINATION share/tessel FILES_MATCHING PATTERN "*.md")
# The Slurm job scripts README and docs point to (TESSEL_BIN=<prefix>/bin runs them on the bundle).
install(DIRECTORY examples DESTINATION share/tessel)
foreach(dir engine core models tools tests/unit)
  install(DIRECTORY ${dir}/ DESTINATION share/tessel/${dir} FILES_MATCHING PATTERN "*.cpp" PATTERN "*.h"
          PATTERN "bundle" EXCLUDE)
endforeach()
file(WRITE ${CMAKE_BINARY_DIR}/TORCH_VERSION "${Torch_VERSION}\n")
# The CUDA version of the torch build the binaries were linked against (empty: a CPU build):
# run.sh refuses a Python whose torch is another build (the binaries name its CUDA runtime).
file(WRITE ${CMAKE_BINARY_DIR}/TORCH_CUDA "${TESSEL_TORCH_CUDA}\n")
install(FILES ${CMAKE_BINARY_DIR}/TORCH_CUDA DESTINATION share/tessel)
install(DIRECTORY configs DESTINATION share/tessel FILES_MATCHING PATTERN "*.yaml")
install(PROGRAMS tools/plot.py DESTINATION share/tessel/tools)
install(DIRECTORY bench DESTINATION share/tessel FILES_MATCHING PATTERN "*.py")
install(PROGRAMS bench/gpu-check.sh bench/gpu.sh DESTINATION share/tessel/bench)
install(DIRECTORY tests/gpu DESTINATION share/tessel/tests FILES_MATCHING PATTERN "*.py")
install(FILES tests/reference/common.py tests/reference/plans.py DESTINATION share/tessel/tests/reference)

# bin/<tool> -> ../libexec/tessel/run.sh, made at install time (relative links: relocatable).
foreach(tool ${TESSEL_TOOLS})
  install(CODE "
    file(MAKE_DIRECTORY \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/bin\")
    file(CREATE_LINK ../libexec/tessel/run.sh \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/bin/${tool}\" SYMBOLIC)")
endforeach()

# The libraries the binaries need beyond glibc and LibTorch's wheel, resolved as this machine
# resolves them and copied under their sonames.
set(_tessel_exes "")
foreach(tool ${TESSEL_TOOLS})
  list(APPEND _tessel_exes "$<TARGET_FILE:${tool}>")
endforeach()
# A cross build (the aarch64 bundle) reads its binaries with the target's objdump and resolves
# their libraries in the target's folders.
set(_tessel_objdump objdump)
set(_tessel_lib_dirs "")
if(CMAKE_CROSSCOMPILING)
  set(_tessel_objdump "${CMAKE_OBJDUMP}")
  foreach(r ${CMAKE_FIND_ROOT_PATH})
    foreach(d usr/lib/${CMAKE_LIBRARY_ARCHITECTURE} lib/${CMAKE_LIBRARY_ARCHITECTURE} lib)
      if(IS_DIRECTORY "${r}/${d}")
        list(APPEND _tessel_lib_dirs "${r}/${d}")
      endif()
    endforeach()
  endforeach()
  install(CODE "
    set(CMAKE_GET_RUNTIME_DEPENDENCIES_PLATFORM linux+elf)
    set(CMAKE_GET_RUNTIME_DEPENDENCIES_TOOL objdump)
    set(CMAKE_GET_RUNTIME_DEPENDENCIES_COMMAND \"${CMAKE_OBJDUMP}\")")
endif()
install(CODE "
  file(GET_RUNTIME_DEPENDENCIES
    EXECUTABLES ${_tessel_exes}
    MODULES $<TARGET_FILE:tessel_cuda>
    DIRECTORIES ${_tessel_lib_dirs}
    RESOLVED_DEPENDENCIES_VAR deps
    UNRESOLVED_DEPENDENCIES_VAR missing
    PRE_EXCLUDE_REGEXES
      [[^lib(torch|c10|cuda|cudart|cublas|cudnn|nccl|nvrtc|nvToolsExt|gomp|shm|caffe2).*]]
      [[^(linux-vdso|ld-linux).*]] [[^lib(c|m|dl|rt|pthread|util|resolv)\\.so.*]])
  foreach(d \${deps})
    file(INSTALL \${d} DESTINATION \"\${CMAKE_INSTALL_PREFIX}/lib/tessel\" FOLLOW_SYMLINK_CHAIN)
  endforeach()
  if(missing)
    message(FATAL_ERROR \"tessel install: unresolved libraries: \${missing}\")
  endif()
  # The newest glibc symbol version the binaries and the libraries carried need: the oldest C
  # library the bundle runs on, which run.sh checks before anything starts.
  set(floor 2.17)
  file(GLOB carried \"\${CMAKE_INSTALL_PREFIX}/lib/tessel/*\")
  foreach(f ${_tessel_exes} $<TARGET_FILE:tessel_cuda> \${carried})
    execute_process(COMMAND ${_tessel_objdump} -T \${f} OUTPUT_VARIABLE syms ERROR_VARIABLE err
                    RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)  # a floor read from fewer files would be too low
      message(FATAL_ERROR \"tessel install: ${_tessel_objdump} -T \${f} failed (\${rc}): \${err}\")
    endif()
    string(REGEX MATCHALL \"GLIBC_[0-9]+\\\\.[0-9]+\" versions \"\${syms}\")
    foreach(v \${versions})
      string(SUBSTRING \${v} 6 -1 v)
      if(v VERSION_GREATER floor)
        set(floor \${v})
      endif()
    endforeach()
  endforeach()
  file(WRITE \"\${CMAKE_INSTALL_PREFIX}/share/tessel/GLIBC_FLOOR\" \"\${floor}\\n\")
")
