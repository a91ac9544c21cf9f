#!/usr/bin/env bash
# Make a Debian 12 (bookworm, Python 3.11) base image without any image
# registry: debootstrap a minimal root filesystem from the Debian archive and
# `docker import` it. Pass the tag to the Dockerfile as BASE_IMAGE.
#
#   deploy/docker/make-base-image.sh [TAG]     # default specserve-base:bookworm
#
# Needs root, debootstrap and a running Docker engine. An existing TAG is
# kept, so running it again costs nothing.
set -euo pipefail

tag=${1:-specserve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists"
    exit 0
fi

rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror"
# Security and point-release updates, as in Debian's own images.
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
# Local CAs (e.g. a TLS-inspecting proxy's) so pip inside the build trusts
# what this host trusts; the Dockerfile's ca-certificates install picks them up.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    mkdir -p "$rootfs/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
fi
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" --numeric-owner -c . | docker import --change 'CMD ["bash"]' - "$tag"
echo "base image $tag made"
