"""Named configurations (`*.toml`) that `config.resolve` loads through importlib.resources; no code, imports
nothing. A preset file is data: the same schema as a user's --config file."""
