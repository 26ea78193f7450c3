#!/usr/bin/env bash
# Opt-in: install the real agent CLIs (OpenAI Codex CLI, OpenCode) at pinned versions into a
# project-local npm prefix (./.agents), for `mars agents run` and tests/test_frontends.py.
# Idempotent: a second run with the same pins only checks a stamp. Needs node >= 18 and npm, and
# reaches only the npm registry (each CLI ships its native binary inside a platform package there).
#
# Environment:
#   MARS_AGENTS_PREFIX  install prefix (default: ./.agents; binaries end up in PREFIX/node_modules/.bin)
#   MARS_AGENTS_SANDBOX=0  do not try to install bubblewrap (the per-session sandbox) with apt-get
set -euo pipefail

cd "$(dirname "$0")/.."
PREFIX=${MARS_AGENTS_PREFIX:-$(pwd)/.agents}
# Pins: bump together with docs/frontends.md (the configs there were checked against these).
CODEX=@openai/codex@0.171.0
OPENCODE=opencode-ai@1.18.33

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

WANT="$CODEX $OPENCODE $(node --version)"
STAMP="$PREFIX/.mars-agents-stamp"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$PREFIX/node_modules/.bin/codex" \
      && -x "$PREFIX/node_modules/.bin/opencode" ]]; then
  log "agent CLIs up to date in $PREFIX"
  exit 0
fi

mkdir -p "$PREFIX"
log "installing $CODEX $OPENCODE into $PREFIX"
npm install --prefix "$PREFIX" --no-save --no-audit --no-fund --loglevel=error "$CODEX" "$OPENCODE" >&2
"$PREFIX/node_modules/.bin/codex" --version >&2
"$PREFIX/node_modules/.bin/opencode" --version >&2
echo "$WANT" > "$STAMP"
log "done"
