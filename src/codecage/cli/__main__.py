"""`python -m codecage.cli`: the same as the `codecage` command."""

from codecage.cli import main

main()
