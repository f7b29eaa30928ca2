"""HTTP plumbing shared by the SDK and the cluster gateway (private).

``http11``: a small HTTP/1.1 client on bare asyncio protocols (the unary calls' keep-alive connections);
``connections``: node URLs, the connections to many nodes per event loop, and the mapping of every failure
to a :class:`dsec.DSecError`. Neither knows what the calls mean: :mod:`dsec.api` does.
"""
