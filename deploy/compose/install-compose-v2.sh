#!/usr/bin/env bash
# Installs Docker Compose v2 as a Docker CLI plugin (`docker compose`) where it is missing: Debian bookworm's
# docker-compose is 1.29 (it rejects the top-level `name:` of docker-compose.yml); trixie's package is v2, a static
# binary. Fetched with apt from Debian's own archive (the trixie source pinned so that nothing else comes from
# it), unpacked, and its plugin copied to DEST. `make compose-tools` runs it; tests/deploy/test_compose_config.py
# needs it (no engine needed: `docker compose config` only reads the files).
#   deploy/compose/install-compose-v2.sh [DEST]    (default /usr/local/lib/docker/cli-plugins; needs root, apt)
set -euo pipefail
dest="${1:-/usr/local/lib/docker/cli-plugins}"
if docker compose version 2>/dev/null | grep -q 'v\?2\.'; then
  docker compose version; exit 0
fi
command -v apt-get >/dev/null || { echo "needs apt-get (Debian); else install Compose v2 by hand" >&2; exit 1; }
if ! command -v docker >/dev/null; then   # the plugin needs the docker client (Debian's docker.io has it)
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io
fi
# The machine's own Debian archive (its apt sources: a mirror or proxy keeps working), unless DEBIAN_MIRROR is set.
apt_mirror() {
  { sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null
    sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' /etc/apt/sources.list 2>/dev/null
  } | grep -m1 '/debian/\?$' || true
}
mirror="${DEBIAN_MIRROR:-$(apt_mirror)}"
[ -n "$mirror" ] || { echo "no Debian archive in the apt sources: set DEBIAN_MIRROR" >&2; exit 1; }
list=/etc/apt/sources.list.d/steploop-trixie-compose.list
pin=/etc/apt/preferences.d/steploop-trixie-compose
work="$(mktemp -d)"
cleanup() {
  rm -rf "$work" "$list" "$pin"
  apt-get update -qq >/dev/null 2>&1 || true   # forget trixie's lists again
}
trap cleanup EXIT
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$list"
printf 'Package: *\nPin: release n=trixie\nPin-Priority: 1\n' > "$pin"
apt-get update -qq -o Dir::Etc::sourcelist="$list" -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
(cd "$work" && apt-get download -qq docker-compose/trixie)
dpkg-deb -x "$work"/docker-compose_*.deb "$work/root"
plugin="$(find "$work/root" -type f -name docker-compose -path '*cli-plugins*' | head -1)"
[ -n "$plugin" ] || { echo "no cli-plugins/docker-compose in trixie's docker-compose package" >&2; exit 1; }
install -D -m 0755 "$plugin" "$dest/docker-compose"
docker compose version
