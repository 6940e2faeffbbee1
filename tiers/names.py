"""The tiers' names, top down. Torch-free, so the serving layer's metrics can read them cheaply."""

TIER_NAMES = ("device", "cpu", "disk", "remote")  # top down: the order in which a prefix is looked up
LOWER_TIER_NAMES = TIER_NAMES[1:]                 # the tiers below the device (`LowerTier`s)
