# SPDX-License-Identifier: Apache-2.0
# kvp_server_infra: the daemon's standalone infrastructure - the configuration (kvp_config, INI
# through libinih) and the systemd integration (kvp_notify). The logger is common/'s kvp_log; the
# access policies and namespace names the configuration checks are rpc/'s kvp_policy.
# Included from server/CMakeLists.txt; paths are relative to this file so it works from there.
pkg_check_modules(INIH REQUIRED IMPORTED_TARGET inih)
kvp_prefer_static(PkgConfig::INIH)

add_library(kvp_server_infra STATIC
  ${CMAKE_CURRENT_LIST_DIR}/kvp_config.c
  ${CMAKE_CURRENT_LIST_DIR}/kvp_config_doc.c
  ${CMAKE_CURRENT_LIST_DIR}/kvp_notify.c)
target_include_directories(kvp_server_infra PUBLIC ${CMAKE_CURRENT_LIST_DIR})
# kvp_config.h exposes kvp_geom_t and the KVP_E* codes; inih stays an implementation detail.
target_link_libraries(kvp_server_infra PUBLIC kvp_kvcache kvp_policy kvp_common PRIVATE PkgConfig::INIH)
set_target_properties(kvp_server_infra PROPERTIES POSITION_INDEPENDENT_CODE ON)

# kvp_confdoc: a build-time tool (never installed) that writes the keys of kvpoold.conf(5) and
# the example deploy/kvpoold.conf from the settings table (docs/ and deploy/CMakeLists.txt).
add_executable(kvp_confdoc ${CMAKE_CURRENT_LIST_DIR}/kvp_confdoc.c)
target_link_libraries(kvp_confdoc PRIVATE kvp_server_infra)
