"""The commands of the index package (build, bulk, sync: `fragsearch index`, duplicates) and the flags made from an
index's settings: each reads the settings and its flags once and calls the library with arguments. `python -m
fragsearch.index.build` and the like are aliases that call them (the docs' commands)."""
