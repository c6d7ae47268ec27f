#!/bin/bash
# Builds ShardTrain as on a cluster without Debian's packages (make test-portable-build; about
# 100 s on 2 cores): every library it links is copied into a prefix of its own, laid out as
# Spack or an environment module lays it out (<prefix>/include, <prefix>/lib); then, in a private
# mount namespace, Debian's copies of those headers and libraries and dpkg-query itself are hidden,
# and the program is built with DEPS left to its default, the prefixes given as HDF5_ROOT,
# OPENBLAS_ROOT and DEP_ROOTS. The binary must then train on 2 ranks with the originals still
# hidden: it finds its libraries through the rpath the build gave it. Open MPI stays Debian's (a
# cluster's comes from its module in the same way: MPICXX). Needs root (unshare, mount).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/shardtrain-portable.XXXXXX)}
JOBS=${JOBS:-2}
[ "$(id -u)" = 0 ] || { echo "portable_build: needs root (a private mount namespace)"; exit 2; }
P=$WORK/prefixes
LIBDIR=/usr/lib/x86_64-linux-gnu
rm -rf "$P" && mkdir -p "$P"

# copy_libs PREFIX NAME...: each library's files (the real file and its links) into PREFIX/lib.
copy_libs() {
  local prefix=$1; shift
  mkdir -p "$prefix/lib"
  for name in "$@"; do cp -a "$LIBDIR/$name".so* "$prefix/lib/"; done
}
mkdir -p "$P/hdf5/include" "$P/openblas/include" "$P/boost/include" "$P/onednn/include" "$P/pcre2/include" \
         "$P/utf8proc/include" "$P/json/include" "$P/png/include"
cp -a /usr/include/hdf5/openmpi/. "$P/hdf5/include/"
copy_libs "$P/hdf5" libhdf5_openmpi
ln -s libhdf5_openmpi.so "$P/hdf5/lib/libhdf5.so"
cp -a /usr/include/x86_64-linux-gnu/openblas-openmp/. "$P/openblas/include/"
mkdir -p "$P/openblas/lib" && cp -a "$LIBDIR"/openblas-openmp/libopenblas*.so* "$P/openblas/lib/"
cp -a /usr/include/boost "$P/boost/include/"
copy_libs "$P/boost" libboost_program_options
cp -a /usr/include/dnnl*.h /usr/include/dnnl*.hpp /usr/include/oneapi "$P/onednn/include/"
copy_libs "$P/onednn" libdnnl
cp -a /usr/include/pcre2.h "$P/pcre2/include/" && copy_libs "$P/pcre2" libpcre2-8
cp -a /usr/include/utf8proc.h "$P/utf8proc/include/" && copy_libs "$P/utf8proc" libutf8proc
cp -a /usr/include/nlohmann "$P/json/include/"
cp -aL /usr/include/libpng16/png.h /usr/include/libpng16/pngconf.h /usr/include/libpng16/pnglibconf.h "$P/png/include/"
copy_libs "$P/png" libpng16
echo "portable_build: prefixes in $P ($(du -sh "$P" | cut -f1))"

# Inside the namespace: hide the originals (folders under an empty tmpfs, files under /dev/null;
# PCRE2's library stays, mount and grep need it: ldd below shows the binary takes the prefix's),
# build, check where the libraries come from, train.
unshare -m --propagation private bash -euo pipefail -c '
  P=$1 ROOT=$2 WORK=$3 JOBS=$4 LIBDIR=/usr/lib/x86_64-linux-gnu
  for d in /usr/include/hdf5 $LIBDIR/hdf5 /usr/include/x86_64-linux-gnu/openblas-openmp $LIBDIR/openblas-openmp \
           /usr/include/boost /usr/include/oneapi /usr/include/nlohmann /usr/include/libpng16; do
    mount -t tmpfs none "$d"
  done
  for f in /usr/include/dnnl*.h /usr/include/dnnl*.hpp /usr/include/pcre2.h /usr/include/utf8proc.h \
           $LIBDIR/libhdf5_openmpi.so* $LIBDIR/libboost_program_options.so* $LIBDIR/libdnnl.so* \
           $LIBDIR/libutf8proc.so* $LIBDIR/libpng16.so* /usr/bin/dpkg-query; do
    [ -e "$f" ] && [ ! -L "$f" ] && mount --bind /dev/null "$f"
  done
  ! dpkg-query -W dpkg >/dev/null 2>&1 || { echo "portable_build: dpkg-query still works"; exit 1; }
  cd "$ROOT"
  make --no-print-directory -j"$JOBS" BUILD="$WORK/build" HDF5_ROOT="$P/hdf5" OPENBLAS_ROOT="$P/openblas" \
       DEP_ROOTS="$P/boost $P/onednn $P/pcre2 $P/utf8proc $P/json $P/png" "$WORK/build/shardtrain" | grep -v "^  CXX"
  exe=$WORK/build/shardtrain
  for lib in libhdf5_openmpi libopenblas libboost_program_options libdnnl libpcre2-8 libutf8proc libpng16; do
    where=$(ldd "$exe" | awk -v l="$lib" "index(\$1, l) == 1 {print \$3}")
    case "$where" in "$P"/*) ;; *) echo "portable_build: $lib resolves to \"$where\", not under $P"; exit 1;; esac
  done
  "$exe" --version
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  "$exe" data synth --out-dir "$WORK/data" --train-bytes 65536 --val-bytes 8192 >/dev/null
  mpirun --oversubscribe --bind-to none -np 2 "$exe" train --config inputs/tiny.ini --train.steps=3 \
      --data.train_file="$WORK/data/synth_train.bin" --data.val_file="$WORK/data/synth_val.bin" \
      --checkpoint.dir="$WORK/ckpt" --train.peak_gflops=100 | tail -2
  test -s "$WORK/ckpt/ckpt-00000003.h5"
' portable "$P" "$ROOT" "$WORK" "$JOBS"
echo "portable_build: passed (DEPS=none, every library from its prefix; $WORK)"
