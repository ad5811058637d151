"""`python -m fragsearch.training.extract`, as the docs write it: the alias of the command line
(fragsearch/commands/extract.py), which extracts a data folder's image fragments into the feature cache."""

if __name__ == "__main__":
    from fragsearch.commands.extract import main

    main()
