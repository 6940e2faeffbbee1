"""Cache tiers: the device block pool, the CPU and disk (LMDB) tiers, the block record format the disk
tier stores, and the hierarchy that walks them.

Knows nothing of the engine."""
