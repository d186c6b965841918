from pegainfer.cli import main

main()
