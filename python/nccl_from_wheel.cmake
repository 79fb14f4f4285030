# Included right after project(epmoe) when CMAKE_PROJECT_epmoe_INCLUDE names it (pyproject.toml
# does, so `pip install .` gets it, and tests/python/gpu/run_torchrun.sh).
#
# One process, one libnccl.so.2: torch loads NCCL from the nvidia-nccl-cu* wheel of its venv, and
# a module linked against another libnccl.so.2 (the CUDA toolkit's, /usr's) makes whichever is
# imported second use the first one's library: `import torch` after `import epmoe` then failed
# with "undefined symbol: ncclCommResume". So where the wheel is importable, NCCL_ROOT points at
# it (headers and library of one version, as the device API needs) and python/CMakeLists.txt
# links the module with an rpath to it. NCCL_ROOT given on the command line or in the environment
# wins. pip's build isolation hides the wheel: use `pip install --no-build-isolation .` or set
# NCCL_ROOT.
if(NOT NCCL_ROOT AND DEFINED ENV{NCCL_ROOT})
  set(NCCL_ROOT "$ENV{NCCL_ROOT}" CACHE PATH "NCCL installation (include/ and lib/)")
endif()
if(NOT NCCL_ROOT)
  set(_epmoe_python "${Python_EXECUTABLE}")  # scikit-build-core passes it
  if(NOT _epmoe_python)
    find_program(EPMOE_NCCL_PYTHON NAMES python3 python)
    set(_epmoe_python "${EPMOE_NCCL_PYTHON}")
  endif()
  if(_epmoe_python)
    execute_process(
      COMMAND "${_epmoe_python}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _epmoe_wheel OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _epmoe_rc ERROR_QUIET)
    if(_epmoe_rc EQUAL 0 AND EXISTS "${_epmoe_wheel}/include/nccl.h"
       AND EXISTS "${_epmoe_wheel}/lib/libnccl.so.2")
      set(NCCL_ROOT "${_epmoe_wheel}" CACHE PATH "NCCL installation (include/ and lib/)")
      message(STATUS "epmoe: NCCL from the Python wheel nvidia.nccl (torch's): ${NCCL_ROOT}")
    endif()
  endif()
endif()
# NCCL_ROOT's own headers and library, decided here: src/CMakeLists.txt searches the name
# libnccl.so in the CUDA toolkit before libnccl.so.2 in NCCL_ROOT (the wheel has only the
# latter), and a build directory configured before against another NCCL keeps that one.
if(NCCL_ROOT AND EXISTS "${NCCL_ROOT}/include/nccl.h" AND EXISTS "${NCCL_ROOT}/lib/libnccl.so.2")
  set(NCCL_INCLUDE_DIR "${NCCL_ROOT}/include" CACHE PATH "NCCL headers" FORCE)
  set(NCCL_LIBRARY "${NCCL_ROOT}/lib/libnccl.so.2" CACHE FILEPATH "NCCL library" FORCE)
endif()
