"""Which vLLM tool-call parser fits a model, for ``mars serve`` (pure Python: reads config.json only).

Agent frontends send ``tools`` with ``tool_choice: "auto"`` (OpenCode always; Codex through the
Responses API); vLLM answers 400 to that unless its server runs with ``--enable-auto-tool-choice
--tool-call-parser NAME``. ``mars serve`` therefore turns tool calling on by default with the parser
chosen here, and says which in its log; ``--tool-call-parser NAME|none`` overrides it.

Rules (first match): a name containing ``qwen3-coder`` -> ``qwen3_coder`` (its XML tool format);
``gpt_oss`` -> ``openai`` (harmony); Qwen2/Qwen3 (also the tiny test model, a Qwen3) -> ``hermes``
(``<tool_call>{json}</tool_call>``, what Qwen's chat templates emit); Llama -> ``llama3_json``;
Mistral -> ``mistral``; anything else -> ``hermes`` as a fallback, flagged as a guess in the reason.

vLLM's parser registry is imported only to check a name: ``mars serve`` picks the parser before it imports vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: model_type (config.json) -> parser
_BY_MODEL_TYPE = {
    "qwen3": "hermes", "qwen3_moe": "hermes", "qwen2": "hermes", "qwen2_moe": "hermes",
    "gpt_oss": "openai", "llama": "llama3_json", "mistral": "mistral",
}


@dataclass(frozen=True)
class ToolParserChoice:
    """The parser (None: tool calling off) and why, for the log line."""

    parser: str | None
    reason: str

    def server_args(self) -> list[str]:
        """vLLM server arguments that enable it (none when off)."""
        return [] if self.parser is None else ["--enable-auto-tool-choice", "--tool-call-parser", self.parser]


def _model_type(model: str) -> str | None:
    cfg = Path(model) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    mt = data.get("model_type") if isinstance(data, dict) else None
    return mt if isinstance(mt, str) else None


def choose_tool_parser(model: str, served_model_name: str | None = None,
                       override: str | None = None) -> ToolParserChoice:
    """Pick the parser for ``model`` (a local dir or a hub name). ``override``: a parser name, or
    ``none`` to leave tool calling off."""
    if override is not None:
        if override.lower() == "none":
            return ToolParserChoice(None, "--tool-call-parser none")
        return ToolParserChoice(override, "--tool-call-parser")
    names = f"{model} {served_model_name or ''}".lower().replace("_", "-")
    mt = _model_type(model)
    if "qwen3-coder" in names:
        return ToolParserChoice("qwen3_coder", "Qwen3-Coder model name")
    if mt in _BY_MODEL_TYPE:
        return ToolParserChoice(_BY_MODEL_TYPE[mt], f"config.json model_type {mt}")
    if "qwen" in names:
        return ToolParserChoice("hermes", "Qwen model name")
    return ToolParserChoice("hermes", f"fallback guess (model_type {mt or 'unknown'}); "
                                      "set --tool-call-parser NAME or none")


def user_set_tool_calling(vllm_args: list[str]) -> bool:
    """True when the user's own ``--vllm-args`` already configure tool calling."""
    return any(a.split("=", 1)[0] in ("--tool-call-parser", "--enable-auto-tool-choice") for a in vllm_args)


def user_tool_parser(vllm_args: list[str]) -> str | None:
    """The parser named by ``--tool-call-parser NAME`` (or ``=NAME``) in the user's ``--vllm-args``."""
    for i, a in enumerate(vllm_args):
        if a.startswith("--tool-call-parser="):
            return a.split("=", 1)[1] or None
        if a == "--tool-call-parser" and i + 1 < len(vllm_args):
            return vllm_args[i + 1]
    return None


def known_parsers() -> set[str]:
    """Tool-call parser names this vLLM registers (imports vllm.tool_parsers only)."""
    from vllm.tool_parsers import ToolParserManager

    return set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)


def validate_parser(name: str) -> None:
    """ValueError naming the valid parsers when ``name`` is neither one nor ``none``."""
    if name.lower() == "none":
        return
    known = known_parsers()
    if name not in known:
        raise ValueError(f"--tool-call-parser {name!r} unknown; vLLM has: {', '.join(sorted(known))} (or none)")
