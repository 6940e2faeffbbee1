"""Cache tiers: the device block pool, the CPU and disk (LMDB) tiers, and the hierarchy that walks them.

Knows nothing of the engine."""
