# CMake project hook for the llama-cpp-python build (scripts/llama_cpp.env passes it as CMAKE_PROJECT_INCLUDE).
# llama-cpp-python forces LLAMA_BUILD_COMMON ON (its CMakeLists.txt, `set(LLAMA_BUILD_COMMON ON ... FORCE)`), yet
# its wheel neither installs nor loads libllama-common: it ships llama and ggml only. That library and the
# cpp-httplib it links were 52% of the compile a newcomer waits for (ninja log, 2 cores: 6:42 -> 3:00 without).
# CMake includes this file after every project(); inside llama.cpp's, before its option(), common goes back off,
# as llama-cpp-python itself does for its Emscripten build.
if(PROJECT_NAME STREQUAL "llama.cpp")
  set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
endif()
