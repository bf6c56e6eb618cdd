#!/usr/bin/env bash
# A base image made locally, for machines that reach no container registry:
#   deploy/docker/make-base.sh [TAG]        (default localhost/attnserve-base:bookworm)
# Debian bookworm (minbase) from Debian's own packages with debootstrap, plus python3
# (3.11, as python:3.11-slim), python3-venv, python-is-python3 (the Dockerfiles call
# `python`) and ca-certificates; trimmed as debian:bookworm-slim is (no docs, man pages
# or locales, no apt lists), then imported with `import`. Needs root and debootstrap
# (Debian: apt-get install debootstrap). Does nothing when TAG exists already
# (FORCE=1 makes it again).
#
# The host's CA bundle replaces Debian's in the image, so that pip and apt inside a build
# trust what the host trusts (a TLS-inspecting proxy's CA, for one).
# DEBIAN_MIRROR (default http://deb.debian.org/debian) is where the packages come from.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tag=${1:-localhost/attnserve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
host_ca=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
engine="$here/engine.sh"

if [ -z "${FORCE:-}" ] && "$engine" image inspect "$tag" >/dev/null 2>&1; then
    echo "make-base: $tag exists (FORCE=1 to make it again)"
    exit 0
fi
command -v debootstrap >/dev/null || {
    echo "make-base: debootstrap is missing (Debian: apt-get install debootstrap)" >&2
    exit 127
}

work=$(mktemp -d "${TMPDIR:-/tmp}/attnserve-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
started=$(date +%s)
debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    exit 1
}

# As debian:bookworm-slim: later `apt-get install`s skip docs, man pages and locales too.
cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
find "$root/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$root"/usr/share/{man,info,groff,lintian,linda}/* \
       "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
       "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/* \
       "$root"/etc/machine-id "$root"/etc/hostname "$root"/etc/resolv.conf
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
: >"$root/etc/machine-id"
if [ -f "$host_ca" ]; then
    cp "$host_ca" "$root/etc/ssl/certs/ca-certificates.crt"
fi

tar --numeric-owner -C "$root" -c . | "$engine" import \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    - "$tag" >/dev/null
echo "make-base: $tag made in $(($(date +%s) - started)) s" \
     "($("$engine" image inspect --format '{{.Size}}' "$tag") bytes)"
