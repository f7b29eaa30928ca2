"""Drop-in adapters for the harnesses evaluation and RL teams already run: inspect-ai, harbor and SWE-ReX.

Each adapter lives in its own module and imports its harness only there, so that ``import dsec`` never needs
one; each harness is an optional extra of the package (``dsec[inspect]``, ``dsec[harbor]``, ``dsec[swerex]``).
"""
