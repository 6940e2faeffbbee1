"""Cache tiers: the device block pool, the CPU, disk (LMDB) and remote (Valkey/Redis) tiers, the block
record format the disk and remote tiers store, and the hierarchy that walks them.

Knows nothing of the engine. Importing the package is cheap (no torch): the serving layer's metrics
read the tier names from here.
"""

TIER_NAMES = ("device", "cpu", "disk", "remote")  # top down: the order in which a prefix is looked up
LOWER_TIER_NAMES = TIER_NAMES[1:]                 # the tiers below the device (`LowerTier`s)
