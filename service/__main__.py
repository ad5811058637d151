"""`python -m fragsearch.service`, the embedded default as the README writes it: the alias of `fragsearch serve`
(fragsearch/commands/serve.py), which serves on 127.0.0.1:8000 at once and prepares what is missing meanwhile."""

if __name__ == "__main__":
    import sys

    from fragsearch.commands.serve import main

    sys.exit(main())
