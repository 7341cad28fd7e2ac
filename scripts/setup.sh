#!/usr/bin/env bash
# Installs every system dependency dtrain needs from Debian packages, and
# nothing else. Idempotent: a second run installs nothing and takes a second.
# CUDA and NCCL are not installed: they are detected under /usr/local/cuda.
#
#   scripts/setup.sh            build + test dependencies
#   scripts/setup.sh --peers    also the peer programs for bench/ (PyTorch, Redis, OpenMPI)
set -euo pipefail

packages=(
  build-essential cmake g++ pkg-config
  libasio-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  libgloo-dev libopenblas-dev zlib1g-dev
  libdnnl-dev                     # oneDNN: matrix products besides OpenBLAS, bf16 on CPUs that have it (DT_USE_ONEDNN)
  iproute2 procps psmisc util-linux
  lld ninja-build                 # faster links of the ~80 test binaries (DT_USE_LLD); the build tool (scripts/build.sh)
  clang                           # the sanitizer builds of CI (scripts/ci_sanitizers.sh): half of g++'s compile time there
  python3-torch
  slurmctld slurmd slurm-client   # the SLURM tests' private cluster (tests/slurm/cluster.sh)
  dataset-fashion-mnist           # examples/trainer's data: /usr/share/datasets/fashion-mnist/*.gz
  fortunes                        # examples/gpt's text: /usr/share/games/fortunes (2.5 MB of English)
  python3-matplotlib              # scripts/plot_metrics.py
  libcurl4-openssl-dev nlohmann-json3-dev   # store/etcd_store: etcd's v3 JSON gateway over HTTP(S)
  etcd-server openssl             # the etcd tests' private members (tests/store/etcd_test_support.h)
  libtorch-dev pybind11-dev       # torch_shim: dtrain as a torch.distributed backend (docs/torch.md)
  chromium libjs-chart.js         # dtrun --status-port's page (Chart.js) and its headless-browser test
)
if [[ "${1:-}" == "--peers" ]]; then
  packages+=(redis-server redis-tools libopenblas0-pthread libopenmpi-dev openmpi-bin hyperfine time)
fi

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=()
  [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  # Another apt run (a second setup.sh, say) may hold the dpkg lock: wait for it.
  apt=("${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=300)
  # The SLURM (and munge) packages' init scripts would start system-wide daemons that the
  # tests do not want: tests start their own private cluster. invoke-rc.d starts nothing
  # while policy-rc.d exits 101. Removed afterwards only if this script put it there.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo_cmd[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${sudo_cmd[@]}" chmod 755 /usr/sbin/policy-rc.d
    trap '"${sudo_cmd[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  if ! "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}"; then
    "${apt[@]}" update -q
    "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}"
  fi
else
  echo "setup: all ${#packages[@]} packages present"
fi

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA found at /usr/local/cuda ($(/usr/local/cuda/bin/nvcc --version | tail -1))"
else
  echo "setup: no CUDA toolkit at /usr/local/cuda; building CPU-only"
fi
