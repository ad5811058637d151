"""`python -m fragsearch.service.settings --markdown`, as the docs write it: the alias of the settings table's
command (fragsearch/commands/options.py)."""

if __name__ == "__main__":
    from fragsearch.commands.options import main

    main()
