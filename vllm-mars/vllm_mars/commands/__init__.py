"""Subcommands of the ``mars`` CLI, one module per area.

A handler imports at call time only what ``mars --help`` does not load already (vLLM and torch, the
sidecar's server stack, aiohttp, the sim's profiles, the trace converters), so help stays fast and
never imports vLLM; everything help loads anyway is imported at module level.
"""
