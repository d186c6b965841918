from scheduler_proc.main import main

main()
