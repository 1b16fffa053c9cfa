#!/usr/bin/env bash
# pyxis + enroot for hpc's dev cluster, and the local squashfs images its containers run.
#
#   dev-containers.sh build LAB          build enroot (glibc) and pyxis from vendor/ into LAB/containers,
#                                        write the enroot config (per-node paths, PMI hook) and plugstack.conf
#   dev-containers.sh images             build the images (cached in HPC_DEVCLUSTER_IMAGES, /var/cache/hpc/images):
#                                          stock.sqsh     Debian 12 + Python 3.11 + torch (CPU) + transformers: what a
#                                                         TensorRT-LLM/Dynamo image gives hpc (no hpc inside)
#                                          nohpc.sqsh     the same without torch/transformers (a "broken" image)
#                                          nopython.sqsh  busybox, no Python at all (a "broken" image)
#
# Called by dev-cluster.sh up --containers. Facts and pitfalls: docs/dev-cluster.md.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
# the sources travel with the repository (vendor/; a wheel's share/hpc/vendor)
VENDOR=${HPC_VENDOR_DIR:-$HERE/../vendor}
IMAGES=${HPC_DEVCLUSTER_IMAGES:-/var/cache/hpc/images}
# The stock image: what TensorRT-LLM images carry that hpc uses (torch as CPU wheel here, pydantic, PyYAML).
STOCK_PACKAGES=(torch==2.13.0+cpu "transformers>=4.45" "tokenizers>=0.20" "safetensors>=0.4" numpy pillow "pydantic>=2.5" PyYAML)

say() { printf 'dev-containers: %s\n' "$*"; }
die() { printf 'dev-containers: error: %s\n' "$*" >&2; exit 2; }

install_packages() {
  [ "${HPC_DEVCLUSTER_SKIP_INSTALL:-0}" = 1 ] && return 0
  local want=(gcc make libslurm-dev libbsd-dev makeself squashfs-tools jq parallel curl gawk zstd pigz squashfuse
              fuse-overlayfs procps util-linux bsdextrautils debootstrap busybox-static libcap2-bin) missing=() p
  for p in "${want[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

build() {
  local lab=$1 ct=$1/containers
  install_packages
  if [ ! -x "$ct/enroot/bin/enroot" ] || [ ! -f "$ct/pyxis/lib/slurm/spank_pyxis.so" ]; then
    # the sources are needed only when there is no build yet
    [ -f "$VENDOR/enroot-8ea147d.tar.gz" ] && [ -f "$VENDOR/pyxis-0.24.0.tar.gz" ] || \
      die "enroot/pyxis sources not found in $VENDOR (the repository's vendor/; or set HPC_VENDOR_DIR)"
    rm -rf "$ct/src" && mkdir -p "$ct/src"
    tar xzf "$VENDOR/enroot-8ea147d.tar.gz" -C "$ct/src"
    tar xzf "$VENDOR/pyxis-0.24.0.tar.gz" -C "$ct/src"
    # enroot without its git submodules: glibc + libbsd (glibc 2.36 has no strlcpy), the system's kernel
    # headers and Debian's makeself.
    (cd "$ct/src/enroot-8ea147d" &&
      mkdir -p deps/dist/linux/include deps/linux-headers deps/makeself &&
      touch deps/linux-headers/.stamp && cp /usr/bin/makeself deps/makeself/makeself.sh &&
      export CPPFLAGS="-D_GNU_SOURCE -include bsd/string.h" &&
      make -s -j2 FORCE_GLIBC=1 LDLIBS="-l:libbsd.a -l:libbsd.so" prefix="$ct/enroot" >"$ct/enroot-build.log" 2>&1 &&
      make -s install FORCE_GLIBC=1 LDLIBS="-l:libbsd.a -l:libbsd.so" prefix="$ct/enroot" >>"$ct/enroot-build.log" 2>&1) \
      || die "enroot build failed: $ct/enroot-build.log"
    (cd "$ct/src/pyxis-0.24.0" && make -s >"$ct/pyxis-build.log" 2>&1 &&
      make -s install prefix="$ct/pyxis" >>"$ct/pyxis-build.log" 2>&1) || die "pyxis build failed: $ct/pyxis-build.log"
  fi
  # All nodes share one filesystem: every enroot path is per node ($(hostname) is the node's name in its UTS
  # namespace; enroot evaluates config values). pyxis drops ENROOT_*_PATH from the job, so they live here.
  local conf=$ct/enroot/etc/enroot
  mkdir -p "$conf/enroot.conf.d" "$conf/hooks.d" "$ct/nodes"
  cat > "$conf/enroot.conf.d/devcluster.conf" <<EOF
ENROOT_RUNTIME_PATH $ct/nodes/\$(hostname)/run/user-\$(id -u)
ENROOT_DATA_PATH $ct/nodes/\$(hostname)/data/user-\$(id -u)
ENROOT_CACHE_PATH $ct/nodes/\$(hostname)/cache/user-\$(id -u)
ENROOT_TEMP_PATH $ct/nodes/\$(hostname)/tmp
ENROOT_ROOTFS_WRITABLE yes
ENROOT_MOUNT_HOME no
ENROOT_LOGIN_SHELL no
EOF
  # PMIx inside containers: the hook mounts PMIX_SERVER_TMPDIR (without it ranks log dstore lock errors).
  cp "$ct/enroot/share/enroot/hooks.d/50-slurm-pmi.sh" "$conf/hooks.d/" 2>/dev/null || true
  local node
  while read -r node; do
    mkdir -p "$ct/nodes/$node/tmp"  # enroot does not create its temp path
  done < <(awk '/^NodeName=/ {sub("NodeName=", "", $1); print $1}' "$lab/etc/slurm.conf")
  mkdir -p "$ct/pyxis-run"
  # use_squashfuse: steps start straight from the .sqsh (0.3 s) instead of unpacking it per step (4-10 s on disk).
  echo "required $ct/pyxis/lib/slurm/spank_pyxis.so runtime_path=$ct/pyxis-run use_squashfuse=1" \
    > "$lab/etc/plugstack.conf"
}

pip_into() {  # pip_into ROOTFS PACKAGES...: install with this machine's pip for the image's Python (3.11 here)
  local rootfs=$1
  shift
  python3 -m pip install -q --no-warn-script-location --target "$rootfs/usr/local/lib/python3.11/dist-packages" \
    --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --only-binary=:all: --implementation cp "$@"
}

images() {
  install_packages
  mkdir -p "$IMAGES"
  local work=$IMAGES/work
  if [ ! -f "$IMAGES/stock.sqsh" ] || [ ! -f "$IMAGES/nohpc.sqsh" ]; then
    rm -rf "$work" && mkdir -p "$work"
    say "debootstrap Debian 12 with Python 3.11 (about a minute; cached in $IMAGES)"
    debootstrap --variant=minbase --include=python3,ca-certificates bookworm "$work/rootfs" >"$IMAGES/debootstrap.log" 2>&1 \
      || die "debootstrap failed: $IMAGES/debootstrap.log"
    rm -rf "$work/rootfs/var/cache/apt/archives"/*.deb "$work/rootfs/var/lib/apt/lists"/* "$work/rootfs/dev"/*
    mksquashfs "$work/rootfs" "$IMAGES/nohpc.sqsh.tmp" -comp lzo -noD -quiet -noappend >/dev/null
    mv "$IMAGES/nohpc.sqsh.tmp" "$IMAGES/nohpc.sqsh"
    say "adding the serving stack (${STOCK_PACKAGES[*]})"
    pip_into "$work/rootfs" "${STOCK_PACKAGES[@]}" 2>"$IMAGES/pip.log" || die "pip failed: $IMAGES/pip.log"
    mksquashfs "$work/rootfs" "$IMAGES/stock.sqsh.tmp" -comp lzo -noD -quiet -noappend >/dev/null
    mv "$IMAGES/stock.sqsh.tmp" "$IMAGES/stock.sqsh"
    rm -rf "$work"
  fi
  if [ ! -f "$IMAGES/nopython.sqsh" ]; then
    rm -rf "$work" && mkdir -p "$work/rootfs"/{bin,etc,tmp}
    cp /bin/busybox "$work/rootfs/bin/busybox"
    for tool in sh ls cat echo true env; do ln -s busybox "$work/rootfs/bin/$tool"; done
    echo "root:x:0:0:root:/root:/bin/sh" > "$work/rootfs/etc/passwd"
    mksquashfs "$work/rootfs" "$IMAGES/nopython.sqsh" -comp lzo -noD -quiet -noappend >/dev/null
    rm -rf "$work"
  fi
  say "images in $IMAGES: $(find "$IMAGES" -maxdepth 1 -name '*.sqsh' -printf '%f ')"
}

case ${1:-} in
  build) shift; build "$@" ;;
  images) images ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
