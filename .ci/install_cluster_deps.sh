#!/usr/bin/env bash
# Installs what the cluster tests (tests/multiprocess/test_slurm.py, test_mpirun.py) and
# bench/cluster.py need, idempotently, and says what it did:
#   * Debian packages: slurm-wlm munge (a one-node Slurm), openmpi-bin libopenmpi-dev
#     gfortran cmake (Open MPI's mpirun, and what MPIwrapper builds with), etcd-server (the
#     etcd that tests/multiprocess/test_elastic_etcd.py starts for --rdzv-backend etcd);
#   * MPIwrapper 2.11.1 from ../shared/vendor/ (or $JAXPG_VENDOR_DIR), built against this
#     machine's mpiexec into $JAXPG_MPIWRAPPER_DIR (default ~/.cache/jaxpg/MPIwrapper-2.11.1),
#     where the tests look for it; it prints the MPITRAMPOLINE_LIB to use.
# Needs root for apt-get (CI runs as root). Nothing else starts: the tests start their own
# munged/slurmctld/slurmd (and etcd) in a temporary directory and stop them.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(slurm-wlm munge openmpi-bin libopenmpi-dev gfortran cmake etcd-server)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[cluster deps] installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "[cluster deps] Debian packages already installed: ${packages[*]}"
fi

version=MPIwrapper-2.11.1
cache="${JAXPG_MPIWRAPPER_DIR:-$HOME/.cache/jaxpg/$version}"
lib="$cache/inst/lib/libmpiwrapper.so"
if [[ -f "$lib" ]]; then
  echo "[cluster deps] MPIwrapper already built: $lib"
else
  vendor="${JAXPG_VENDOR_DIR:-}"
  if [[ -z "$vendor" ]]; then
    vendor="$PWD/../shared/vendor"
    [[ -d "$vendor" ]] || vendor=/work/shared/vendor
  fi
  source="$vendor/$version.tar.gz"
  [[ -f "$source" ]] || { echo "[cluster deps] missing $source (set JAXPG_VENDOR_DIR)" >&2; exit 1; }
  work="$cache.build-$$"
  rm -rf "$work" && mkdir -p "$work"
  tar xzf "$source" -C "$work"
  echo "[cluster deps] building $version against $(command -v mpiexec)"
  cmake -S "$work/$version" -B "$work/build" -DMPIEXEC_EXECUTABLE="$(command -v mpiexec)" \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$work/inst" >/dev/null
  cmake --build "$work/build" -j2 >/dev/null
  cmake --install "$work/build" >/dev/null
  mkdir -p "$cache" && rm -rf "$cache/inst" && mv "$work/inst" "$cache/inst" && rm -rf "$work"
  echo "[cluster deps] built $lib"
fi
echo "[cluster deps] MPITRAMPOLINE_LIB=$lib"
