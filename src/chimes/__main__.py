from chimes.cli.main import main

main()
