# ho_onnx_find_ort_headers(<out-var>): the include folder holding onnxruntime_c_api.h.
# HO_ONNX_ORT_INCLUDE_DIR (cache variable or environment) wins; otherwise the headers are
# fetched once by cmake/fetch_ort_headers.sh into ${CMAKE_BINARY_DIR}/ort-headers.
function(ho_onnx_find_ort_headers out)
  if(HO_ONNX_ORT_INCLUDE_DIR)
    if(NOT EXISTS "${HO_ONNX_ORT_INCLUDE_DIR}/onnxruntime_c_api.h")
      message(FATAL_ERROR "HO_ONNX_ORT_INCLUDE_DIR='${HO_ONNX_ORT_INCLUDE_DIR}' "
                          "holds no onnxruntime_c_api.h")
    endif()
    set(${out} "${HO_ONNX_ORT_INCLUDE_DIR}" PARENT_SCOPE)
    message(STATUS "ho_onnx: ORT headers from ${HO_ONNX_ORT_INCLUDE_DIR}")
    return()
  endif()
  set(dest "${CMAKE_BINARY_DIR}/ort-headers")
  set(inc "${dest}/include/onnxruntime")
  if(NOT EXISTS "${inc}/onnxruntime_c_api.h")
    message(STATUS "ho_onnx: fetching ONNX Runtime headers into ${dest}")
    execute_process(
      COMMAND bash "${CMAKE_CURRENT_SOURCE_DIR}/cmake/fetch_ort_headers.sh" "${dest}"
      RESULT_VARIABLE rc
      OUTPUT_VARIABLE log
      ERROR_VARIABLE log)
    if(NOT rc EQUAL 0 OR NOT EXISTS "${inc}/onnxruntime_c_api.h")
      message(FATAL_ERROR
        "ho_onnx: could not fetch the ONNX Runtime C headers (cmake/fetch_ort_headers.sh "
        "exited with ${rc}):\n${log}\n"
        "Set HO_ONNX_ORT_INCLUDE_DIR (environment, or -Ccmake.define.HO_ONNX_ORT_INCLUDE_DIR=...) "
        "to a folder holding onnxruntime_c_api.h (API version >= 18).")
    endif()
  endif()
  message(STATUS "ho_onnx: ORT headers from ${inc}")
  set(${out} "${inc}" PARENT_SCOPE)
endfunction()
