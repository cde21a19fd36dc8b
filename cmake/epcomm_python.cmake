# The interpreter the Python package is built for, and its torch and pybind11.
# EPCOMM_PYTHON defaults to: the interpreter a Python build backend runs CMake for (`pip install .` passes
# Python_EXECUTABLE), else the project virtual environment <source>/.venv, else python3 on PATH.
if(DEFINED SKBUILD AND DEFINED Python_EXECUTABLE)
  set(epcomm_default_python ${Python_EXECUTABLE})
elseif(EXISTS ${PROJECT_SOURCE_DIR}/.venv/bin/python)
  set(epcomm_default_python ${PROJECT_SOURCE_DIR}/.venv/bin/python)
else()
  find_program(epcomm_default_python NAMES python3.11 python3 NO_CACHE)
endif()
set(EPCOMM_PYTHON ${epcomm_default_python} CACHE FILEPATH "The Python interpreter the package is built for")

# epcomm_find_torch(): asks EPCOMM_PYTHON where its torch and pybind11 keep their CMake packages
# (torch.utils.cmake_prefix_path, pybind11.get_cmake_dir()) and finds both there; sets Torch_FOUND.
macro(epcomm_find_torch)
  execute_process(
    COMMAND ${EPCOMM_PYTHON} -c "import torch.utils, pybind11; print(torch.utils.cmake_prefix_path + ';' + pybind11.get_cmake_dir())"
    OUTPUT_VARIABLE epcomm_py_prefixes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE epcomm_py_rc)
  set(Torch_FOUND FALSE)
  if(epcomm_py_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH ${epcomm_py_prefixes})
    # Torch's config looks for CUDA and Kineto and says so at length; the CPU wheel needs neither.
    find_package(Torch QUIET)
  endif()
endmacro()
