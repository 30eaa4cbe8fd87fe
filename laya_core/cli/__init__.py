"""The ``laya`` command and what it sets up: logging, systemd units."""
