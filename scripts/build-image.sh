#!/usr/bin/env bash
# Build the pdctl image (Dockerfile) where no registry is reachable: the base image from debootstrap, pdctl and
# its dependencies from a wheelhouse made here, so the build itself needs no network.
#
#   scripts/build-image.sh [TAG]          # default TAG: pdctl:<version>
#
# Environment:
#   BASE_IMAGE   use this base instead (pulled or local); the default builds pdctl-base:bookworm once, with
#                debootstrap (Debian bookworm minbase + python3, python3-venv, ca-certificates; ~1 min, 275 MB)
#   PYTHON       the interpreter whose pip makes the wheelhouse (default: .venv/bin/python, else python3)
#
# With a registry at hand, a plain `docker build -t pdctl:0.1.0 .` does the same from python:3.11-slim.
# The build context is a temporary folder holding pyproject.toml, README.md, pdctl/ and wheels/ only: nothing of
# this machine (its certificates, its pip configuration) goes into the image.
set -euo pipefail

cd "$(dirname "$0")/.."
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' pdctl/__init__.py)
tag=${1:-pdctl:$version}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
base=${BASE_IMAGE:-pdctl-base:bookworm}

say() { printf '%s build-image: %s\n' "$(date -u +%H:%M:%S)" "$*"; }

if ! docker image inspect "$base" >/dev/null 2>&1; then
    if [ -n "${BASE_IMAGE:-}" ]; then
        say "pulling $base"
        docker pull "$base"
    else
        command -v debootstrap >/dev/null || { echo "build-image: debootstrap is missing (apt-get install debootstrap), or set BASE_IMAGE" >&2; exit 2; }
        root=$(mktemp -d)
        trap 'rm -rf "$root"' EXIT
        say "making $base with debootstrap in $root"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" >"$root.log" 2>&1 \
            || { tail -20 "$root.log" >&2; exit 1; }
        rm -f "$root.log"
        tar -C "$root" -c . | docker import - "$base" >/dev/null
        rm -rf "$root"
        trap - EXIT
    fi
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
say "wheelhouse ($python -m pip wheel .)"
"$python" -m pip wheel --quiet . -w "$ctx/wheels"
cp Dockerfile .dockerignore pyproject.toml README.md "$ctx/"
tar --exclude=__pycache__ -c pdctl | tar -C "$ctx" -x
say "docker build -t $tag (BASE_IMAGE=$base)"
docker build --quiet --network none --build-arg "BASE_IMAGE=$base" -t "$tag" "$ctx" >/dev/null
say "built $tag"
