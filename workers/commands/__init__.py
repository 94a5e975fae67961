"""The ``fisherscope`` subcommands, one module per concern; ``workers.cli`` parses and dispatches."""
