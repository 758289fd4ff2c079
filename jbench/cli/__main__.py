from jbench.cli import main

main()
