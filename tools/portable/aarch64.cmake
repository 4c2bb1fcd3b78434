# CMake toolchain for the portable aarch64 (Grace) bundle, inside tools/portable/bundle.sh's
# Debian 11 root: tools/cross/aarch64.cmake (the cross compiler, the aarch64 torch wheel that
# tools/cross/aarch64-setup.sh unpacked, mounted at its path: TESSEL_AARCH64_ROOT), with the root's
# own target folders instead of Debian 12's unpacked packages: the cross GCC 10's glibc 2.31 and
# C++ runtime (/usr/aarch64-linux-gnu), arm64 packages (GoogleTest and yaml-cpp 0.6's library
# under /, its -dev in /opt/arm64) and the header-only libraries (/opt/deps); and LibTorch's CUDA
# half, built into libtessel_cuda.
if(NOT DEFINED ENV{TESSEL_AARCH64_ROOT})
  message(FATAL_ERROR "tools/portable/aarch64.cmake: TESSEL_AARCH64_ROOT is not set")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/../cross/aarch64.cmake)
set(TESSEL_CROSS_CUDA_MODULE ON CACHE BOOL "libtessel_cuda: the bundle's CUDA half")
set(CMAKE_FIND_ROOT_PATH "${_root}" /opt/arm64 / /usr/aarch64-linux-gnu /opt/deps)
set(_links "-Wl,-rpath-link,${_root}/torch/lib -Wl,-rpath-link,${_root}/nvidia/cu13/lib")
set(CMAKE_EXE_LINKER_FLAGS_INIT "${_links}")
set(CMAKE_MODULE_LINKER_FLAGS_INIT "${_links}")
unset(CMAKE_CROSSCOMPILING_EMULATOR)  # no qemu in the root; nothing built runs there
