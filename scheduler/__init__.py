"""Pure scheduling policy: no Redis, no asyncio, no clocks of its own.

The gateway, the workers and the simulator call these functions with
the facts they observed (times in milliseconds, queue heads, loads) and act on
the answers. Everything here is deterministic and unit-tested with fabricated
inputs.
"""
