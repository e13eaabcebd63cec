from .offline.cli import main

main()
