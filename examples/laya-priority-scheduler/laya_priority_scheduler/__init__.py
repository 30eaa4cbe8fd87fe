"""Priority tiers for Laya: the ``priority`` scheduler."""
