"""The tool a finished call is about to run, read from its output with vLLM's own tool-call parser.

When the scheduler is given a parser name (``additional_config["mars"]["tool_parser"]``; ``mars
serve`` passes the one it starts vLLM's OpenAI server with), a tagged call that finishes normally
and is not its workflow's last step has its output detokenized with the model's tokenizer and handed
to that parser (:class:`vllm.tool_parsers.ToolParserManager`); the first tool call's function name
becomes the call's ``next_tool``, which retention prices the coming gap by
(:func:`vllm_mars.policies.gaps.gap_tool`).

Bounded and safe: only the last :data:`MAX_OUTPUT_TOKENS` output tokens are parsed (a tool call
whose opening lies before them is not seen), a fresh parser instance per read (no streaming state
carried between calls), and any failure (the parser's, the tokenizer's, a name that is no valid
tool id) reads as unknown, logged once at debug level; nothing raises into the scheduler.

vLLM's parser, protocol and tokenizer modules are imported only when a parser is configured: they
pull in vLLM's OpenAI server stack, which an engine without ``tool_parser`` never needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_mars.engine.tool_calling import validate_parser
from vllm_mars.workflow import MAX_ID_CHARS

logger = logging.getLogger(__name__)

#: Output tokens parsed at most (the tail of the output, where a tool call ends a turn).
MAX_OUTPUT_TOKENS = 4096


class NextToolReader:
    """Reads the first tool call's name from output token ids with one of vLLM's tool parsers."""

    def __init__(self, parser: str, tokenizer: Any, max_tokens: int = MAX_OUTPUT_TOKENS) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        validate_parser(parser)  # ValueError naming vLLM's parsers
        self.parser = parser
        self._cls = ToolParserManager.get_tool_parser(parser)
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        # The parsers take the chat request for its tool schemas; we have none (names only).
        self._request = ChatCompletionRequest(messages=[], model="mars")
        self._failed = False

    @classmethod
    def for_model(cls, parser: str, model_config: Any) -> NextToolReader | None:
        """A reader over ``model_config``'s tokenizer; None (with a warning) when it cannot load.
        An unknown parser name is a ValueError (a configuration error, raised at engine start)."""
        from vllm.tokenizers import cached_get_tokenizer

        validate_parser(parser)
        try:
            tokenizer = cached_get_tokenizer(
                model_config.tokenizer, tokenizer_mode=model_config.tokenizer_mode,
                revision=model_config.tokenizer_revision, trust_remote_code=model_config.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - no tokenizer: run without reading the next tool
            logger.warning("tool_parser %s: cannot load the tokenizer of %s (%s); the next tool is not read "
                           "from outputs", parser, model_config.tokenizer, e)
            return None
        return cls(parser, tokenizer)

    def read(self, output_token_ids: Sequence[int]) -> str | None:
        """The first tool call's function name in the output, or None (no call, or any failure)."""
        try:
            ids = list(output_token_ids[-self._max_tokens:])
            if not ids:
                return None
            text = self._tokenizer.decode(ids, skip_special_tokens=False)
            info = self._cls(self._tokenizer).extract_tool_calls(text, self._request)
            if not info.tools_called or not info.tool_calls:
                return None
            name = info.tool_calls[0].function.name
        except Exception:  # whatever the model wrote, the scheduler goes on
            if not self._failed:
                self._failed = True
                logger.debug("tool_parser %s failed on an output; next tool unknown", self.parser,
                             exc_info=True)
            return None
        return name if isinstance(name, str) and 0 < len(name) <= MAX_ID_CHARS else None
