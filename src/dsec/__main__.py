"""``python -m dsec``: the same as the ``dsec`` command."""

from dsec.cli import main

main(prog_name="dsec")
