"""The scheduler's mirror of the worker's KV block accounting (the paged cache of protocol 1.4).

The worker's target cache is ``num_blocks`` blocks of ``block_size`` tokens. Between steps a
request holds ``ceil(num_computed / block_size)`` of them (the worker gives back the blocks wholly
past its computed length after every step); a step that runs n tokens of it needs
``ceil((num_computed + n) / block_size)``. The scheduler counts the same, so the worker never
refuses a step for lack of blocks (``no_kv_blocks``).

With overlap scheduling the scheduler does not yet know what the steps in flight computed: it
counts the most they can have (every in-flight token computed and every in-flight draft accepted),
so its count is an upper bound and still never over-commits the worker.
"""

from __future__ import annotations

from scheduler_client.request import Request


class KVBlocks:
    """Owned by the ``Scheduler``; stateless but for the worker's two numbers."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the worker's KV cache needs at least one block of one token")
        self.num_blocks = num_blocks
        self.block_size = block_size

    # A request's bound b = num_computed + num_inflight + inflight_max_new: the most positions the
    # worker can have computed for it once the steps in flight are done (exact in sync mode:
    # nothing is in flight when the scheduler schedules); it holds ceil(b / block_size) blocks.
    # ``held``, ``room`` and ``take`` spell that out: the scheduler calls them a few times per
    # request and step, and at batch 64 nested calls cost more than the arithmetic
    # (``bench/zero_width_bench.py --kv-blocks``)

    def held(self, req: Request) -> int:
        """Blocks ``req`` holds between steps."""
        return -(-(req.num_computed + req.num_inflight + req.inflight_max_new) // self.block_size)

    def num_free(self, running: list[Request]) -> int:
        return self.num_blocks - sum(self.held(r) for r in running)

    def room(self, req: Request, free: int) -> int:
        """Tokens ``req`` can run this step with ``free`` blocks left besides its own."""
        bound, size = req.num_computed + req.num_inflight + req.inflight_max_new, self.block_size
        return (-(-bound // size) + free) * size - bound

    def take(self, req: Request, num_tokens: int) -> int:
        """Blocks a step of ``num_tokens`` tokens of ``req`` takes beyond those it holds."""
        bound, size = req.num_computed + req.num_inflight + req.inflight_max_new, self.block_size
        return -bound // size - -(bound + num_tokens) // size  # ceil((b + n) / s) - ceil(b / s)
