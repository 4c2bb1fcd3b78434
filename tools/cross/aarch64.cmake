# CMake toolchain for an aarch64 (Grace) build on an x86-64 Debian machine: Debian's cross
# compiler, the aarch64 torch wheel unpacked (TESSEL_TORCH_PREFIX: its CPU half, see
# third_party/dependencies.cmake) and Debian's arm64 packages unpacked, all under one folder that
# tools/cross/aarch64-setup.sh fills without root (TESSEL_AARCH64_ROOT, default
# ~/.cache/tessel/aarch64). Programs it builds run under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
if(DEFINED ENV{TESSEL_AARCH64_ROOT})
  set(_root "$ENV{TESSEL_AARCH64_ROOT}")
else()
  set(_root "$ENV{HOME}/.cache/tessel/aarch64")
endif()
set(TESSEL_TORCH_PREFIX "${_root}/torch" CACHE PATH "the aarch64 torch package folder")
# Libraries, headers and CMake packages from the target's folders only; programs from the host.
set(CMAKE_FIND_ROOT_PATH "${_root}/deb-root" "${_root}" /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# libtorch_cpu names the CUDA runtime and CUPTI (NVIDIA's aarch64 wheels, unpacked beside it).
set(CMAKE_EXE_LINKER_FLAGS_INIT
    "-Wl,-rpath-link,${_root}/torch/lib -Wl,-rpath-link,${_root}/nvidia/cu13/lib -Wl,-rpath-link,${_root}/deb-root/usr/lib/aarch64-linux-gnu")
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
