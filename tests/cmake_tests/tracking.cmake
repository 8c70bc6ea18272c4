# unit_tracking: the pseudo-terminal tests need openpty/forkpty (libutil), and
# the TensorBoard tests run the committed stdlib-only Python event reader.
if(TARGET unit_tracking)
  target_link_libraries(unit_tracking PRIVATE util)
  target_compile_definitions(unit_tracking PRIVATE
    ACCEL_TFEVENTS_READER="${CMAKE_CURRENT_SOURCE_DIR}/unit/tracking/read_tfevents.py")
endif()
