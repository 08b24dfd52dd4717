from kvcli.cli.app import main

main()
