"""`python -m torchmigrate` runs the same CLI as the `torchmigrate` console script."""

from torchmigrate.cli.commands import main

if __name__ == "__main__":
    main()
