"""Real agent frontends (Codex CLI, OpenCode) driven as concurrent sandboxed sessions: ``mars agents run``.

``frontends`` knows each CLI (config, command line, JSON output), ``proxy`` measures every call a
session makes, ``runner`` runs the sessions into a run directory, ``tasks`` reads task files.
Importing this package imports neither vllm nor :mod:`vllm_mars.engine`.
"""
