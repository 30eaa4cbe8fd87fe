"""Weighted random routing for Laya: the ``random`` router."""
