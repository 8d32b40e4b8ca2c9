"""Loading a saved model moved to memlm.hf.load; this name stays for scripts that import it."""

from memlm.hf.load import LoadedModel, data_config, load_model  # noqa: F401
