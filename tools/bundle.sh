#!/usr/bin/env bash
# tools/bundle.sh — packs a built ShardTrain into one relocatable folder for a machine that has the
# NVIDIA driver and the CUDA 13 / cuDNN / NCCL libraries but none of our Debian packages.
#
#   bash tools/bundle.sh [--build DIR] [--out DIR] [--without NAME,...]
#     --build DIR      default: build-cuda if build-cuda/shardtrain exists, else build
#     --out DIR        default: bundle (ignored by git; it travels with the working tree)
#     --without NAMES  leave out these programs of DIR (e.g. unit_tests,mpi_tests) to save space
#
# What goes in: DIR/shardtrain and whichever of DIR/gpu_tests, DIR/*_bench, DIR/unit_tests and
# DIR/mpi_tests exist; every shared library that they, Open MPI's programs and the kept plugins
# need (names from DT_NEEDED, paths from ldd); Open MPI's mpirun, orted and ompi_info, its MCA
# plugins (pruned to the single-node path), help texts and configuration; PMIx's plugins and help
# texts. Every ELF file is stripped (strip --strip-unneeded on the copy), and OpenBLAS travels
# gzipped (35 MiB -> 10 MiB).
# What stays out: glibc (the target's own; OUT/GLIBC_REQUIRED is the version we need), the
# CUDA/NVIDIA libraries (they must match the target's driver; OUT/CUDA_REQUIRED lists them), and
# the plugins for network stacks (UCX, libfabric, verbs, PSM), resource managers (Slurm, Flux, LSF),
# OpenSHMEM and monitoring. libcurl and libcrypto, which HDF5 needs only for its S3 driver (ROS3),
# are replaced by generated stubs that abort with a message if called: with their dependencies
# (ssl, gnutls, krb5, ldap, ssh2, ...) they would take 16 MB, a quarter of the budget.
# It is not an installer: the target runs `source OUT/env.sh`, which checks glibc, then sets PATH,
# LD_LIBRARY_PATH and the OPAL_*/PMIX_* variables that relocate Open MPI and PMIx into OUT.
#
# Layout of OUT (Open MPI's own layout relative to a prefix, so that OPAL_* can relocate it):
#   bin/             our programs; mpirun (a copy of orterun), orted, ompi_info
#   lib/             shared libraries, one file per soname; those over 8 MiB (OpenBLAS, oneDNN) as
#                    NAME.gz, unpacked by env.sh on first use (lib/UNPACK lists them with their sizes,
#                    as paths in the bundle); so are our programs over 4 MiB (bin/NAME.gz)
#   lib/openmpi/     Open MPI MCA plugins (OPAL_PKGLIBDIR)
#   lib/pmix/        PMIx plugins (PMIX_MCA_mca_base_component_path)
#   share/openmpi/   Open MPI help texts (OPAL_PKGDATADIR);  share/pmix/  PMIx's (PMIX_PKGDATADIR)
#   etc/             openmpi-mca-params.conf, openmpi-default-hostfile, pmix-mca-params.conf
#   env.sh  GLIBC_REQUIRED  CUDA_REQUIRED  COMMIT (the tree's commit)  MANIFEST (every file and where it came from)
# Exit status: 0 bundle written and checked; 1 a library is missing, a check failed or the bundle
# is over budget; 2 usage error.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUDGET_MIB=60      # the carried tree may hold 64 MiB; the rest is margin
MARKER=.shardtrain-bundle

die()  { echo "bundle.sh: $*" >&2; exit 1; }
usage_error() {
  echo "bundle.sh: $*" >&2
  echo "usage: bash tools/bundle.sh [--build DIR] [--out DIR] [--without NAME,...]" >&2
  exit 2
}

build="" out="" without=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build)   [ $# -ge 2 ] || usage_error "--build needs a folder";   build=$2;   shift 2 ;;
    --out)     [ $# -ge 2 ] || usage_error "--out needs a folder";     out=$2;     shift 2 ;;
    --without) [ $# -ge 2 ] || usage_error "--without needs names";    without=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
cd "$ROOT"
if [ -z "$build" ]; then
  if [ -x build-cuda/shardtrain ]; then build="build-cuda"; else build="build"; fi
fi
out=${out:-bundle}
[ -x "$build/shardtrain" ] || usage_error "$build/shardtrain not found: run 'make' (or 'make CUDA=1') first"
[[ ",$without," != *,shardtrain,* ]] || usage_error "--without cannot leave out shardtrain"
for tool in ldd readelf strip gzip ompi_info mpirun cc; do
  command -v "$tool" >/dev/null || die "'$tool' is missing (apt-get install binutils gcc openmpi-bin)"
done

# Refuse to wipe a folder that is not an earlier bundle: a mistyped --out must not delete work.
if [ -e "$out" ]; then
  [ -d "$out" ] || usage_error "--out $out exists and is not a folder"
  if [ -n "$(ls -A "$out")" ] && [ ! -e "$out/$MARKER" ]; then
    usage_error "--out $out is not empty and is not a bundle; choose another folder"
  fi
  rm -rf "$out"
fi
mkdir -p "$out"/{bin,lib/openmpi,lib/pmix,share/openmpi,share/pmix,etc}
out=$(cd "$out" && pwd)
touch "$out/$MARKER"
start=$(date +%s.%N)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ---- what the target provides, and what we leave out ------------------------------------------
# glibc's own libraries: they must be the target's, matching its loader.
is_glibc() {
  case "$1" in
    ld-linux*|linux-vdso*|libc.so.*|libm.so.*|libmvec.so.*|libdl.so.*|libpthread.so.*|librt.so.*|\
    libresolv.so.*|libutil.so.*|libanl.so.*|libnsl.so.*|libBrokenLocale.so.*|libnss_*|\
    libthread_db.so.*|libc_malloc_debug.so.*) return 0 ;;
  esac
  return 1
}
# CUDA/NVIDIA libraries: they must match the target's driver, and the target has them.
is_cuda() {
  case "$1" in
    libcuda.so*|libcudart.so*|libcublas*|libcudnn*|libnccl*|libnvrtc*|libnvJitLink*|libnvidia-*|\
    libcufft*|libcurand*|libcusparse*|libcusolver*|libnvToolsExt*|libcupti*|libnvperf*|\
    libnvfatbin*) return 0 ;;
  esac
  return 1
}
# Replaced by generated stubs (see the header): their only user is HDF5's S3 driver.
STUBS=" libcurl.so.4 libcrypto.so.3 "
is_stub() { [[ "$STUBS" == *" $1 "* ]]; }

# Open MPI plugins that the single-node path does not use. Everything else is kept; in particular
# MPI-IO (io, fs, fbtl, fcoll, sharedfp), which parallel HDF5 writes checkpoints through.
drop_plugin() {
  case "$1" in
    *_ucx|*_ofi|*_openib|*_psm|*_psm2) return 0 ;;             # network stacks (libs not bundled)
    *_slurm|*_flux|*_jsm|*_gridengine|*_lsf|*_tm) return 0 ;;   # resource managers: launch is local
    *_monitoring) return 0 ;;                                   # profiling interposers
    atomic_*|memheap_*|scoll_*|spml_*|sshmem_*) return 0 ;;     # OpenSHMEM (liboshmem) only
    reachable_netlink) return 0 ;;                              # needs libnl; 'weighted' stays
  esac
  return 1
}

# ---- Open MPI and PMIx locations: ask the installation -------------------------------------------
ompi_paths=$(ompi_info --path all --parsable)
ompi_path() { sed -n "s/^path:$1://p" <<<"$ompi_paths" | head -1; }
OMPI_PKGLIBDIR=$(ompi_path pkglibdir)
OMPI_PKGDATADIR=$(ompi_path pkgdatadir)
OMPI_SYSCONFDIR=$(ompi_path sysconfdir)
OMPI_BINDIR=$(ompi_path bindir)
OMPI_VERSION=$(ompi_info --version 2>/dev/null | sed -n "1s/^Open MPI v//p")
[ -d "$OMPI_PKGLIBDIR" ] || die "Open MPI plugin folder '$OMPI_PKGLIBDIR' (ompi_info --path pkglibdir) not found"
MPIRUN_SRC=$(readlink -f "$(command -v mpirun)")
[ "$(dirname "$MPIRUN_SRC")" = "$OMPI_BINDIR" ] \
  || die "mpirun in PATH ($MPIRUN_SRC) does not belong to the Open MPI of ompi_info ($OMPI_BINDIR)"
OMPI_INFO_SRC=$(readlink -f "$(command -v ompi_info)")

# ---- programs and plugins -----------------------------------------------------------------------
printf '# ShardTrain bundle from %s (%s), Open MPI %s, made %s on %s\n# file\tsource\n' \
  "$build" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" "${OMPI_VERSION:-?}" \
  "$(date -u +%Y-%m-%dT%H:%MZ)" "$(hostname)" > "$out/MANIFEST"
manifest() { printf '%s\t%s\n' "${1#"$out"/}" "$2" >> "$out/MANIFEST"; }
copy_stripped() {  # SRC DEST
  cp -L "$1" "$2"
  chmod u+w "$2"
  strip --strip-unneeded "$2"
  manifest "$2" "$1"
}

programs=("$build/shardtrain")
for f in "$build/gpu_tests" "$build/unit_tests" "$build/mpi_tests" "$build"/*_bench; do
  [ -f "$f" ] && [ -x "$f" ] || continue
  [[ ",$without," == *",$(basename "$f"),"* ]] && continue
  programs+=("$f")
done
for f in "${programs[@]}"; do copy_stripped "$f" "$out/bin/$(basename "$f")"; done
copy_stripped "$MPIRUN_SRC" "$out/bin/mpirun"
copy_stripped "$OMPI_BINDIR/orted" "$out/bin/orted"
copy_stripped "$OMPI_INFO_SRC" "$out/bin/ompi_info"

kept=() dropped=()
for f in "$OMPI_PKGLIBDIR"/mca_*.so; do
  name=$(basename "$f" .so); name=${name#mca_}
  if drop_plugin "$name"; then dropped+=("$name"); continue; fi
  kept+=("$f")
  copy_stripped "$f" "$out/lib/openmpi/$(basename "$f")"
done

# PMIx: Debian's Open MPI uses the external libpmix.so.2, whose plugin folder sits beside it
# (.../pmix2/lib/pmix) and whose help texts sit in .../pmix2/share/pmix.
pmix_plugins=() pmix_share=""
pmix_lib=$(env -u LD_LIBRARY_PATH ldd "$OMPI_PKGLIBDIR"/mca_pmix_*.so 2>/dev/null \
           | awk '$1 == "libpmix.so.2" {print $3; exit}')
if [ -n "$pmix_lib" ]; then
  pmix_libdir=$(dirname "$(readlink -f "$pmix_lib")")
  pmix_share=$(dirname "$pmix_libdir")/share/pmix
  for f in "$pmix_libdir"/pmix/*.so; do
    [ -e "$f" ] || continue
    case "$(basename "$f")" in *_slurm.so) continue ;; esac
    pmix_plugins+=("$f")
    copy_stripped "$f" "$out/lib/pmix/$(basename "$f")"
  done
fi

# ---- shared libraries: follow DT_NEEDED from every bundled ELF file -------------------------------
# The walk follows DT_NEEDED, so nothing reachable only through glibc, CUDA or a stub gets in; ldd
# of the file that needs a library tells where the system's search rules find it.
declare -A where=() seen=() cuda_needed=() stub_users=()
elf_needed() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
learn_paths() {  # FILE: record soname -> path for everything ldd resolves for FILE
  local name arrow path
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] && [ "$path" != not ] && [ -z "${where[$name]:-}" ] && where[$name]=$path
  done < <(env -u LD_LIBRARY_PATH ldd "$1" 2>/dev/null)
  return 0
}
walk() {  # FILE (original path)
  local dep
  for dep in $(elf_needed "$1"); do
    if is_stub "$dep"; then stub_users[$dep]+=" $1"; continue; fi
    [ -z "${seen[$dep]:-}" ] || continue
    seen[$dep]=1
    if is_glibc "$dep"; then continue; fi
    if is_cuda "$dep"; then cuda_needed[$dep]=1; continue; fi
    [ -n "${where[$dep]:-}" ] || learn_paths "$1"
    [ -n "${where[$dep]:-}" ] || die "$1 needs $dep, which ldd cannot find here"
    copy_stripped "${where[$dep]}" "$out/lib/$dep"
    walk "${where[$dep]}"
  done
}
roots=("${programs[@]}" "$MPIRUN_SRC" "$OMPI_BINDIR/orted" "$OMPI_INFO_SRC" "${kept[@]}" "${pmix_plugins[@]}")
for f in "${roots[@]}"; do walk "$f"; done

# ---- stubs for libcurl / libcrypto ---------------------------------------------------------------
# Each stub defines, under the right symbol version, every function that a bundled file imports
# from it; calling one prints what is missing and aborts.
for stub in "${!stub_users[@]}"; do
  src=$work/$stub.c map=$work/$stub.map list=$work/$stub.syms
  : > "$list"
  for f in ${stub_users[$stub]}; do
    # The version names this file needs from the library (readelf -V, .gnu.version_r) ...
    vers=$(readelf -V -W "$f" | awk -v lib="$stub" '/File:/ {on = ($5 == lib)} on && /Name:/ {print $3}')
    [ -n "$vers" ] || die "$f imports unversioned symbols from $stub; cannot tell which to stub"
    # ... and the undefined symbols bound to those versions.
    readelf --dyn-syms -W "$f" | awk -v vers=" $(tr '\n' ' ' <<<"$vers")" '
      $7 == "UND" && index($8, "@") {
        n = index($8, "@"); sym = substr($8, 1, n - 1); ver = substr($8, n + 1); sub(/^@/, "", ver)
        if (index(vers, " " ver " ")) print ver, $4, sym
      }' >> "$list"
  done
  awk '$2 != "FUNC" {bad = bad " " $3} END {if (bad != "") {print "data symbols:" bad; exit 1}}' "$list" \
    || die "cannot stub $stub: a bundled file imports data from it"
  {
    printf '#include <stdio.h>\n#include <stdlib.h>\n'
    printf 'static void stub_fail(const char *f) {\n'
    printf '  fprintf(stderr, "shardtrain bundle: %%s() called, but %s is a stub (HDF5 S3 access is not bundled)\\n", f);\n' "$stub"
    printf '  abort();\n}\n'
    sort -u -k3 "$list" | awk '{printf "void %s(void) { stub_fail(\"%s\"); }\n", $3, $3}'
  } > "$src"
  sort -u "$list" | awk '{syms[$1] = syms[$1] " " $3 ";"} END {for (v in syms) printf "%s { global:%s local: *; };\n", v, syms[v]}' > "$map"
  cc -shared -fPIC -O2 -Wl,-soname,"$stub" -Wl,--version-script="$map" -o "$out/lib/$stub" "$src"
  strip --strip-unneeded "$out/lib/$stub"
  manifest "$out/lib/$stub" "stub generated by tools/bundle.sh: $(awk '{print $3}' "$list" | sort -u | tr '\n' ' ')"
done

# ---- Open MPI and PMIx data -----------------------------------------------------------------------
cp "$OMPI_PKGDATADIR"/help-*.txt "$out/share/openmpi/"
[ ! -d "$OMPI_PKGDATADIR/amca-param-sets" ] || cp -r "$OMPI_PKGDATADIR/amca-param-sets" "$out/share/openmpi/"
manifest "share/openmpi/" "$OMPI_PKGDATADIR (help texts)"
for f in openmpi-mca-params.conf openmpi-default-hostfile; do
  [ -f "$OMPI_SYSCONFDIR/$f" ] || continue
  cp "$OMPI_SYSCONFDIR/$f" "$out/etc/$f"
  manifest "$out/etc/$f" "$OMPI_SYSCONFDIR/$f"
done
cat >> "$out/etc/openmpi-mca-params.conf" <<'EOF'

# ---- added by tools/bundle.sh (an OMPI_MCA_<name> variable overrides each line) ----
# The bundle launches on this node only. The default launcher (rsh) aborts mpirun when the
# machine has no ssh or rsh program, as many containers do, even for a local run.
plm = isolated
# Containers often forbid the cross-memory attach (process_vm_readv) that vader uses for large
# messages; copy through shared memory instead. A GPU run moves its bulk data with NCCL.
btl_vader_single_copy_mechanism = none
EOF
if [ -n "$pmix_share" ] && [ -d "$pmix_share" ]; then
  cp "$pmix_share"/help-*.txt "$out/share/pmix/"
  manifest "share/pmix/" "$pmix_share (help texts)"
fi
# Debian's pmix-mca-params.conf names the plugin folder with an absolute path; env.sh sets it.
printf '# Written by tools/bundle.sh: env.sh sets PMIX_MCA_mca_base_component_path to lib/pmix.\n' \
  > "$out/etc/pmix-mca-params.conf"

# ---- requirements on the target -----------------------------------------------------------------
# The highest GLIBC_x.y that any bundled file needs (GLIBC_ABI_DT_RELR means 2.36).
find "$out/bin" "$out/lib" -type f | while read -r f; do
  readelf -V -W "$f" 2>/dev/null | grep -o 'Name: GLIBC_[0-9][0-9.]*\|GLIBC_ABI_DT_RELR' \
    | sed 's/^Name: GLIBC_//; s/^GLIBC_ABI_DT_RELR$/2.36/' | sed "s|\$| ${f#"$out"/}|" || true
done | sort -V -k1,1 | tail -1 > "$work/glibc"
read -r glibc_full glibc_file < "$work/glibc" || die "no GLIBC symbol versions found in the bundle"
glibc_need=$(awk -F. '{print $1 "." $2}' <<<"$glibc_full")
echo "$glibc_need" > "$out/GLIBC_REQUIRED"
printf '%s\n' "${!cuda_needed[@]}" | grep . | sort > "$out/CUDA_REQUIRED" || true
# The commit the programs were built from (a copy of the tree elsewhere may carry another .git).
(cd "$ROOT" && echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')") > "$out/COMMIT"

# ---- env.sh ---------------------------------------------------------------------------------------
cat > "$out/env.sh" <<'ENV_SH'
# env.sh — written by tools/bundle.sh. On the machine that runs the bundle: `source bundle/env.sh`
# (bash). It first checks that this machine's glibc is at least GLIBC_REQUIRED; if not, it prints
# one line, changes nothing and returns 1. Then it puts bin/ first on PATH, lib/ first on
# LD_LIBRARY_PATH followed by the CUDA library folders it finds ($CUDA_HOME, /usr/local/cuda,
# Python's site-packages/nvidia/*/lib), points Open MPI (OPAL_*) and PMIx (PMIX_*) at their
# relocated files, and allows mpirun as root. `bash bundle/env.sh` only runs the checks: status 1
# when glibc is too old or a CUDA library the programs link is missing (no driver: a warning).
# SHARDTRAIN_BUNDLE_QUIET=1 silences the summary; warnings still print.
if [ -z "${BASH_VERSION:-}" ]; then
  echo "shardtrain bundle: env.sh needs bash (run: bash, then source it)" >&2
  return 1 2>/dev/null || exit 1
fi
_shardtrain_bundle_env() {
  local B need have quiet=${SHARDTRAIN_BUNDLE_QUIET:-0} d sp lib found missing="" no_driver="" cuda_dirs="" ldp
  B=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P) || return 1

  # -- glibc: the bundle's libraries use symbol versions up to GLIBC_REQUIRED.
  need=$(cat "$B/GLIBC_REQUIRED" 2>/dev/null) || { echo "shardtrain bundle: $B/GLIBC_REQUIRED is missing; rebuild the bundle" >&2; return 1; }
  if [ "$(uname -m)" != x86_64 ]; then
    echo "shardtrain bundle: this machine is $(uname -m); the bundle is for x86_64" >&2; return 1
  fi
  have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}') || have=""
  [ -n "$have" ] || have=$(ldd --version 2>/dev/null | awk 'NR == 1 {print $NF}') || have=""
  if ! [[ "$have" =~ ^[0-9]+\.[0-9]+ ]]; then
    echo "shardtrain bundle: cannot find this machine's glibc version (musl?); the bundle needs glibc >= $need" >&2
    return 1
  fi
  local h1=${have%%.*} h2=${have#*.} n1=${need%%.*} n2=${need#*.}
  h2=${h2%%.*} n2=${n2%%.*}
  if (( 10#$h1 < 10#$n1 || (10#$h1 == 10#$n1 && 10#$h2 < 10#$n2) )); then
    echo "shardtrain bundle: this machine has glibc $have, older than the $need the bundle needs (built on Debian 12, glibc 2.36); use a newer image or build on an older distribution" >&2
    return 1
  fi

  # -- files that travel gzipped (lib/UNPACK: path in the bundle and size): unpack once, atomically;
  # programs (bin/) executable again.
  local name size tmp
  while read -r name size; do
    [ -n "$name" ] || continue
    ! [ -f "$B/$name" ] || [ "$(wc -c < "$B/$name")" != "$size" ] || continue
    tmp="$B/$name.$$.tmp"
    if { gzip -dc "$B/$name.gz" 2>/dev/null \
         || python3 -c 'import gzip, shutil, sys; shutil.copyfileobj(gzip.open(sys.argv[1]), sys.stdout.buffer)' \
                    "$B/$name.gz" 2>/dev/null; } > "$tmp" && [ "$(wc -c < "$tmp")" = "$size" ]; then
      case "$name" in bin/*) chmod +x "$tmp" ;; esac
      mv -f "$tmp" "$B/$name"
    else
      rm -f "$tmp"
      echo "shardtrain bundle: cannot unpack $B/$name.gz (needs gzip or python3, and a writable bundle folder)" >&2
      return 1
    fi
  done < <(cat "$B/lib/UNPACK" 2>/dev/null)

  # -- CUDA library folders, in order of preference; only folders that hold libraries.
  _shardtrain_add_dir() {
    [ -d "$1" ] || return 0
    compgen -G "$1/lib*.so*" >/dev/null || return 0
    local r; r=$(cd "$1" && pwd -P) || return 0
    case ":$cuda_dirs:" in *":$r:"*) ;; *) cuda_dirs=${cuda_dirs:+$cuda_dirs:}$r ;; esac
  }
  # cuDNN's archive installs into lib/ (libcudnn.so.9 and the engine libraries it loads at run time).
  for d in ${CUDA_HOME:+"$CUDA_HOME/lib64" "$CUDA_HOME/lib"} ${CUDA_PATH:+"$CUDA_PATH/lib64"} \
           /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    _shardtrain_add_dir "$d"
  done
  # Python wheels (nvidia-cudnn-cu13, nvidia-nccl-cu13, ...) put libraries in site-packages/nvidia/*/lib.
  while IFS= read -r sp; do
    [ -n "$sp" ] && [ -d "$sp/nvidia" ] || continue
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/*/lib64; do _shardtrain_add_dir "$d"; done
  done < <(
    if command -v python3 >/dev/null 2>&1; then
      python3 - 2>/dev/null <<'PY' || true
import site, sys
paths = list(sys.path)
for f in (site.getsitepackages, lambda: [site.getusersitepackages()]):
    try:
        paths += f()
    except Exception:
        pass
print("\n".join(paths))
PY
    fi
    compgen -G "${VIRTUAL_ENV:-/nonexistent}/lib/python3*/site-packages" || true
    compgen -G "${CONDA_PREFIX:-/nonexistent}/lib/python3*/site-packages" || true
    compgen -G "/usr/local/lib/python3*/*-packages" || true
    compgen -G "/usr/lib/python3*/*-packages" || true
    compgen -G "/opt/conda/lib/python3*/site-packages" || true
    compgen -G "${HOME:-/nonexistent}/.local/lib/python3*/site-packages" || true
  )
  unset -f _shardtrain_add_dir

  # -- the CUDA libraries the programs were linked against: report where each one comes from.
  local sys_libs
  sys_libs=$( { ldconfig -p || /sbin/ldconfig -p || /usr/sbin/ldconfig -p; } 2>/dev/null | awk '{print $1}') || sys_libs=""
  local report=""
  for lib in $(cat "$B/CUDA_REQUIRED" 2>/dev/null) libcuda.so.1; do
    [ "$lib" != libcuda.so.1 ] || [ -s "$B/CUDA_REQUIRED" ] || continue
    found=""
    local IFS_save=$IFS; IFS=:
    for d in $cuda_dirs; do [ -e "$d/$lib" ] && { found=$d; break; }; done
    IFS=$IFS_save
    if [ -z "$found" ]; then
      if grep -qxF "$lib" <<<"$sys_libs"; then found=system
      else
        for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /lib64 /usr/lib/wsl/lib; do
          [ -e "$d/$lib" ] && { found=$d; break; }
        done
      fi
    fi
    if [ -n "$found" ]; then report="$report $lib:$found"
    elif [ "$lib" = libcuda.so.1 ]; then no_driver=1
    else missing="$missing $lib"; fi
  done
  if [ -n "$missing" ]; then
    echo "shardtrain bundle: warning: not found on this machine:$missing; the programs will not start (set CUDA_HOME, or install the nvidia-*-cu13 Python wheels)" >&2
  fi
  if [ -n "$no_driver" ]; then
    echo "shardtrain bundle: warning: no NVIDIA driver library (libcuda.so.1) on this machine: the programs start but see no GPU" >&2
  fi

  # -- executed rather than sourced: the checks are all we do.
  if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "shardtrain bundle: glibc $have >= $need ok; CUDA library folders: ${cuda_dirs:-none}"
    [ -z "$report" ] || echo "shardtrain bundle: CUDA libraries:$report"
    echo "shardtrain bundle: to use it, run: source $B/env.sh"
    [ -z "$missing" ]; return
  fi

  # -- the environment.
  ldp=""
  local IFS_save=$IFS; IFS=:
  for d in ${LD_LIBRARY_PATH:-}; do   # keep the caller's folders, without ours (sourcing twice)
    case ":$B/lib:$cuda_dirs:" in *":$d:"*) ;; *) [ -z "$d" ] || ldp=${ldp:+$ldp:}$d ;; esac
  done
  IFS=$IFS_save
  export LD_LIBRARY_PATH="$B/lib${cuda_dirs:+:$cuda_dirs}${ldp:+:$ldp}"
  case ":$PATH:" in *":$B/bin:"*) ;; *) export PATH="$B/bin:$PATH" ;; esac
  # Open MPI 4.1 relocation: each OPAL_* overrides one configured folder (Debian's sysconfdir,
  # /etc/openmpi, lies outside its prefix, so OPAL_PREFIX alone would not move it).
  export OPAL_PREFIX="$B" OPAL_EXEC_PREFIX="$B" OPAL_BINDIR="$B/bin" OPAL_LIBDIR="$B/lib" \
         OPAL_PKGLIBDIR="$B/lib/openmpi" OPAL_DATAROOTDIR="$B/share" OPAL_DATADIR="$B/share" \
         OPAL_PKGDATADIR="$B/share/openmpi" OPAL_SYSCONFDIR="$B/etc"
  # PMIx (libpmix.so.2) has its own folders; its configuration file would name Debian's plugin path.
  export PMIX_PREFIX="$B" PMIX_LIBDIR="$B/lib" PMIX_PKGLIBDIR="$B/lib/pmix" \
         PMIX_DATADIR="$B/share" PMIX_PKGDATADIR="$B/share/pmix" PMIX_SYSCONFDIR="$B/etc" \
         PMIX_MCA_mca_base_component_path="$B/lib/pmix"
  # hwloc: load no plugins (a different hwloc's plugins in /usr/lib would not match ours).
  export HWLOC_PLUGINS_PATH="$B/lib/hwloc"
  if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  export SHARDTRAIN_BUNDLE="$B"
  if [ "$quiet" != 1 ]; then
    echo "shardtrain bundle: $B (glibc $have >= $need ok); CUDA library folders: ${cuda_dirs:-none}"
  fi
  return 0
}
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  _shardtrain_bundle_env; _shardtrain_status=$?; unset -f _shardtrain_bundle_env; exit $_shardtrain_status
fi
_shardtrain_bundle_env
_shardtrain_status=$?
unset -f _shardtrain_bundle_env
return $_shardtrain_status 2>/dev/null || true
ENV_SH

# ---- self-check: every bundled ELF file finds its libraries inside the bundle ------------------
# With LD_LIBRARY_PATH=lib (env.sh), a DT_NEEDED name resolves inside the bundle when lib/ holds
# it; only DT_RPATH (searched before LD_LIBRARY_PATH, unlike RUNPATH) could send it elsewhere.
problems=""
while read -r f; do
  dynamic=$(readelf -d "$f" 2>/dev/null) || continue
  for dep in $(sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' <<<"$dynamic"); do
    is_glibc "$dep" || is_cuda "$dep" || [ -f "$out/lib/$dep" ] || problems="$problems\n  ${f#"$out"/} needs $dep"
  done
  ! grep -q '(RPATH)' <<<"$dynamic" || problems="$problems\n  ${f#"$out"/} has DT_RPATH"
done < <(find "$out/bin" "$out/lib" -type f -not -name '*.txt')
[ -z "$problems" ] || die "the bundle is not self-contained:$(printf '%b' "$problems")"

ours=() for_ours=""
for f in "${programs[@]}"; do ours+=("$out/bin/$(basename "$f")"); for_ours="$for_ours $(basename "$f")"; done

# ---- large files travel gzipped -------------------------------------------------------------------
# OpenBLAS (a DYNAMIC_ARCH build with kernels for every x86-64 generation) alone is 35 MiB; gzipped
# it is 10 MiB. Our programs over 4 MiB go the same way (gpu_tests 9 MiB -> 3): the device tool
# carries the tree and the bundle together within 64 MiB. env.sh unpacks PATH.gz to PATH once (it
# checks the size in lib/UNPACK).
: > "$out/lib/UNPACK"
packed=""
while read -r f; do
  size=$(stat -c %s "$f")
  case "$f" in "$out"/bin/*) (( size > 4 * 1048576 )) || continue ;; *) (( size > 8 * 1048576 )) || continue ;; esac
  gzip -6 -n "$f"
  printf '%s %s\n' "${f#"$out"/}" "$size" >> "$out/lib/UNPACK"
  packed="$packed ${f#"$out"/} $(awk -v a="$size" -v b="$(stat -c %s "$f.gz")" 'BEGIN {printf "%.1f -> %.1f MiB", a / 1048576, b / 1048576}')"
done < <(find "$out/lib" -maxdepth 1 -type f -name 'lib*.so*'; for f in "${ours[@]}"; do echo "$f"; done)

# ---- size summary ---------------------------------------------------------------------------------
bytes() { find "$@" -type f -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
mib() { awk -v b="$1" 'BEGIN {printf "%6.1f MiB", b / 1048576}'; }
total=$(bytes "$out")
lib_bytes=$(find "$out/lib" -maxdepth 1 -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
lib_count=$(find "$out/lib" -maxdepth 1 -type f -name 'lib*' | wc -l)
largest=$(find "$out/lib" -maxdepth 1 -type f -printf '%s %f\n' | sort -rn | head -4 \
          | awk '{printf "%s%s %.1f", (NR > 1 ? ", " : ""), $2, $1 / 1048576}')
echo "bundle: $out  (from $build; Open MPI ${OMPI_VERSION:-?})"
echo "  our programs        $(mib "$(bytes "${ours[@]}" "${ours[@]/%/.gz}")")  $for_ours"
echo "  Open MPI programs   $(mib "$(bytes "$out/bin/mpirun" "$out/bin/orted" "$out/bin/ompi_info")")   mpirun orted ompi_info"
echo "  shared libraries    $(mib "$lib_bytes")   $lib_count files; largest: $largest"
[ -z "$packed" ] || echo "                      gzipped for the journey, unpacked by env.sh:$packed"
echo "  Open MPI plugins    $(mib "$(bytes "$out/lib/openmpi")")   ${#kept[@]} kept, ${#dropped[@]} left out"
echo "  PMIx plugins        $(mib "$(bytes "$out/lib/pmix")")   ${#pmix_plugins[@]}"
echo "  help texts, config  $(mib "$(bytes "$out/share" "$out/etc" "$out/env.sh" "$out/MANIFEST")")"
echo "  total               $(mib "$total")   (budget $BUDGET_MIB MiB)"
echo "  target needs glibc >= $glibc_need ($glibc_file needs GLIBC_$glibc_full); CUDA libraries from the target: $(tr '\n' ' ' < "$out/CUDA_REQUIRED")"
echo "  stubs: $(for s in "${!stub_users[@]}"; do printf '%s ' "$s"; done)  left-out plugins: ${dropped[*]}" | fold -s -w 110 | sed '2,$s/^/    /'
awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "  took %.1f s\n", e - s}'
if (( total > BUDGET_MIB * 1048576 )); then
  die "the bundle is $(mib "$total" | sed "s/^ *//"), over the $BUDGET_MIB MiB budget; leave programs out with --without (e.g. --without unit_tests,mpi_tests)"
fi
