"""`python -m kvevict.cli`: the same as the `kvevict` script."""

from . import main

main()
