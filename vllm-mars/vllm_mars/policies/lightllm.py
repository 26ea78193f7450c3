"""``lightllm``: LightLLM router's peak-token-demand admission.

Source: LightLLM (ModelTC/lightllm) router, ``router/req_queue/continues_batch/impl.py`` (the
admission check) and ``core/objs/req.py`` (``get_tuple_tokens``: the output-length estimate); no
paper section, the code is the reference.

Rule
----
The head of the waiting queue (FCFS) may start only when the predicted peak KV demand of the
running calls plus this candidate fits the pool. For each call: ``has_run`` = prompt + output
tokens so far, ``left`` = estimated output tokens still to come. Sorted by ``left`` descending,
with 1-based ``i``::

    peak = max_i (left_i * i + sum_{j <= i} has_run_j)        admit iff peak < capacity

(at the moment the i-th longest call would finish, the i longest are alive and each grew by
``left_i``; the shorter ones have freed their KV.) ``capacity`` = usable blocks * block size, in
tokens. Admission stops at the first call that does not fit (head-of-line, as in LightLLM).

Output estimate: ``est = max_tokens`` when the engine is busy (``used / capacity >=
router_token_ratio``; LightLLM's default ratio 0.0 makes it always busy), else
``min(max_tokens, max(int(1.1 * out_so_far), ema_out))``; ``left = max(est - out_so_far - 1, 0)``.
``ema_out`` starts at ``router_max_new_token_len`` and follows finished calls' output lengths.

Our choices where the code is open or does not apply
----------------------------------------------------
* Token counts are per call: a prefix shared by several calls is counted once per call, and a
  call's partly filled last block is not rounded up (LightLLM has token-granular pages).
* ``ignore_eos`` is not visible to policies; with the default ratio 0.0 every estimate is
  ``max_tokens`` anyway, which is what ``ignore_eos`` would give.
* When nothing is running the head is always admitted, so a call whose own estimate exceeds the
  pool still runs (LightLLM would reject it at the API); vLLM then preempts as usual.
* Order and victims stay vLLM's (FCFS; the newest running call is preempted first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_mars.policies.base import CallView, Policy, register_policy


@dataclass(frozen=True)
class LightLLMConfig:
    #: Busy threshold on KV usage; at or above it the estimate is ``max_tokens`` (LightLLM: 0.0).
    router_token_ratio: float = 0.0
    #: Initial output-length estimate (tokens) before any call has finished (LightLLM: 1024).
    router_max_new_token_len: int = 1024
    #: Weight of each finished call's output length in the EMA (our choice).
    ema_alpha: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.router_token_ratio <= 1.0:
            raise ValueError(f"router_token_ratio must be in [0, 1], got {self.router_token_ratio}")
        if self.router_max_new_token_len < 1:
            raise ValueError(f"router_max_new_token_len must be >= 1, got {self.router_max_new_token_len}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")


def peak_demand(items: list[tuple[int, int]]) -> int:
    """``max_i(left_i * i + sum_{j<=i} has_run_j)`` over (left, has_run) pairs sorted by left desc."""
    items.sort(reverse=True)
    peak = cum = 0
    for i, (left, has_run) in enumerate(items, 1):
        cum += has_run
        v = left * i + cum
        peak = max(peak, v)
    return peak


@register_policy
class LightLLMPolicy(Policy):
    """Admit the head waiting call only when the predicted peak token demand fits."""

    name = "lightllm"
    Config = LightLLMConfig
    gates = True

    def __init__(self, config: Any = None, clock=None) -> None:
        super().__init__(config, clock)
        self.ema_out = float(self.config.router_max_new_token_len)
        self.last_peak = 0

    def on_finished(self, call: CallView, aborted: bool) -> None:
        if not aborted:
            a = self.config.ema_alpha
            self.ema_out = (1.0 - a) * self.ema_out + a * call.num_output_tokens

    def left_tokens(self, call: CallView, busy: bool) -> int:
        out = call.num_output_tokens
        if busy:
            est = call.max_tokens
        else:
            est = min(call.max_tokens, max(int(1.1 * out), int(self.ema_out)))
        return max(est - out - 1, 0)

    def may_start(self, call: CallView) -> bool:
        eng = self.engine
        running = eng.running_calls()
        if not running:
            return True
        capacity = eng.num_blocks * eng.block_size
        ratio = self.config.router_token_ratio
        busy = ratio <= 0.0 or (eng.num_blocks - eng.free_blocks()) / eng.num_blocks >= ratio
        left = self.left_tokens
        items = [(left(c, busy), c.num_tokens) for c in running]
        items.append((left(call, busy), call.num_tokens))
        self.last_peak = peak_demand(items)
        return self.last_peak < capacity
