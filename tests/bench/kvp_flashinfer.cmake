# SPDX-License-Identifier: Apache-2.0
# kvp_flashinfer.cmake - FlashInfer's AppendPagedKVCache as a column of bench_append_cuda
# (issue #18), from the C++ headers of the flashinfer-python wheel, fetched at configure time on
# the development machine; nothing of FlashInfer is in the tree or needed at run time.
#
#   -DKVP_BENCH_FLASHINFER=ON      pip download --no-deps flashinfer-python==$VERSION into
#                                  <build>/flashinfer/wheel (once; reused afterwards), VERSION
#                                  KVP_FLASHINFER_VERSION (default 0.7.2.post1)
#   -DKVP_FLASHINFER_WHEEL=/x.whl  take the headers from that wheel instead (offline use)
#
# The wheel's flashinfer/data/include and its vendored CCCL (cub, libcudacxx, thrust: they
# compile with CUDA 13 as they are) are extracted into <build>/flashinfer/root, and
# kvp_bench_flashinfer.cu is compiled against them with KVP_HAVE_FLASHINFER. When the option is
# off, the download fails or the wheel lacks the headers, the same file builds without them
# (its FlashInfer entry points return KVP_EUNAVAIL) and the bench prints that the column is
# absent; everything else builds as before.
option(KVP_BENCH_FLASHINFER "fetch flashinfer-python headers: bench_append_cuda's baseline" OFF)
set(KVP_FLASHINFER_WHEEL "" CACHE FILEPATH "a flashinfer-python wheel to take the headers from")
set(KVP_FLASHINFER_VERSION "0.7.2.post1" CACHE STRING "the flashinfer-python version to fetch")

set(KVP_HAVE_FLASHINFER OFF)
if(KVP_HAVE_CUDA AND (KVP_BENCH_FLASHINFER OR KVP_FLASHINFER_WHEEL))
  set(fi_dir ${CMAKE_BINARY_DIR}/flashinfer)
  set(fi_wheel "")
  if(KVP_FLASHINFER_WHEEL)
    if(EXISTS ${KVP_FLASHINFER_WHEEL})
      set(fi_wheel ${KVP_FLASHINFER_WHEEL})
    else()
      message(WARNING "KVP_FLASHINFER_WHEEL=${KVP_FLASHINFER_WHEEL} does not exist: "
                      "bench_append_cuda is built without the FlashInfer column")
    endif()
  else()
    file(GLOB fi_found ${fi_dir}/wheel/flashinfer_python-${KVP_FLASHINFER_VERSION}-*.whl)
    if(NOT fi_found)
      find_package(Python3 COMPONENTS Interpreter)
      if(Python3_Interpreter_FOUND)
        message(STATUS "kvpool: pip download flashinfer-python==${KVP_FLASHINFER_VERSION} "
                       "into ${fi_dir}/wheel")
        execute_process(
          COMMAND ${Python3_EXECUTABLE} -m pip download --no-deps --only-binary=:all:
                  --disable-pip-version-check --retries 1 --timeout 60 -q -d ${fi_dir}/wheel
                  flashinfer-python==${KVP_FLASHINFER_VERSION}
          RESULT_VARIABLE fi_rc OUTPUT_VARIABLE fi_out ERROR_VARIABLE fi_out TIMEOUT 900)
        if(NOT fi_rc EQUAL 0)
          message(WARNING "pip download flashinfer-python==${KVP_FLASHINFER_VERSION} failed "
                          "(${fi_rc}): ${fi_out}bench_append_cuda is built without the "
                          "FlashInfer column (or pass -DKVP_FLASHINFER_WHEEL=PATH)")
        endif()
        file(GLOB fi_found ${fi_dir}/wheel/flashinfer_python-${KVP_FLASHINFER_VERSION}-*.whl)
      else()
        message(WARNING "no python3 to run pip: bench_append_cuda is built without the "
                        "FlashInfer column (or pass -DKVP_FLASHINFER_WHEEL=PATH)")
      endif()
    endif()
    if(fi_found)
      list(GET fi_found 0 fi_wheel)
    endif()
  endif()
  if(fi_wheel)
    # extract again only when the wheel changed (path, size or time)
    file(SIZE ${fi_wheel} fi_size)
    file(TIMESTAMP ${fi_wheel} fi_time "%s" UTC)
    set(fi_stamp "${fi_wheel} ${fi_size} ${fi_time}")
    set(fi_old "")
    if(EXISTS ${fi_dir}/root.stamp)
      file(READ ${fi_dir}/root.stamp fi_old)
    endif()
    if(NOT fi_old STREQUAL fi_stamp OR NOT EXISTS ${fi_dir}/root/flashinfer/data/include)
      file(REMOVE_RECURSE ${fi_dir}/root ${fi_dir}/root.stamp)
      file(ARCHIVE_EXTRACT INPUT ${fi_wheel} DESTINATION ${fi_dir}/root
           PATTERNS flashinfer/data/include flashinfer/data/cccl/cub/cub
                    flashinfer/data/cccl/libcudacxx/include flashinfer/data/cccl/thrust/thrust)
      file(WRITE ${fi_dir}/root.stamp "${fi_stamp}")
    endif()
    set(fi_data ${fi_dir}/root/flashinfer/data)
    if(EXISTS ${fi_data}/include/flashinfer/page.cuh AND EXISTS ${fi_data}/cccl/libcudacxx/include)
      set(KVP_HAVE_FLASHINFER ON)
      set(KVP_FLASHINFER_INCLUDES ${fi_data}/include ${fi_data}/cccl/cub
                                  ${fi_data}/cccl/libcudacxx/include ${fi_data}/cccl/thrust)
      set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${fi_wheel})
    else()
      message(WARNING "${fi_wheel} has no flashinfer/data/include/flashinfer/page.cuh or no "
                      "vendored CCCL: bench_append_cuda is built without the FlashInfer column")
    endif()
  endif()
endif()
message(STATUS "kvpool: bench_append_cuda FlashInfer column=${KVP_HAVE_FLASHINFER}")

# kvp_bench_flashinfer: the baseline and the byte check (kvp_bench_flashinfer.h), benchmarks
# only. FlashInfer's headers are SYSTEM includes, so -Werror applies to our code alone.
if(KVP_HAVE_CUDA)
  add_library(kvp_bench_flashinfer STATIC kvp_bench_flashinfer.cu)
  set_target_properties(kvp_bench_flashinfer PROPERTIES CUDA_ARCHITECTURES "${KVP_CUDA_ARCHS}")
  target_compile_options(kvp_bench_flashinfer PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Werror --Werror all-warnings>)
  target_link_libraries(kvp_bench_flashinfer PUBLIC kvp_kernels kvp_cuda CUDA::cudart_static)
  if(KVP_HAVE_FLASHINFER)
    target_include_directories(kvp_bench_flashinfer SYSTEM PRIVATE ${KVP_FLASHINFER_INCLUDES})
    target_compile_definitions(kvp_bench_flashinfer PRIVATE KVP_HAVE_FLASHINFER=1
                               KVP_FLASHINFER_VERSION="${KVP_FLASHINFER_VERSION}")
  endif()
endif()
