# Finds every dependency; nothing is downloaded here (third_party/setup.sh installs them first).
#
# LibTorch: Torch_DIR when the user gives one, else the torch in .env (a link to the per-user
# environment that setup.sh maintains).
# A cross build (tools/cross/aarch64.cmake) names the target's torch package folder, its wheel
# unpacked: its CMake config would look for a CUDA compiler that runs on the target, so its two
# halves are imported here by hand (the CUDA half with TESSEL_CROSS_CUDA_MODULE).
set(TESSEL_CUDA_MODULE ON)
if(TESSEL_TORCH_PREFIX)
  set(TESSEL_CUDA_MODULE OFF)
  set(TORCH_INSTALL_PREFIX "${TESSEL_TORCH_PREFIX}")
  file(STRINGS "${TESSEL_TORCH_PREFIX}/version.py" _tessel_version_line REGEX "^__version__")
  string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" Torch_VERSION "${_tessel_version_line}")
  add_library(torch_cpu_library INTERFACE IMPORTED)
  target_link_libraries(torch_cpu_library INTERFACE "${TESSEL_TORCH_PREFIX}/lib/libtorch_cpu.so"
                        "${TESSEL_TORCH_PREFIX}/lib/libc10.so")
  # What the wheel's own config gives its CPU half (c10d with Gloo).
  target_compile_definitions(torch_cpu_library INTERFACE USE_C10D_GLOO USE_DISTRIBUTED USE_RPC
                             USE_TENSORPIPE)
  set(TORCH_INCLUDE_DIRS "${TESSEL_TORCH_PREFIX}/include"
      "${TESSEL_TORCH_PREFIX}/include/torch/csrc/api/include")
  # c10's CUDA runtime (streams, events, the caching allocator) and the CUDA headers its headers
  # name (the runtime's, cuBLAS's, cuSPARSE's, cuSOLVER's: the same on every architecture).
  add_library(c10_cuda INTERFACE IMPORTED)
  target_link_libraries(c10_cuda INTERFACE "${TESSEL_TORCH_PREFIX}/lib/libc10_cuda.so"
                        "${TESSEL_TORCH_PREFIX}/../nvidia/cu13/lib/libcudart.so.13")
  target_include_directories(c10_cuda SYSTEM INTERFACE "${TESSEL_TORCH_PREFIX}/../nvidia/cu13/include")
  set(TORCH_CXX_FLAGS -D_GLIBCXX_USE_CXX11_ABI=1)
  file(STRINGS "${TESSEL_TORCH_PREFIX}/version.py" _tessel_cuda_line REGEX "^cuda")
  string(REGEX MATCH "[0-9]+\\.[0-9]+" TESSEL_TORCH_CUDA "${_tessel_cuda_line}")
  # Its CUDA half (libtorch_cuda, what libtessel_cuda links; C++ only, so no CUDA compiler), with
  # the flags its config gives it and NCCL's header from NVIDIA's wheel (aarch64-setup.sh copies
  # it: the same on every architecture). Its own libraries (cuBLAS, cuDNN, NCCL, ...) are the
  # wheel's at run time; a module may leave their symbols to them.
  # Only where asked (the aarch64 bundle: tools/portable/aarch64.cmake): `make test-aarch64` runs
  # its unit suite under qemu, which has none of those libraries to load the module with.
  option(TESSEL_CROSS_CUDA_MODULE "build libtessel_cuda in a cross build" OFF)
  if(TESSEL_CROSS_CUDA_MODULE)
    foreach(f "${TESSEL_TORCH_PREFIX}/lib/libtorch_cuda.so" "${TESSEL_TORCH_PREFIX}/../nvidia/nccl/include/nccl.h")
      if(NOT EXISTS "${f}")
        message(FATAL_ERROR "TESSEL_CROSS_CUDA_MODULE: ${f} is missing (tools/cross/aarch64-setup.sh puts it there)")
      endif()
    endforeach()
    set(TESSEL_CUDA_MODULE ON)
    add_library(torch_cuda_library INTERFACE IMPORTED)
    target_link_libraries(torch_cuda_library INTERFACE "${TESSEL_TORCH_PREFIX}/lib/libtorch_cuda.so"
                          c10_cuda torch_cpu_library)
    target_compile_definitions(torch_cuda_library INTERFACE USE_NVSHMEM USE_C10D_NCCL)
  endif()
  set(_tessel_torch_pkg "${TESSEL_TORCH_PREFIX}")
  set(Torch_DIR "${TESSEL_TORCH_PREFIX}/share/cmake/Torch")  # (the paths derived from it below)
  message(STATUS "LibTorch ${Torch_VERSION} from ${TESSEL_TORCH_PREFIX}, cross build (CUDA module: "
          "${TESSEL_CUDA_MODULE})")
else()
  if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
    set(_tessel_py ${CMAKE_SOURCE_DIR}/.env/bin/python)
    if(NOT EXISTS ${_tessel_py})
      message(FATAL_ERROR "No LibTorch: run `make build` (it runs third_party/setup.sh) or set Torch_DIR")
    endif()
    execute_process(COMMAND ${_tessel_py} -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'share', 'cmake', 'Torch'))"
                    OUTPUT_VARIABLE Torch_DIR OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  endif()
  # The CUDA wheel's config enables CUDA and looks for the toolkit; no GPU is needed to build.
  if(NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  # The real path (the per-user cache, not the checkout's .env link): include paths are then the same
  # for every checkout, which ccache needs to share its entries between them.
  get_filename_component(Torch_DIR "${Torch_DIR}" REALPATH)
  # The CUDA compiler that config looks for (Tessel compiles no CUDA code). Torch's CUDA version is in
  # its version.py; NVIDIA's compiler wheels of that version beside torch's runtime wheels (setup.sh
  # installs them) are used unless CMAKE_CUDA_COMPILER or CUDACXX names another: the headers and the
  # runtime Tessel compiles and links against are then torch's own, on a machine with no toolkit or
  # with another version. Without the wheels (a Torch_DIR of the user's own), CMake's usual search.
  get_filename_component(_tessel_torch_pkg "${Torch_DIR}/../../.." ABSOLUTE)
  set(TESSEL_TORCH_CUDA "")
  if(EXISTS "${_tessel_torch_pkg}/version.py")
    file(STRINGS "${_tessel_torch_pkg}/version.py" _tessel_cuda_line REGEX "^cuda")
    string(REGEX MATCH "[0-9]+\\.[0-9]+" TESSEL_TORCH_CUDA "${_tessel_cuda_line}")
  endif()
  if(TESSEL_TORCH_CUDA AND NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    string(REGEX MATCH "^[0-9]+" _tessel_cuda_major "${TESSEL_TORCH_CUDA}")
    get_filename_component(_tessel_kit "${_tessel_torch_pkg}/../nvidia/cu${_tessel_cuda_major}" ABSOLUTE)
    if(EXISTS "${_tessel_kit}/bin/nvcc")
      set(CMAKE_CUDA_COMPILER "${_tessel_kit}/bin/nvcc" CACHE FILEPATH "CUDA compiler")
      set(CUDA_TOOLKIT_ROOT_DIR "${_tessel_kit}" CACHE PATH "CUDA toolkit")
      set(CUDAToolkit_ROOT "${_tessel_kit}")
    endif()
  endif()
  find_package(Torch REQUIRED)
  message(STATUS "LibTorch ${Torch_VERSION} from ${Torch_DIR}")
  if(TESSEL_TORCH_CUDA AND CMAKE_CUDA_COMPILER_VERSION)
    string(REGEX MATCH "^[0-9]+" _tessel_nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
    string(REGEX MATCH "^[0-9]+" _tessel_cuda_major "${TESSEL_TORCH_CUDA}")
    if(NOT _tessel_nvcc_major STREQUAL _tessel_cuda_major)
      message(FATAL_ERROR "The CUDA compiler ${CMAKE_CUDA_COMPILER} is CUDA ${CMAKE_CUDA_COMPILER_VERSION}; "
              "this torch was built with CUDA ${TESSEL_TORCH_CUDA}, whose runtime Tessel links. Unset "
              "CUDACXX / CMAKE_CUDA_COMPILER to use NVIDIA's CUDA ${TESSEL_TORCH_CUDA} wheels (third_party/"
              "setup.sh installs them), or name a CUDA ${_tessel_cuda_major} compiler")
    endif()
    message(STATUS "CUDA compiler: ${CMAKE_CUDA_COMPILER} (CUDA ${CMAKE_CUDA_COMPILER_VERSION}; torch's: ${TESSEL_TORCH_CUDA})")
  endif()
endif()

# The OpenMP runtime LibTorch's CPU library loads (GNU libgomp in the PyPI wheels, Intel's libiomp5
# in some builds; both take GCC's -fopenmp code). Tessel's own threaded loops link that very file,
# so the process holds one OpenMP runtime and one thread team.
find_library(TESSEL_OPENMP_RUNTIME NAMES gomp iomp5 libgomp.so.1 libiomp5.so
             PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
if(NOT TESSEL_OPENMP_RUNTIME)
  find_package(OpenMP REQUIRED COMPONENTS CXX)
  set(TESSEL_OPENMP_RUNTIME OpenMP::OpenMP_CXX)
  message(STATUS "OpenMP: no runtime beside LibTorch in ${TORCH_INSTALL_PREFIX}/lib; the compiler's")
else()
  message(STATUS "OpenMP runtime: ${TESSEL_OPENMP_RUNTIME} (LibTorch's own)")
endif()

# tessel::torch: LibTorch's CPU half (libtorch_cpu: every operator, autograd, c10d with Gloo) and
# c10's small CUDA runtime (streams, events, the caching allocator), with their compile flags.
# LibTorch's CUDA half (libtorch_cuda, which brings cuBLAS, cuDNN, NCCL and the rest: about a third
# of a second of one core and a gigabyte mapped at every start) is linked only into
# libtessel_cuda.so (tessel::torch_cuda), which core/device/cuda.cpp loads when a process may compute
# on a GPU: a CPU run, a dry run, tessel-data and tessel-launch never map it.
add_library(tessel_torch INTERFACE)
add_library(tessel::torch ALIAS tessel_torch)
target_link_libraries(tessel_torch INTERFACE torch_cpu_library)
# What the `torch` target (libtorch.so, which names libtorch_cuda) would add: the C++ API's headers
# and LibTorch's required flags.
target_include_directories(tessel_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
target_compile_options(tessel_torch INTERFACE ${TORCH_CXX_FLAGS})
if(TARGET c10_cuda)
  target_link_libraries(tessel_torch INTERFACE c10_cuda)
endif()
target_include_directories(tessel_torch SYSTEM INTERFACE ${TESSEL_GLOO_INCLUDE})
add_library(tessel_torch_cuda INTERFACE)
add_library(tessel::torch_cuda ALIAS tessel_torch_cuda)
target_link_libraries(tessel_torch_cuda INTERFACE tessel_torch)
if(NOT TESSEL_CUDA_MODULE)
  # (a cross build: no CUDA half)
elseif(TARGET torch_cuda_library)
  target_link_libraries(tessel_torch_cuda INTERFACE torch_cuda_library)
  # c10d's NCCL headers include nccl.h, which no CUDA toolkit need have: the NCCL wheel's beside
  # torch (the NCCL torch runs with), when there is one.
  get_filename_component(_tessel_nccl "${_tessel_torch_pkg}/../nvidia/nccl/include" ABSOLUTE)
  if(EXISTS "${_tessel_nccl}/nccl.h")
    target_include_directories(tessel_torch_cuda SYSTEM INTERFACE "${_tessel_nccl}")
  endif()
else()
  message(FATAL_ERROR "LibTorch at ${Torch_DIR} has no CUDA half (torch_cuda): Tessel needs the "
          "CUDA build of torch (third_party/setup.sh installs the pinned wheel)")
endif()

# libtorch.so and libtorch_cpu.so export a statically linked, older std::filesystem. Symbols bind
# to the first library in load order that defines them, and libtorch comes before libstdc++ on the
# link line, so our std::filesystem calls would land in torch's copy (remove_all jumps to a null
# pointer there). Naming libstdc++ first makes our std:: calls bind to the system library.
target_link_options(tessel_torch INTERFACE "LINKER:--push-state,--no-as-needed" -lstdc++ "LINKER:--pop-state")

# Debian packages that third_party/setup.sh unpacked without root (.deps -> the per-user cache).
if(EXISTS ${CMAKE_SOURCE_DIR}/.deps/usr)
  get_filename_component(_tessel_deps ${CMAKE_SOURCE_DIR}/.deps/usr REALPATH)
  list(APPEND CMAKE_PREFIX_PATH ${_tessel_deps})
endif()

find_package(Threads REQUIRED)  # std::thread needs libpthread before glibc 2.34
find_package(yaml-cpp REQUIRED)
# spdlog and fmt: their libraries (Debian's, conda's, spack's), or with TESSEL_HEADER_ONLY_LOGGING
# their headers alone from any folder on CMAKE_PREFIX_PATH or CMAKE_INCLUDE_PATH (a package's
# include/, a release tarball's), compiled into the binaries: nothing to install, nothing to carry.
# (TESSEL_HEADER_ONLY_LOGGING=1 in the environment sets it, for `make build`; setup.sh's probe
# then looks for the headers.)
set(_tessel_header_only OFF)
if("$ENV{TESSEL_HEADER_ONLY_LOGGING}" STREQUAL "1")
  set(_tessel_header_only ON)
endif()
option(TESSEL_HEADER_ONLY_LOGGING "spdlog and fmt from their headers alone (no libraries)"
       ${_tessel_header_only})
if(TESSEL_HEADER_ONLY_LOGGING)
  find_path(TESSEL_SPDLOG_INCLUDE spdlog/spdlog.h)
  find_path(TESSEL_FMT_INCLUDE fmt/core.h)
  if(NOT TESSEL_SPDLOG_INCLUDE OR NOT TESSEL_FMT_INCLUDE)
    message(FATAL_ERROR "TESSEL_HEADER_ONLY_LOGGING: spdlog/spdlog.h (${TESSEL_SPDLOG_INCLUDE}) or "
            "fmt/core.h (${TESSEL_FMT_INCLUDE}) not found: add the folder holding spdlog/ and fmt/ "
            "to CMAKE_PREFIX_PATH (its include/) or CMAKE_INCLUDE_PATH")
  endif()
  add_library(tessel_fmt_headers INTERFACE)
  target_include_directories(tessel_fmt_headers SYSTEM INTERFACE ${TESSEL_FMT_INCLUDE})
  target_compile_definitions(tessel_fmt_headers INTERFACE FMT_HEADER_ONLY=1)
  add_library(fmt::fmt ALIAS tessel_fmt_headers)
  add_library(tessel_spdlog_headers INTERFACE)
  target_include_directories(tessel_spdlog_headers SYSTEM INTERFACE ${TESSEL_SPDLOG_INCLUDE})
  target_compile_definitions(tessel_spdlog_headers INTERFACE SPDLOG_FMT_EXTERNAL)
  target_link_libraries(tessel_spdlog_headers INTERFACE tessel_fmt_headers Threads::Threads)
  add_library(spdlog::spdlog ALIAS tessel_spdlog_headers)
  message(STATUS "spdlog and fmt header-only: ${TESSEL_SPDLOG_INCLUDE}, ${TESSEL_FMT_INCLUDE}")
else()
  find_package(spdlog REQUIRED)
  find_package(fmt REQUIRED)
endif()
find_package(CLI11 REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(GTest QUIET)  # tests only (CMakeLists.txt)

# ProcessGroupGloo.hpp includes gloo's own headers, which the torch wheel does not ship: Debian's
# libgloo-dev, or any folder holding gloo/algorithm.h (TESSEL_GLOO_INCLUDE, CMAKE_PREFIX_PATH).
# Headers only: the wheel's libtorch_cpu carries gloo itself (docs/gloo.md says why that is sound).
find_path(TESSEL_GLOO_INCLUDE gloo/algorithm.h HINTS ENV TESSEL_GLOO_INCLUDE ${_tessel_deps}/include)
if(NOT TESSEL_GLOO_INCLUDE)
  message(FATAL_ERROR "gloo headers not found (gloo/algorithm.h), needed by c10d's "
          "ProcessGroupGloo.hpp: install Debian's libgloo-dev, or run third_party/setup.sh (which "
          "unpacks it without root where apt-get exists), or set TESSEL_GLOO_INCLUDE to a folder "
          "holding gloo/algorithm.h (a gloo source checkout's root)")
endif()

# LibTorch's include folder carries its own fmt (12.x) which would shadow Debian's fmt 9 that
# Debian's spdlog is built against (spdlog then fails to compile). A folder holding only a link to
# Debian's fmt goes first on the include path. The two fmt versions live in different inline
# namespaces (fmt::v9, fmt::v12), so their symbols cannot collide.
get_target_property(_fmt_inc fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
if(NOT _fmt_inc)
  set(_fmt_inc /usr/include)
endif()
list(GET _fmt_inc 0 _fmt_inc)
# With our cached environment and the system's fmt the shim lives beside it (one path for every
# checkout); with a user's own LibTorch or another fmt it lives in the build folder.
get_filename_component(_torch_venv "${Torch_DIR}/../../../../../../.." REALPATH)
if(EXISTS "${_torch_venv}/pyvenv.cfg" AND _fmt_inc STREQUAL "/usr/include")
  set(TESSEL_FMT_SHIM ${_torch_venv}/tessel-fmt9-shim)
else()
  set(TESSEL_FMT_SHIM ${CMAKE_BINARY_DIR}/fmt-shim)
endif()
file(MAKE_DIRECTORY ${TESSEL_FMT_SHIM})
file(CREATE_LINK ${_fmt_inc}/fmt ${TESSEL_FMT_SHIM}/fmt SYMBOLIC)
target_include_directories(tessel_torch SYSTEM BEFORE INTERFACE ${TESSEL_FMT_SHIM})

# LibTorch's headers put their own path into the binaries (__FILE__ in TORCH_CHECK messages): map
# it, and the shim's, to short names, so no installed binary names this machine's home or cache.
get_filename_component(_torch_root "${Torch_DIR}/../../.." REALPATH)
target_compile_options(tessel_torch INTERFACE "-ffile-prefix-map=${_torch_root}=torch"
                       "-ffile-prefix-map=${TESSEL_FMT_SHIM}=fmt-shim")
