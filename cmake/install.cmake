# Installing ckptfs like a system tool (included by CMakeLists.txt):
#
#   cmake --install build --prefix P     a relocatable tree under P
#   cd build && cpack -G DEB             ckptfs_<version>_<arch>.deb (prefix /usr)
#
# P/bin              ckptfs, ckptctl, ckptfs-fsck and the executable scripts
#                    of mount-scripts/ (ckpt-mount, ckpt-umount, ...) but the
#                    Slurm examples
# P/lib/ckptfs       the libfuse3 built into .deps/fuse3, when the build uses
#                    it: private to ckptfs (outside the linker's search path,
#                    so no other program picks it up), found through
#                    ckptfs's RUNPATH $ORIGIN/../lib/ckptfs
# P/lib/systemd/system/ckptfs@.service   its ExecStart naming P/bin/ckptfs
# P/share/ckptfs/slurm                   the Slurm prolog and epilog, beside a
#                    link to ../../../bin/ckpt-umount, which the epilog runs
# P/share/doc/ckptfs README.md and docs/
#
# Build-tree binaries keep their build RUNPATH (.deps/fuse3/lib).
include(GNUInstallDirs)
set(CKPT_PRIVATE_LIBDIR lib/ckptfs CACHE STRING
    "Where the bundled libfuse3 is installed, relative to the prefix")

# ---- the programs, and the libfuse they were linked with ---------------------
install(TARGETS ckptfs ckptctl ckptfs-fsck RUNTIME DESTINATION bin)
if(_ckpt_fuse3_from STREQUAL CKPT_LOCAL_FUSE3_PKGDIR)
  # The library file and its soname link (libfuse3.so.3.17.2, libfuse3.so.4;
  # the link installs as a link), not the development link libfuse3.so.
  get_filename_component(_ckpt_fuse3_dir ${CKPT_LOCAL_FUSE3_PKGDIR} DIRECTORY)
  file(GLOB _ckpt_fuse3_libs ${_ckpt_fuse3_dir}/libfuse3.so.*)
  install(FILES ${_ckpt_fuse3_libs} DESTINATION ${CKPT_PRIVATE_LIBDIR})
  set_target_properties(ckptfs PROPERTIES
                        INSTALL_RPATH "\$ORIGIN/../${CKPT_PRIVATE_LIBDIR}")
  message(STATUS "ckptfs: install: the libfuse3 of .deps/fuse3 goes into "
          "PREFIX/${CKPT_PRIVATE_LIBDIR}")
endif()

# ---- mount-scripts/ ----------------------------------------------------------
# Every executable file there goes to bin (a script added later is picked up
# when CMake runs again, which the glob's CONFIGURE_DEPENDS makes the build
# do), but the Slurm examples (share/ckptfs/slurm) and the systemd unit.
file(GLOB _ckpt_scripts CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/mount-scripts/*)
foreach(f ${_ckpt_scripts})
  get_filename_component(name ${f} NAME)
  execute_process(COMMAND test -x ${f} RESULT_VARIABLE not_exec)
  if(IS_DIRECTORY ${f} OR not_exec)
    continue()
  elseif(name MATCHES "^slurm-")
    install(PROGRAMS ${f} DESTINATION ${CMAKE_INSTALL_DATADIR}/ckptfs/slurm)
  else()
    install(PROGRAMS ${f} DESTINATION bin)
  endif()
endforeach()
# The epilog runs ckpt-umount from its own directory (CKPT_SCRIPTS unless
# set): a relative link keeps the tree relocatable.
install(CODE "
  set(d \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_DATADIR}/ckptfs/slurm\")
  file(MAKE_DIRECTORY \"\${d}\")
  file(CREATE_LINK ../../../bin/ckpt-umount \"\${d}/ckpt-umount\" SYMBOLIC)
  message(STATUS \"Installing: \${d}/ckpt-umount -> ../../../bin/ckpt-umount\")")

# The systemd unit names its binary by absolute path: the prefix installed
# into (known at install time only: --prefix, or /usr for the package).
install(CODE "
  file(READ \"${CMAKE_SOURCE_DIR}/mount-scripts/ckptfs@.service\" unit)
  string(REPLACE \"ExecStart=/usr/local/bin/\" \"ExecStart=\${CMAKE_INSTALL_PREFIX}/bin/\"
         unit \"\${unit}\")
  string(REPLACE \"file:/usr/local/share/doc/\" \"file:\${CMAKE_INSTALL_PREFIX}/share/doc/\"
         unit \"\${unit}\")
  set(d \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/lib/systemd/system\")
  file(WRITE \"\${d}/ckptfs@.service\" \"\${unit}\")
  message(STATUS \"Installing: \${d}/ckptfs@.service\")")

# ---- documentation -----------------------------------------------------------
install(FILES ${CMAKE_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${CMAKE_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}
        FILES_MATCHING PATTERN "*.md")

# ---- the Debian package ------------------------------------------------------
# Depends: the shared libraries' packages, from dpkg-shlibdeps (libc6,
# libsqlite3-0, libxxhash0, libopenmpi3 or libopenmpi40, and libfuse3-3 or
# libfuse3-4 when the system's libfuse3 is used; a bundled one is found in
# the package through the RUNPATH), plus the programs ckptfs and the
# scripts run: fusermount3 and mount.fuse3 (fuse3), mpirun (openmpi-bin),
# ps (procps).
set(CPACK_PACKAGE_NAME ckptfs)
set(CPACK_PACKAGE_VENDOR ckptfs)
set(CPACK_PACKAGE_CONTACT "ckptfs maintainers <ckptfs@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "FUSE checkpoint filesystem for distributed training")
set(CPACK_PACKAGE_DESCRIPTION "ckptfs stores the checkpoints that training jobs write into per-rank
FUSE mounts, committed atomically across ranks. This package holds the
daemon (ckptfs), ckptctl, ckptfs-fsck and the mount scripts.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_GENERATOR DEB)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION admin)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# attr: getfattr, with which ckpt-rank-exec reads the mount's rank and world
set(CPACK_DEBIAN_PACKAGE_DEPENDS "fuse3, openmpi-bin, procps, attr")
include(CPack)
