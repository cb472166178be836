from vca_patch.cli import main

main()
