"""What a run asks for: the recipe as the user wrote it (``recipe``: YAML, overrides, each setting checked)
and resolved for this machine (``plan``: the store and engine settings, every rule between settings)."""
