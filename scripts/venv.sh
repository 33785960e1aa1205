#!/usr/bin/env bash
# Makes (or repairs) the project's virtualenv for the Makefile: checks the Python it was
# given, rebuilds a venv a failed attempt left half-made, installs the requested extras
# with constraints.txt, and writes the stamp only once every step has succeeded.
#
#   scripts/venv.sh PYTHON VENV EXTRAS STAMP...
#     EXTRAS: "" for what running a cluster needs (`make run`), "dev,spark" for everything.
#     STAMP:  files touched at the very end (the Makefile's up-to-date markers).
set -euo pipefail

MIN_MAJOR=3
MIN_MINOR=11

python=$1
venv=$2
extras=$3
shift 3

fail() {
    echo "make: $*" >&2
    exit 1
}

# 1. The interpreter we were given must exist and be new enough.
if ! command -v "$python" >/dev/null 2>&1; then
    fail "no '$python' on PATH. Squall needs Python ${MIN_MAJOR}.${MIN_MINOR} or later: install" \
        "it (Debian/Ubuntu: apt-get install python3.11 python3.11-venv) and run" \
        "'make PYTHON=python3.11 ...'"
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
    || fail "'$python' does not run"
if ! "$python" -c "import sys; sys.exit(sys.version_info < (${MIN_MAJOR}, ${MIN_MINOR}))"; then
    fail "'$python' is Python $version; Squall needs Python ${MIN_MAJOR}.${MIN_MINOR} or later." \
        "Install python3.11 or newer (Debian/Ubuntu: apt-get install python3.11 python3.11-venv;" \
        "or pyenv install 3.11) and run 'make PYTHON=python3.11 ...'"
fi

# 2. A venv is reused only if its python runs, is new enough and has pip, and no earlier
# attempt on it stopped half-way (its marker is still there); anything else is what an
# interrupted or failed attempt left behind, and is rebuilt from scratch.
marker="$venv/.incomplete"
venv_ok() {
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" -c \
        "import sys; sys.exit(sys.version_info < (${MIN_MAJOR}, ${MIN_MINOR}))" 2>/dev/null \
        || return 1
    "$venv/bin/python" -m pip --version >/dev/null 2>&1 || return 1
}
if [ -e "$venv" ] && ! venv_ok; then
    echo "make: $venv is incomplete or broken (a failed earlier attempt?); rebuilding it" >&2
    rm -rf "$venv"
elif [ -e "$marker" ]; then
    echo "make: the last install into $venv did not finish; rebuilding it" >&2
    rm -rf "$venv"
fi
if [ ! -e "$venv" ]; then
    if ! "$python" -m venv "$venv"; then
        rm -rf "$venv"
        fail "'$python -m venv' failed. On Debian/Ubuntu install the venv module" \
            "(apt-get install python${version}-venv) and run make again."
    fi
    if ! venv_ok; then
        rm -rf "$venv"
        fail "the new venv has no working pip. On Debian/Ubuntu install" \
            "python${version}-venv and run make again."
    fi
fi

# A venv another checkout installed into (a git worktree sharing it through a link) is
# not ours to re-point: the editable installs would then load this checkout's code in the
# other one's tests and services. A checkout that moved (its old directory is gone) may.
here=$(cd . && pwd -P)
for finder in "$venv"/lib/python*/site-packages/__editable___squall_server_*_finder.py; do
    [ -f "$finder" ] || continue
    mapped=$(sed -n "s/^MAPPING.*'squall_server': '\(.*\)'.*/\1/p" "$finder")
    owner=${mapped%/services}
    if [ -n "$mapped" ] && [ -d "$mapped" ] && [ "$(cd "$owner" && pwd -P)" != "$here" ]; then
        fail "$venv holds the editable install of the checkout at $owner; installing from" \
            "$here would point it here instead. Run make in $owner, or give this checkout" \
            "a venv of its own (remove the link, or 'make VENV=.venv-here ...')."
    fi
done

# 3. Install. Any failure (or Ctrl-C) stops here with the marker left, so the next make
# starts again from a new venv; the stamps are written only after every step.
touch "$marker"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# Two distributions, both editable: the client (clients/, `squall`, with its `spark` extra
# when asked for) and the server (the root, `squall-server`, with the other extras).
client="./clients"
server_extras=""
for extra in ${extras//,/ }; do
    if [ "$extra" = spark ]; then
        client="./clients[spark]"
    else
        server_extras="${server_extras:+$server_extras,}$extra"
    fi
done
server="."
if [ -n "$server_extras" ]; then
    server=".[$server_extras]"
fi
# --no-compile: pip would write bytecode for every module of every package (pyspark's
# thousands among them), 15 of a fresh install's 50 s here; `make bytecode` writes it for
# our own modules and the packages the server and client run on (scripts/bytecode.py),
# which a shell with PYTHONDONTWRITEBYTECODE set would otherwise compile in every process.
"$venv/bin/python" -m pip install --quiet --no-compile -c constraints.txt -e "$client" -e "$server"
if [ ! -f clients/squall/v1/broker_pb2.py ]; then
    "$venv/bin/python" scripts/gen_protos.py
fi
rm -f "$marker"
touch "$@"
