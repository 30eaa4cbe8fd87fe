"""The engine of one replica: its loop, scheduler, step plan, per-request state, detokenizer and streams."""
