from ._tools.cli import main

main()
