"""The core's own plugins, registered exactly as third-party plugins are."""
