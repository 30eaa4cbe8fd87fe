"""A replica behind one contract, whatever carries it: in-process, a worker process, a Ray actor."""
