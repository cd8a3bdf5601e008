from batchvl.cli import main

main()
