"""The build on a machine without Debian's packages (a cluster with environment modules or Spack):
what `make` would run, read from its dry run, and the real build with every library from a prefix
of its own and Debian's copies hidden (tests/build/portable_build.sh, also `make
test-portable-build`)."""
import os
import subprocess

from harness import ROOT, Skip, tempdir


def dry_run(*variables):
    build = tempdir()
    proc = subprocess.run(["make", "-n", "--no-print-directory", f"BUILD={build}", *variables,
                           f"{build}/shardtrain"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    compiles = [l for l in lines if " -c " in l and "mpicxx" in l]
    links = [l for l in lines if "mpicxx" in l and " -o " in l and " -c " not in l]
    return proc.stdout, compiles, links


def test_deps_none_takes_every_library_from_the_given_prefixes():
    out, compiles, links = dry_run("DEPS=none", "HDF5_ROOT=/opt/hdf5", "OPENBLAS_ROOT=/opt/openblas",
                                   "DEP_ROOTS=/opt/boost /opt/onednn")
    assert "dpkg-query" not in out and "apt-get" not in out, out[:2000]
    assert len(compiles) > 50, f"{len(compiles)} compile commands"
    for line in compiles:
        for flag in ("-I/opt/hdf5/include", "-I/opt/openblas/include", "-I/opt/boost/include",
                     "-I/opt/onednn/include"):
            assert flag in line.split(), (flag, line)
        assert "-I/usr/include/hdf5/openmpi" not in line.split(), line
        assert "-Itests" not in line.split(), f"the tests' headers on a production compile: {line}"
        assert "-march=x86-64-v3" in line.split(), f"not the portable default: {line}"
    assert len(links) == 1, links
    for flag in ("-L/opt/hdf5/lib", "-Wl,-rpath,/opt/hdf5/lib", "-L/opt/openblas/lib", "-L/opt/boost/lib",
                 "-L/opt/onednn/lib64", "-Wl,-rpath,/opt/onednn/lib"):
        assert flag in links[0].split(), (flag, links[0])


def test_debian_default_checks_the_packages_and_explicit_paths_win():
    out, compiles, _ = dry_run("DEPS=debian", "HDF5_ROOT=/opt/hdf5", "HDF5_INC=/elsewhere/include")
    assert "dpkg-query" in out
    assert all("-I/elsewhere/include" in l.split() for l in compiles)
    proc = subprocess.run(["make", "-n", "DEPS=rpm", "print-config"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "DEPS must be debian or none, got 'rpm'" in proc.stderr, proc.stderr


def test_portable_build_from_prefixes_with_debian_hidden():
    if os.geteuid() != 0:
        raise Skip("the portable build hides Debian's libraries in a mount namespace, which needs root")
    work = tempdir()
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "build", "portable_build.sh")], cwd=ROOT,
                          env={**os.environ, "WORK": work}, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "portable_build: passed" in proc.stdout, proc.stdout[-3000:]
    subprocess.run(["rm", "-rf", work])  # 250 MB of copied libraries and a build
