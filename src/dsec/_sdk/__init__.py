"""The SDK's implementation: AsyncSandbox (source of truth), Sandbox (derived), Client, transport.

Private: users import from ``dsec``. Nothing here runs on the daemon side.
"""
