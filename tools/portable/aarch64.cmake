# CMake toolchain for the portable aarch64 (Grace) bundle, inside tools/portable/bundle.sh's
# Debian 11 root: its cross GCC 10 (g++-aarch64-linux-gnu, with glibc 2.31 and GCC 10's runtime in
# /usr/aarch64-linux-gnu), arm64 packages (GoogleTest and yaml-cpp 0.6's library under /, its -dev in /opt/arm64), the
# header-only libraries in /opt/deps, and the aarch64
# torch wheel that tools/cross/aarch64-setup.sh unpacked (TESSEL_AARCH64_ROOT, mounted at its path).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(_root "$ENV{TESSEL_AARCH64_ROOT}")
if(NOT _root)
  message(FATAL_ERROR "tools/portable/aarch64.cmake: TESSEL_AARCH64_ROOT is not set")
endif()
set(TESSEL_TORCH_PREFIX "${_root}/torch" CACHE PATH "the aarch64 torch package folder")
set(TESSEL_CROSS_CUDA_MODULE ON CACHE BOOL "libtessel_cuda: the bundle's CUDA half")
set(CMAKE_FIND_ROOT_PATH "${_root}" /opt/arm64 / /usr/aarch64-linux-gnu /opt/deps)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(_links "-Wl,-rpath-link,${_root}/torch/lib -Wl,-rpath-link,${_root}/nvidia/cu13/lib")
set(CMAKE_EXE_LINKER_FLAGS_INIT "${_links}")
set(CMAKE_MODULE_LINKER_FLAGS_INIT "${_links}")
