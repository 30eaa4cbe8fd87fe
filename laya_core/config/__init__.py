"""What the user asked for: the manifest's tables, the command line's sources and settings."""
