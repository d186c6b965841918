from detokenizer_proc.main import main

main()
