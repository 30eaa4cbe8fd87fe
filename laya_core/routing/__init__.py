"""Which replica serves a request: the router contract and the pure-Python reference router."""
