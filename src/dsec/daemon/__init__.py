"""The node daemon: engine (records, timeouts, recovery), state store, thin HTTP app, metrics, server.

Import the pieces from their modules (``dsec.daemon.engine``...); this package front stays empty so
importing :mod:`dsec.daemon` never pulls FastAPI or uvicorn into a process that does not serve.
"""
