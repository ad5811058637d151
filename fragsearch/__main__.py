"""python -m fragsearch: the same as the `fragsearch` command."""

from fragsearch.cli import main

main()
