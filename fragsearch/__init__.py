"""The `fragsearch` command (fragsearch/cli.py): one command line over the service, the indexer and the trainer."""
