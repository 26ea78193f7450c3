#!/usr/bin/env bash
# Opt-in: install the real agent frontends at pinned versions into a project-local prefix
# (./.agents), for `mars agents run` and tests/test_frontends.py: the OpenAI Codex CLI and OpenCode
# (npm, PREFIX/node_modules/.bin) and the OpenHands SDK with its tools and litellm (PyPI, their own
# Python 3.12 venv PREFIX/openhands: the SDK needs Python >= 3.12 and mcp<2, vLLM needs mcp>=2, so
# they cannot share the project's venv). Idempotent: a second run with the same pins only checks
# stamps. Needs node >= 18 and npm (each CLI ships its native binary inside an npm package) and a
# Python 3.12 (python3.12 on PATH, or pyenv's); reaches only the npm registry and PyPI.
#
# Environment:
#   MARS_AGENTS_PREFIX  install prefix (default: ./.agents; binaries end up in PREFIX/node_modules/.bin)
#   MARS_AGENTS_SANDBOX=0  do not try to install bubblewrap (the per-session sandbox) with apt-get
#   OPENHANDS_PYTHON    the Python >= 3.12 for the OpenHands venv (default: python3.12, else pyenv's 3.12)
#   MARS_AGENTS_OPENHANDS=0  skip the OpenHands SDK
set -euo pipefail

cd "$(dirname "$0")/.."
PREFIX=${MARS_AGENTS_PREFIX:-$(pwd)/.agents}
# Pins: bump together with docs/frontends.md (the configs there were checked against these).
CODEX=@openai/codex@0.171.0
OPENCODE=opencode-ai@1.18.33
OPENHANDS=(openhands-sdk==1.58.2 openhands-tools==1.58.2 litellm==1.105.7)

log() { printf '[setup_agents] %s\n' "$*" >&2; }

if ! command -v npm >/dev/null 2>&1; then
  log "npm not found: install Node.js >= 18 (e.g. apt-get install nodejs npm) and re-run"
  exit 1
fi

if ! command -v bwrap >/dev/null 2>&1 && [[ "${MARS_AGENTS_SANDBOX:-1}" != 0 ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing bubblewrap (the per-session sandbox)"
    (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }) \
      || log "could not install bubblewrap: sessions need --unsandboxed"
  else
    log "bubblewrap (bwrap) not found and not root: install it, or run sessions with --unsandboxed"
  fi
fi

install_openhands() {
  [[ "${MARS_AGENTS_OPENHANDS:-1}" == 0 ]] && { log "OpenHands skipped (MARS_AGENTS_OPENHANDS=0)"; return 0; }
  local py=${OPENHANDS_PYTHON:-} c
  if [[ -z "$py" ]]; then  # python3.12 on PATH (a pyenv shim may not run), else pyenv's own 3.12
    for c in $(command -v python3.12 || true) $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1); do
      if "$c" -c 'import sys' 2>/dev/null; then py=$c; break; fi
    done
  fi
  if [[ -z "$py" ]] || ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    log "no Python >= 3.12 found (set OPENHANDS_PYTHON): the OpenHands SDK needs one; skipped"
    return 0
  fi
  local venv="$PREFIX/openhands" want="${OPENHANDS[*]} $("$py" -c 'import sys; print(sys.version.split()[0])')"
  if [[ -f "$venv/.mars-openhands-stamp" && "$(cat "$venv/.mars-openhands-stamp")" == "$want" ]] \
     && "$venv/bin/python" -c 'from importlib.metadata import version; version("openhands-sdk"); version("openhands-tools")' 2>/dev/null; then
    log "OpenHands SDK up to date in $venv"
    return 0
  fi
  log "installing ${OPENHANDS[*]} into $venv (Python $("$py" -c 'import sys; print(sys.version.split()[0])'))"
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${OPENHANDS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
  OPENHANDS_SUPPRESS_BANNER=1 LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" -c 'import openhands.sdk, openhands.tools.terminal, openhands.tools.file_editor'
  echo "$want" > "$venv/.mars-openhands-stamp"
}

WANT="$CODEX $OPENCODE $(node --version)"
STAMP="$PREFIX/.mars-agents-stamp"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$PREFIX/node_modules/.bin/codex" \
      && -x "$PREFIX/node_modules/.bin/opencode" ]]; then
  log "agent CLIs up to date in $PREFIX"
else
  mkdir -p "$PREFIX"
  log "installing $CODEX $OPENCODE into $PREFIX"
  npm install --prefix "$PREFIX" --no-save --no-audit --no-fund --loglevel=error "$CODEX" "$OPENCODE" >&2
  "$PREFIX/node_modules/.bin/codex" --version >&2
  "$PREFIX/node_modules/.bin/opencode" --version >&2
  echo "$WANT" > "$STAMP"
fi
install_openhands
log "done"
