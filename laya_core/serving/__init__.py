"""A running deployment: its replicas, the router in front, chat prompts and the Hypercorn server."""
