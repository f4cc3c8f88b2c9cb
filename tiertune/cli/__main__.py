from tiertune.cli.app import main

main()
