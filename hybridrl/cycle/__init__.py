"""The hybrid cycle: who holds the device when (engine_cycle.py, the one home of the memory order),
the weight hand-off and its probe (sync.py), and the memory plan (plan.py; its probes and allocator
policy are core/memory.py)."""
