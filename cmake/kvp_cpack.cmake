# SPDX-License-Identifier: Apache-2.0
# kvp_cpack.cmake - the Debian package of kvpool, built by `cpack -G DEB` from a build
# configured with -DCMAKE_INSTALL_PREFIX=/usr (tests/deb/test_deb.sh builds, installs and
# removes it). One package, kvpool, holding everything `cmake --install` puts on a system:
# kvpoold, kvpoolctl, libkvpool (shared and static), the headers, pkg-config and CMake files,
# the systemd units, the sysusers.d/tmpfiles.d entries, /etc/kvpool/kvpoold.conf (a conffile:
# dpkg -r keeps an admin's edits, dpkg -P removes it), the man pages and the docs. The Python
# wheel's install component ("python") is left out: pip installs that.
#
# deploy/debian/postinst creates the user and /run/kvpool from the installed entries and
# reloads systemd when it runs; it never enables or starts the service. Depends comes from
# dpkg-shlibdeps (dpkg-dev; CPack also needs file(1)). Included last by the top-level
# CMakeLists.txt, once every install rule is known.
include(GNUInstallDirs)

set(KVP_DEB_MAINTAINER "kvpool maintainers <kvpool@localhost>" CACHE STRING
    "Maintainer: field of the Debian package (a real address before publishing one)")
set(KVP_DEB_HOMEPAGE "https://github.com/kvpool/kvpool" CACHE STRING
    "Homepage: field of the Debian package")

# The two files Debian expects in /usr/share/doc/<package>: copyright (machine-readable, the
# licence by its name and notice: Debian systems carry the Apache-2.0 text in
# /usr/share/common-licenses, and Debian wants no second copy) and changelog.Debian.gz.
# Their date is the last commit's (SOURCE_DATE_EPOCH when set): a rebuild gives the same bytes.
set(kvp_deb_doc ${CMAKE_BINARY_DIR}/deb-doc)
if(NOT DEFINED ENV{SOURCE_DATE_EPOCH})
  find_package(Git QUIET)
  if(GIT_FOUND)
    execute_process(COMMAND ${GIT_EXECUTABLE} log -1 --format=%ct
                    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR} OUTPUT_VARIABLE kvp_deb_epoch
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(kvp_deb_epoch MATCHES "^[0-9]+$")
      set(ENV{SOURCE_DATE_EPOCH} ${kvp_deb_epoch}) # string(TIMESTAMP) reads it
    endif()
  endif()
endif()
string(TIMESTAMP kvp_deb_date "%a, %d %b %Y %H:%M:%S +0000" UTC)
string(TIMESTAMP kvp_deb_year "%Y" UTC)
file(WRITE ${kvp_deb_doc}/copyright
     "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: kvpool
Source: ${KVP_DEB_HOMEPAGE}

Files: *
Copyright: ${kvp_deb_year} the kvpool authors
License: Apache-2.0

License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the \"License\"); you may not
 use this file except in compliance with the License. You may obtain a copy of
 the License at http://www.apache.org/licenses/LICENSE-2.0
 .
 Unless required by applicable law or agreed to in writing, software
 distributed under the License is distributed on an \"AS IS\" BASIS, WITHOUT
 WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied. See the
 License for the specific language governing permissions and limitations under
 the License.
 .
 On Debian systems, the complete text of the Apache License, Version 2.0 can be
 found in /usr/share/common-licenses/Apache-2.0.
")
file(WRITE ${kvp_deb_doc}/changelog.Debian
     "kvpool (${PROJECT_VERSION}-1) unstable; urgency=medium

  * Built by CPack from the kvpool ${PROJECT_VERSION} sources (cmake/kvp_cpack.cmake).

 -- ${KVP_DEB_MAINTAINER}  ${kvp_deb_date}
")
execute_process(COMMAND gzip -9nf ${kvp_deb_doc}/changelog.Debian RESULT_VARIABLE kvp_gzip_rc)
install(FILES ${kvp_deb_doc}/copyright DESTINATION ${CMAKE_INSTALL_DOCDIR})
if(kvp_gzip_rc EQUAL 0)
  install(FILES ${kvp_deb_doc}/changelog.Debian.gz DESTINATION ${CMAKE_INSTALL_DOCDIR})
endif()

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME kvpool)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "kvpool")
set(CPACK_PACKAGE_CONTACT "${KVP_DEB_MAINTAINER}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "KV-cache manager daemon for LLM inference servers")
# The extended description: Debian wants lines under 80 columns.
set(CPACK_PACKAGE_DESCRIPTION
    "kvpoold owns the paged KV-cache pool of the GPUs (or of host memory)
and its page allocator; model workers ask it over a Unix-socket protobuf
RPC to append keys and values and get FlashInfer-compatible page tables
back. The package holds the daemon, its systemd units, the operator CLI
kvpoolctl, and the C client library libkvpool with its headers,
pkg-config file and CMake package.")
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)

# Every install component but the wheel's, in one package. Rules without COMPONENT are in
# "Unspecified"; another helper's rules may add components (a -dev split would start here).
get_cmake_property(kvp_components COMPONENTS)
list(REMOVE_ITEM kvp_components python)
set(CPACK_COMPONENTS_ALL ${kvp_components})
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_GROUPING ALL_COMPONENTS_IN_ONE)

# Install with DESTDIR=<staging> and the real prefix (/usr), so that the rules that write
# absolute paths (/etc/kvpool/kvpoold.conf, deploy/CMakeLists.txt) land in the staging tree
# and not on the build machine.
set(CPACK_SET_DESTDIR ON)
set(CPACK_PACKAGING_INSTALL_PREFIX ${CMAKE_INSTALL_PREFIX})

set(CPACK_DEBIAN_PACKAGE_NAME kvpool)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT) # kvpool_<version>-1_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${CPACK_PACKAGE_CONTACT}")
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "${KVP_DEB_HOMEPAGE}")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# A shlibs file for libkvpool.so.N, so packages linking it get "kvpool (>= version)".
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
# systemd-sysusers and systemd-tmpfiles create the user and /run/kvpool; without them
# postinst falls back to useradd (a container without systemd still installs).
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "systemd")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# Debian ships stripped binaries (a -dbgsym package would keep the symbols).
set(CPACK_STRIP_FILES ON)

# Maintainer scripts and the conffile list, configured with the installed paths.
set(KVP_DEB_SYSCONFDIR ${CMAKE_INSTALL_FULL_SYSCONFDIR})
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(KVP_DEB_SYSCONFDIR /etc)
endif()
set(kvp_deb_dir ${CMAKE_BINARY_DIR}/deb-control)
foreach(f postinst prerm postrm)
  configure_file(${PROJECT_SOURCE_DIR}/deploy/debian/${f}.in ${kvp_deb_dir}/${f} @ONLY)
endforeach()
# dpkg's conffiles list: one absolute path a line, no comments. triggers: ldconfig runs once
# after dpkg has unpacked everything (what CPack's own postinst would do, which ours replaces).
file(WRITE ${kvp_deb_dir}/conffiles "${KVP_DEB_SYSCONFDIR}/kvpool/kvpoold.conf\n")
file(WRITE ${kvp_deb_dir}/triggers "activate-noawait ldconfig\n")
file(CHMOD ${kvp_deb_dir}/postinst ${kvp_deb_dir}/prerm ${kvp_deb_dir}/postrm
     PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ
                 WORLD_EXECUTE)
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${kvp_deb_dir}/postinst ${kvp_deb_dir}/prerm ${kvp_deb_dir}/postrm ${kvp_deb_dir}/conffiles
    ${kvp_deb_dir}/triggers)

include(CPack)
