# shellcheck shell=bash
# Shared helpers for the scripts in bin/ and .ci/run. Source it, don't run it.
#
#   ensure_venv DIR PYTHON REQFILE [NODEPS]
#                                    create DIR with PYTHON ("3.11", or "3.12+" for
#                                    3.12 or newer) and pip-install REQFILE, then NODEPS
#                                    (if given) with --no-deps; skipped when DIR's stamp
#                                    names REQFILE, or a file that includes it (-r),
#                                    unchanged since it was installed.
#   ensure_debian_packages PKG...    install the missing ones with apt-get (as root, or
#                                    with sudo that needs no password); otherwise say
#                                    which apt-get command to run, and exit.
#   find_python PYTHON               print the path of a working interpreter.
#   on_exit COMMAND...               run COMMAND when the script exits (LIFO).
#   free_port FIRST [COUNT [TAKEN...]]  print the first free port >= FIRST (COUNT
#                                    free in a row, none in TAKEN).
#   port_free PORT [COUNT]           0 when PORT (..PORT+COUNT-1) is free now.
#   pick_port VAR DEFAULT [COUNT [TAKEN...]]  the port VAR names (it must be free:
#                                    dies otherwise), else free_port DEFAULT ...
#   port_taken VAR [COUNT]           die: the port VAR names is someone else's.
#   die / info / banner              messages on stderr.
#
# The project itself is never pip-installed: it is used from the checkout.

if [[ -n "${_COORDINATION_BOOTSTRAP_LOADED:-}" ]]; then
    return 0
fi
_COORDINATION_BOOTSTRAP_LOADED=1

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
export REPO_ROOT

info() { printf '%s\n' "$*" >&2 || true; } # a closed stderr (a pipe's reader gone) is no error
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}
banner() {
    printf '\n==== %s ====\n' "$*" >&2
}

# --- exit hooks -------------------------------------------------------------
# One EXIT trap runs every registered hook, newest first. INT/TERM/HUP turn into
# a normal exit so the hooks run on Ctrl-C and kill too.
_EXIT_HOOKS=()

on_exit() {
    local cmd
    printf -v cmd '%q ' "$@"
    _EXIT_HOOKS+=("$cmd")
    if [[ -z "${_EXIT_TRAP_SET:-}" ]]; then
        _EXIT_TRAP_SET=1
        trap _run_exit_hooks EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        trap 'exit 129' HUP
    fi
}

_run_exit_hooks() {
    local rc=$? i
    trap - EXIT
    # Cleanup must not be cut short by a second Ctrl-C, nor by SIGPIPE when the
    # reader of our output is gone (bin/run | tee, with tee stopped by the same Ctrl-C).
    trap '' INT TERM HUP PIPE
    set +e
    for ((i = ${#_EXIT_HOOKS[@]} - 1; i >= 0; i--)); do
        eval "${_EXIT_HOOKS[i]}"
    done
    _EXIT_HOOKS=()
    exit "$rc"
}

# --- ports ------------------------------------------------------------------
# A port is free when a server could listen on it on 127.0.0.1 now, bound the
# way servers bind (SO_REUSEADDR: a port that a stopped server left in
# TIME_WAIT is free, one with a listener on 127.0.0.1 or on every address is
# not). Another process can still take it before our server binds it; that
# server then fails to start, and its caller says so.

# free_port FIRST [COUNT [TAKEN...]]: print the lowest P >= FIRST such that
# P..P+COUNT-1 are free and none is in TAKEN (ports chosen but not bound yet).
free_port() {
    local first=$1 count=${2:-1}
    shift "$(($# < 2 ? $# : 2))"
    command -v python3 >/dev/null || die "python3 is needed to find free ports"
    python3 - "$first" "$count" "$@" <<'EOF'
import socket
import sys

first, count = int(sys.argv[1]), int(sys.argv[2])
taken = {int(port) for port in sys.argv[3:]}


def free(port: int) -> bool:
    if port in taken:
        return False
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


for base in range(first, 65536 - count + 1):
    if all(free(base + i) for i in range(count)):
        print(base)
        break
else:
    sys.exit(f"no {count} free port(s) from {first} on")
EOF
}

port_free() { # port_free PORT [COUNT]
    [[ "$(free_port "$1" "${2:-1}" 2>/dev/null)" == "$1" ]]
}

# pick_port VAR DEFAULT [COUNT [TAKEN...]]: a port for a server about to start.
# The environment variable VAR, when set, says which (and the port must be free
# and not in TAKEN: a port held by someone else fails at once, instead of a
# server that cannot bind and a caller that waits for it); else the first free
# one from DEFAULT.
pick_port() {
    local var=$1 first=$2 count=${3:-1} port
    shift "$(($# < 3 ? $# : 3))"
    if [[ -z "${!var:-}" ]]; then
        free_port "$first" "$count" "$@"
        return
    fi
    port=$(free_port "${!var}" "$count" "$@") || return 1
    [[ $port == "${!var}" ]] || port_taken "$var" "$count"
    printf '%s\n' "$port"
}

# port_taken VAR [COUNT]: die because the port(s) VAR names are held by another process.
port_taken() {
    local var=$1 count=${2:-1}
    die "port ${!var}$( ((count == 1)) || printf -- '-%s' "$((${!var} + count - 1))") ($var) is in use on 127.0.0.1 by a process these scripts did not start.
       Stop it, choose another $var, or unset $var to let the script pick free ports."
}

# --- interpreters -----------------------------------------------------------
# _python_ok CANDIDATE MIN_MINOR EXACT: prints the real executable if CANDIDATE
# runs and is 3.MIN_MINOR (or newer unless EXACT).
_python_ok() {
    local cand=$1 minor=$2 exact=$3
    "$cand" -c "
import sys
v = sys.version_info
ok = v[0] == 3 and (v[1] == $minor if $exact else v[1] >= $minor)
if not ok:
    sys.exit(1)
print(sys.executable)
" 2>/dev/null
}

# find_python 3.11 | 3.12+ : a working interpreter of that minor version. The
# pyenv shims on PATH fail unless PYENV_VERSION is set, so every candidate is run.
# Override with COORDINATION_PYTHON_3_12=/path/to/python (dots become _).
find_python() {
    local spec=$1 base minor newer=0 m cand found
    base=${spec%+}
    [[ $spec == *+ ]] && newer=1
    [[ $base =~ ^3\.([0-9]+)$ ]] || die "find_python: bad version '$spec'"
    minor=${BASH_REMATCH[1]}

    local override_var="COORDINATION_PYTHON_${base//./_}"
    if [[ -n "${!override_var:-}" ]]; then
        if found=$(_python_ok "${!override_var}" "$minor" 0); then
            printf '%s\n' "$found"
            return 0
        fi
        die "$override_var=${!override_var} is not a working Python $base"
    fi

    local minors=("$minor")
    if ((newer)); then
        for m in 1 2 3 4 5; do minors+=("$((minor + m))"); done
    fi
    for m in "${minors[@]}"; do
        local candidates=("python3.$m" "/usr/local/bin/python3.$m" "/usr/bin/python3.$m")
        # pyenv installs, newest patch release first
        local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
        local d
        while IFS= read -r d; do
            [[ -n $d ]] && candidates+=("$d/bin/python3")
        done < <(ls -d "$pyenv_root"/versions/3."$m".* 2>/dev/null | sort -t. -k3,3nr)
        for cand in "${candidates[@]}"; do
            if found=$(_python_ok "$cand" "$m" 1); then
                printf '%s\n' "$found"
                return 0
            fi
        done
    done
    return 1
}

# --- requirements -----------------------------------------------------------
# _req_closure FILE: FILE and every file it pulls in with -r/-c, recursively.
_req_closure() {
    local file=$1 dir line inc
    [[ -f $file ]] || die "requirements file not found: $file"
    printf '%s\n' "$file"
    dir=$(dirname "$file")
    while IFS= read -r line || [[ -n $line ]]; do
        if [[ $line =~ ^[[:space:]]*(-r|--requirement|-c|--constraint)[[:space:]=]+([^[:space:]#]+) ]]; then
            inc=${BASH_REMATCH[2]}
            [[ $inc == /* ]] || inc="$dir/$inc"
            _req_closure "$inc"
        fi
    done <"$file"
}

# _req_digest PYTHON REQFILE [NODEPS]: sha256 over the interpreter version and
# the names and contents of the requirement files (NODEPS's too, marked apart).
_req_digest() {
    local python=$1 req=$2 nodeps=${3:-} f
    {
        "$python" -c 'import sys; print(sys.version)'
        while IFS= read -r f; do
            printf '== %s\n' "$f"
            cat "$f"
        done < <(_req_closure "$req" | sort -u)
        if [[ -n $nodeps ]]; then
            while IFS= read -r f; do
                printf '== --no-deps %s\n' "$f"
                cat "$f"
            done < <(_req_closure "$nodeps" | sort -u)
        fi
    } | sha256sum | cut -d' ' -f1
}

# _stamp_accepts STAMP REQ PYTHON [NODEPS]: the venv's stamp names a requirements
# file (REQ itself, or one that pulls REQ in with -r) whose files, and those of
# the --no-deps file installed after it, are unchanged since they were installed.
# A stamp of only a digest (older scripts) names REQ. A caller that asks for a
# NODEPS file accepts only a stamp that names the same one.
_stamp_accepts() {
    local stamp=$1 req=$2 python=$3 want_nodeps=${4:-} digest installed nodeps=""
    [[ -f $stamp ]] || return 1
    { read -r digest && read -r installed && read -r nodeps; } <"$stamp" || true
    if [[ -n $want_nodeps ]]; then
        [[ $nodeps == /* ]] || nodeps="$REPO_ROOT/$nodeps"
        [[ $nodeps == "$want_nodeps" ]] || return 1
    fi
    if [[ -n $nodeps ]]; then
        [[ $nodeps == /* ]] || nodeps="$REPO_ROOT/$nodeps"
        [[ -f $nodeps ]] || return 1
    fi
    [[ -n $digest ]] || return 1
    if [[ -z ${installed:-} ]]; then
        installed=$req
    else
        [[ $installed == /* ]] || installed="$REPO_ROOT/$installed"
        [[ -f $installed ]] || return 1
        # Not a pipe into grep -q: under pipefail its early exit would fail the pipe.
        local closure
        closure=$(_req_closure "$installed")
        grep -qxF "$req" <<<"$closure" || return 1
    fi
    [[ "$(_req_digest "$python" "$installed" "$nodeps")" == "$digest" ]]
}

# ensure_venv DIR PYTHON REQFILE [NODEPS]
# NODEPS is for a package whose declared requirements exclude a version the
# project pins and runs it with (django-celery-beat and Django 6.1: see
# requirements/beat.txt): REQFILE pins its dependencies, NODEPS the package.
ensure_venv() {
    local dir=$1 spec=$2 req=$3 nodeps=${4:-}
    local abs_dir stamp python venv_py digest lockfd
    [[ $dir == /* ]] && abs_dir=$dir || abs_dir="$REPO_ROOT/$dir"
    [[ $req == /* ]] || req="$REPO_ROOT/$req"
    [[ -z $nodeps || $nodeps == /* ]] || nodeps="$REPO_ROOT/$nodeps"
    stamp="$abs_dir/.requirements.sha256"
    venv_py="$abs_dir/bin/python"

    # Two scripts of the same checkout must not pip-install into one venv at once.
    [[ -f $req ]] || die "requirements file not found: $req"
    mkdir -p "$REPO_ROOT/var"
    exec {lockfd}>>"$REPO_ROOT/var/.lock-venv-$(basename "$abs_dir")"
    if ! flock -n "$lockfd"; then
        info "waiting for another script that is installing into $dir ..."
        flock "$lockfd"
    fi

    local base=${spec%+} minor newer=0
    [[ $spec == *+ ]] && newer=1
    minor=${base#3.}

    # An existing venv is kept if its interpreter still runs and has the right version.
    if [[ -e $abs_dir ]]; then
        if ! _python_ok "$venv_py" "$minor" "$((1 - newer))" >/dev/null; then
            if [[ -f $abs_dir/pyvenv.cfg ]]; then
                info "$dir: interpreter missing or not Python $spec; recreating it"
                rm -rf -- "$abs_dir"
            else
                die "$dir exists but is not a virtualenv; move it away"
            fi
        fi
    fi

    if [[ ! -e $abs_dir ]]; then
        python=$(find_python "$spec") || die "Python $spec not found (tried python${base}, pyenv versions under ${PYENV_ROOT:-$HOME/.pyenv}/versions; set COORDINATION_PYTHON_${base//./_}=/path/to/python)"
        info "$dir: creating virtualenv with $python"
        "$python" -m venv "$abs_dir" || die "could not create $dir with $python"
    fi

    # bin/test's venv (requirements/test.txt) includes bin/run's (run.txt): either
    # script accepts a venv the other made, as long as nothing changed since.
    if _stamp_accepts "$stamp" "$req" "$venv_py" "$nodeps"; then
        flock -u "$lockfd"
        exec {lockfd}>&-
        return 0
    fi

    digest=$(_req_digest "$venv_py" "$req" "$nodeps")
    info "$dir: installing ${req#"$REPO_ROOT"/}${nodeps:+, then ${nodeps#"$REPO_ROOT"/} with --no-deps}"
    rm -f "$stamp"
    if ! "$venv_py" -m pip install --disable-pip-version-check --no-input --progress-bar off \
        -q -r "$req"; then
        die "$dir: pip install -r ${req#"$REPO_ROOT"/} failed"
    fi
    if [[ -n $nodeps ]] && ! "$venv_py" -m pip install --disable-pip-version-check --no-input \
        --progress-bar off -q --no-deps -r "$nodeps"; then
        die "$dir: pip install --no-deps -r ${nodeps#"$REPO_ROOT"/} failed"
    fi
    printf '%s\n%s\n%s\n' "$digest" "${req#"$REPO_ROOT"/}" "${nodeps#"$REPO_ROOT"/}" >"$stamp"
    flock -u "$lockfd"
    exec {lockfd}>&-
}

# --- Debian packages ----------------------------------------------------------
# _debian_missing PKG...: prints the packages dpkg does not list as installed.
_debian_missing() {
    local pkg
    for pkg in "$@"; do
        if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
            printf '%s\n' "$pkg"
        fi
    done
}

# ensure_debian_packages PKG...: install what is missing, or say how and exit 1.
# COORDINATION_INSTALL_PACKAGES=0 never installs (only says what is missing).
ensure_debian_packages() {
    local missing=() sudo=() pkg
    (($#)) || return 0
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        die "not a Debian system (no dpkg-query/apt-get); install the equivalents of: $*
       (or point COORDINATION_TEST_DATABASE_URL / COORDINATION_TEST_REDIS_URL / CHROMIUM_PATH at yours)"
    fi
    while IFS= read -r pkg; do
        [[ -n $pkg ]] && missing+=("$pkg")
    done < <(_debian_missing "$@")
    if ((${#missing[@]} == 0)); then
        info "system packages: all present ($*)"
        return 0
    fi
    local command="apt-get install -y --no-install-recommends ${missing[*]}"
    if [[ $EUID -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            die "missing Debian packages: ${missing[*]}
       bin/test installs them itself as root or with sudo that needs no password; here it cannot.
       Install them, then run bin/test again:
         sudo apt-get update && sudo $command"
        fi
    fi
    if [[ ${COORDINATION_INSTALL_PACKAGES:-1} == 0 ]]; then
        die "missing Debian packages: ${missing[*]} (COORDINATION_INSTALL_PACKAGES=0). Install them:
         ${sudo[*]:+sudo }apt-get update && ${sudo[*]:+sudo }$command"
    fi
    info "system packages: installing ${missing[*]}"
    "${sudo[@]}" apt-get update -q || die "apt-get update failed"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${missing[@]}" || die "apt-get install ${missing[*]} failed"
    missing=()
    while IFS= read -r pkg; do
        [[ -n $pkg ]] && missing+=("$pkg")
    done < <(_debian_missing "$@")
    ((${#missing[@]} == 0)) || die "still missing after apt-get install: ${missing[*]}"
}
