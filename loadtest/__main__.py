"""`python -m loadtest`: see loadtest.cli."""

from loadtest.cli import main

if __name__ == "__main__":
    main()
