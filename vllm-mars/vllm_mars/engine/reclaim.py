"""Retention and reclaim at vLLM's KV seams: keeping a finished call's blocks, and giving retained
blocks back before vLLM preempts anybody.

* :func:`retain_finished` (from ``_free_blocks``): hold a finished tagged call's cached blocks in
  the :class:`~vllm_mars.engine.retention.RetentionStore` for the policy's retention time.
* :func:`install_reclaim` wraps the KV cache manager's ``allocate_slots``: a failed allocation
  releases retained KV (lowest value first) and retries, then lets the scheduler rank its victims
  right before vLLM preempts.
"""

from __future__ import annotations

from itertools import chain, compress, filterfalse
from operator import attrgetter
from typing import Any

from vllm.v1.request import Request, RequestStatus

from vllm_mars.policies import CallView

_RUNNING = RequestStatus.RUNNING
#: (a block's hash key is non-empty bytes or None: truthiness is ``is not None``); the field behind
#: vLLM's ``block_hash`` property, read at C speed (a finished context is thousands of blocks)
_HASH, _NULL = attrgetter("_block_hash"), attrgetter("is_null")


def retain_finished(sched: Any, request: Request, call: CallView) -> None:
    """Hold ``request``'s cached blocks for the policy's retention time (none when it says 0)."""
    # the cached (hashed), non-null blocks, filtered at C speed: a context is thousands of blocks
    blocks = list(chain.from_iterable(filterfalse(_NULL, compress(group, map(_HASH, group)))
                                      for group in sched.kv_cache_manager.get_blocks(request.request_id).blocks))
    if not blocks:
        return
    policy = sched.mars_policy
    tau = policy.retention_s(call, len(blocks))
    if tau > 0:
        value = policy.retention_value(call, len(blocks))
        sched.retention.hold(call.workflow.workflow, request.request_id, blocks, sched.clock.now(), tau, value)


def install_reclaim(sched: Any) -> None:
    """Wrap ``sched.kv_cache_manager.allocate_slots`` (see the module docstring)."""
    manager = sched.kv_cache_manager
    allocate = manager.allocate_slots
    store = sched.retention

    def allocate_slots(request, num_new_tokens, *args, **kwargs):
        blocks = allocate(request, num_new_tokens, *args, **kwargs)
        if blocks is None and store and reclaim_can_help(sched, request, num_new_tokens, kwargs):
            # Retained KV of finished calls goes before anybody's running state.
            while blocks is None and store:
                store.release_lowest_value(sched.clock.now())  # the clock set_clock may swap in later
                blocks = allocate(request, num_new_tokens, *args, **kwargs)
        if blocks is None and not sched._victims_ranked and request.status == _RUNNING:
            sched._rank_victims()  # vLLM preempts next, by these ranks
        return blocks

    manager.allocate_slots = allocate_slots


def reclaim_can_help(sched: Any, request: Request, num_new_tokens: int, kwargs: dict[str, Any],
                     free: int | None = None) -> bool:
    """False only when even releasing every retained block could not satisfy this allocation
    (``free``: the pool's free blocks, default now).

    A lower bound on the new blocks it needs (ignoring vLLM's watermark and cached hits that
    sit in the free queue) is compared with free + retained blocks; without that check a
    waiting call that cannot fit anyway would drop all retention every step.
    """
    groups = sched.kv_cache_manager.coordinator.single_type_managers
    if len(groups) != 1:
        return True
    if kwargs.get("full_sequence_must_fit"):
        tokens = request.num_tokens
    else:
        tokens = (request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
                  + kwargs.get("num_external_computed_tokens", 0) + num_new_tokens)
    tokens = min(tokens, sched.max_model_len)
    held = len(groups[0].req_to_blocks.get(request.request_id, ()))
    hit = kwargs.get("new_computed_blocks")
    hits = len(hit.blocks[0]) if hit is not None else 0
    need = -(-tokens // sched.block_size) - held - hits
    return need <= (sched.free_blocks() if free is None else free) + sched.retention.num_blocks
